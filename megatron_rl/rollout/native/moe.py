"""The native engine's mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE, GLM-4.5) and its routing record.

Router (`route`; transformers' MixtralTopKRouter / Qwen3MoeTopKRouter): logits = h W_r^T, softmax over all
experts in fp32, top-k, and (`ModelArch.moe_norm_topk_prob`) the k weights renormalized to sum to 1; or
GLM-4.5's sigmoid router with its expert bias, groups and scaling. Each expert is a SwiGLU MLP; a token's
output is the weighted sum of its k experts' outputs, plus a shared SwiGLU expert's output on every token
(Qwen2-MoE: scaled by sigmoid(h w_g)), added after the routed sum as transformers adds it.

Batched on CPU without a per-token loop: the (token, slot) pairs of a step are sorted by expert (stable, so
a token's contributions are added in ascending expert order, as transformers does), each expert that got
tokens runs two matmuls on its contiguous run of gathered rows, and one `index_add_` scatters the weighted
outputs back. A decode step of B sequences therefore costs at most min(E, B * k) expert matmul pairs.

Arena layout (weights.py): per layer one block [router], one block [gate_0, up_0, gate_1, up_1, ...] and one
block [down_0, down_1, ...], under the published per-expert HF names (what `save_pretrained` writes and
SGLang loads). The middle block is exactly transformers 5's in-memory `mlp.experts.gate_up_proj` [E, 2I, H]
and the last its `mlp.experts.down_proj` [E, H, I], so those fused names are accepted too (same memory).

Routing record (`NativeEngineConfig.record_routing`): every forward fills an int16 [N, layers, k] tensor of
the chosen expert ids (top-k order: descending router probability; -1 in the rows of dense layers); the scheduler copies each row into its
sequence's buffer (`store_routing`), prefix-shared prompt rows from the donor sequence, and the completion
carries rows [0, P + R - 1) (`routing_record`). A running sequence holds at most
min(P + max_new_tokens, max_seq_len) x layers x k int16 values; nothing is kept once it completes.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.families import (
    get_family,
    hf_expert_bias_names,
    hf_expert_names,
    hf_router_bias_name,
    hf_router_logit_bias_name,
    hf_router_name,
    hf_shared_expert_names,
)


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """HF names of one layer's router and experts (published per-expert form)."""

    router: str
    gate: tuple[str, ...]
    up: tuple[str, ...]
    down: tuple[str, ...]
    fused_router: str
    """transformers 5's in-memory name of the router (equal to `router` for Qwen3-MoE)."""
    fused_gate_up: str
    """transformers 5's in-memory [E, 2I, H] tensor: per expert its gate rows, then its up rows."""
    fused_down: str
    """transformers 5's in-memory [E, H, I] tensor."""


def expert_names(arch: ModelArch, layer: int) -> ExpertNames:
    """The HF names of layer `layer`'s MoE tensors for the model's family."""
    family = get_family(arch.family)
    if not family.moe_block:
        raise ConfigError(f"model family {arch.family!r} has no mixture-of-experts layers "
                          f"(num_experts={arch.num_experts})", field="num_experts")
    gate, up, down = zip(*(hf_expert_names(family, layer, e) for e in range(arch.num_experts)))
    p = f"model.layers.{layer}."
    return ExpertNames(hf_router_name(family, layer), gate, up, down, fused_router=p + "mlp.gate.weight",
                       fused_gate_up=p + "mlp.experts.gate_up_proj", fused_down=p + "mlp.experts.down_proj")


def arena_blocks(arch: ModelArch, layer: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The arena blocks of one layer's MoE (tensors adjacent within a block): router; gate/up interleaved
    per expert ([E, 2I, H] as one view); downs ([E, H, I] as one view); a shared expert's gate/up ([2S, H]),
    its down and its sigmoid gate [1, H]."""
    n = expert_names(arch, layer)
    h, i = arch.hidden_size, arch.moe_ffn_hidden_size
    gate_up = [t for e in range(arch.num_experts) for t in ((n.gate[e], (i, h)), (n.up[e], (i, h)))]
    blocks = [[(n.router, (arch.num_experts, h))], gate_up, [(d, (h, i)) for d in n.down]]
    if arch.moe_router_expert_bias:
        blocks.append([(hf_router_bias_name(get_family(arch.family), layer), (arch.num_experts,))])
    if arch.moe_router_bias:
        blocks.append([(hf_router_logit_bias_name(get_family(arch.family), layer), (arch.num_experts,))])
    if arch.expert_biases:  # per expert its gate then up bias ([E, 2I] as one view); downs ([E, H])
        biases = [hf_expert_bias_names(get_family(arch.family), layer, e) for e in range(arch.num_experts)]
        blocks += [[t for g, u, _ in biases for t in ((g, (i,)), (u, (i,)))], [(d, (h,)) for _, _, d in biases]]
    if arch.shared_expert_ffn_hidden_size:
        s = arch.shared_expert_ffn_hidden_size
        gate, up, down, shared_gate = hf_shared_expert_names(get_family(arch.family), layer)
        blocks += [[(gate, (s, h)), (up, (s, h))], [(down, (h, s))]]
        if arch.shared_expert_gate:
            blocks.append([(shared_gate, (1, h))])
    return blocks


class MoeLayer:
    """Views into the arena of one layer's router, experts and shared expert."""

    __slots__ = ("router", "router_bias", "router_logit_bias", "gate_up", "down", "gate_up_bias", "down_bias",
                 "shared_gate_up", "shared_down", "shared_gate")

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
                 router_bias: torch.Tensor | None = None, router_logit_bias: torch.Tensor | None = None,
                 expert_biases: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.router = router      # [E, H]
        self.router_bias = router_bias  # [E]: a sigmoid router's expert-score correction (None: none)
        self.router_logit_bias = router_logit_bias  # [E]: added to the router's logits (GPT-OSS; None: none)
        # [E, 2I] gate then up biases, [E, H] down biases (GPT-OSS; None: unbiased experts)
        self.gate_up_bias, self.down_bias = expert_biases if expert_biases is not None else (None, None)
        self.gate_up = gate_up    # [E, 2I, H]: per expert gate rows then up rows
        self.down = down          # [E, H, I]
        # the shared expert: [2S, H] gate rows then up rows, [H, S], its gate [1, H] (None: ungated / none)
        self.shared_gate_up, self.shared_down, self.shared_gate = shared if shared is not None else (None, None, None)


def layer_views(arch: ModelArch, layer: int, arena: torch.Tensor,
                offsets: dict[str, int]) -> tuple[MoeLayer, dict[str, torch.Tensor], dict[str, tuple[str, ...]]]:
    """(the layer's MoE views, fused-name aliases -> views, alias -> the canonical names it covers)."""
    n = expert_names(arch, layer)
    e, h, i = arch.num_experts, arch.hidden_size, arch.moe_ffn_hidden_size

    def view(first: str, shape: tuple[int, ...]) -> torch.Tensor:
        start = offsets[first]
        count = 1
        for s in shape:
            count *= s
        return arena[start:start + count].view(shape)

    shared = None
    if arch.shared_expert_ffn_hidden_size:
        sh = arch.shared_expert_ffn_hidden_size
        gate, _, down, shared_gate = hf_shared_expert_names(get_family(arch.family), layer)
        shared = (view(gate, (2 * sh, h)), view(down, (h, sh)),
                  view(shared_gate, (1, h)) if arch.shared_expert_gate else None)
    family = get_family(arch.family)
    bias = view(hf_router_bias_name(family, layer), (e,)) if arch.moe_router_expert_bias else None
    logit_bias = view(hf_router_logit_bias_name(family, layer), (e,)) if arch.moe_router_bias else None
    expert_biases = None
    if arch.expert_biases:
        gate_bias, _, down_bias = hf_expert_bias_names(family, layer, 0)
        expert_biases = view(gate_bias, (e, 2 * i)), view(down_bias, (e, h))
    moe = MoeLayer(view(n.router, (e, h)), view(n.gate[0], (e, 2 * i, h)), view(n.down[0], (e, h, i)), shared,
                   router_bias=bias, router_logit_bias=logit_bias, expert_biases=expert_biases)
    if family.gpt_oss:  # (its stacked tensors are [E, H, 2I] interleaved: no view of the arena)
        return moe, {}, {}
    aliases = {n.fused_gate_up: moe.gate_up, n.fused_down: moe.down}
    covers = {n.fused_gate_up: tuple(x for pair in zip(n.gate, n.up) for x in pair), n.fused_down: n.down}
    if n.fused_router != n.router:
        aliases[n.fused_router] = moe.router
        covers[n.fused_router] = (n.router,)
    return moe, aliases, covers


def unknown_name_hint(arch: ModelArch, name: str) -> str | None:
    """Why an MoE-looking tensor name has no place in this model (None: not an MoE name)."""
    if not any(part in name for part in (".block_sparse_moe.", ".mlp.experts.", ".mlp.gate.weight")):
        return None
    if not arch.is_moe:
        return f" (an MoE tensor, but the model config (family {arch.family}) is dense: num_experts=0)"
    return (f" (this {arch.family} model has num_experts={arch.num_experts}, named like "
            f"{expert_names(arch, arch.moe_layer_indices[0]).gate[0]!r})")


def moe_mlp(h: torch.Tensor, moe: MoeLayer, arch: ModelArch, record: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE MLP of normed hidden states h [N, H]; writes the chosen expert ids into `record` [N, k]
    (int16) when given."""
    k, ffn = arch.moe_top_k, arch.moe_ffn_hidden_size
    weights, experts = route(F.linear(h, moe.router, moe.router_logit_bias), moe, arch)
    if record is not None:
        record.copy_(experts)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)                            # (token, slot) pairs by expert
    tokens = order // k
    counts = torch.bincount(flat, minlength=arch.num_experts).tolist()
    rows = h.index_select(0, tokens)                                    # [N * k, H], grouped by expert
    out_rows = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        biased = moe.gate_up_bias is not None
        gate_up = F.linear(rows[start:start + count], moe.gate_up[e], moe.gate_up_bias[e] if biased else None)
        out_rows[start:start + count] = F.linear(gated_activation(gate_up[:, :ffn], gate_up[:, ffn:], arch), moe.down[e],
                                                 moe.down_bias[e] if biased else None)
        start += count
    out_rows.mul_(weights.reshape(-1).index_select(0, order).to(h.dtype)[:, None])
    out = torch.zeros_like(h).index_add_(0, tokens, out_rows)
    if moe.shared_gate_up is not None:  # Qwen2-MoE: routed experts + sigmoid(h w_g) * shared expert(h)
        sh = arch.shared_expert_ffn_hidden_size
        gate_up = F.linear(h, moe.shared_gate_up)
        shared = F.linear(F.silu(gate_up[:, :sh]) * gate_up[:, sh:], moe.shared_down)
        if moe.shared_gate is not None:
            shared = torch.sigmoid(F.linear(h, moe.shared_gate)) * shared
        out = out + shared
    return out


def gated_activation(gate: torch.Tensor, up: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """The gated MLP's activation, as transformers computes it: silu(gate) * up, GeGLU's gelu_tanh(gate) * up, or
    GPT-OSS's clamped form (gate at most `swiglu_limit`, up within +-limit)
    gate * sigmoid(alpha * gate) * (up + `glu_linear_offset`)."""
    if arch.mlp_activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    limit = arch.swiglu_limit
    if limit is None and arch.swiglu_alpha == 1.0 and not arch.glu_linear_offset:
        return F.silu(gate) * up
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + arch.glu_linear_offset) * (gate * torch.sigmoid(gate * arch.swiglu_alpha))


def route(logits: torch.Tensor, moe: MoeLayer, arch: ModelArch) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights [N, k], expert ids [N, k]) of router logits [N, E], as transformers' router of the family.

    softmax: top-k of the softmax over all experts, renormalised with `moe_norm_topk_prob`. sigmoid (GLM-4.5,
    DeepSeek-V3's Glm4MoeTopkRouter / DeepseekV3TopkRouter): scores sigmoid(logits); the choice ranks scores +
    expert bias, within the `moe_router_group_topk` groups whose best two biased scores sum highest; the weights
    are the unbiased scores of the chosen, renormalised (+1e-20) and times `moe_routed_scaling_factor`."""
    if arch.moe_router_score == "softmax":
        weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), arch.moe_top_k, dim=-1)  # descending
        if arch.moe_norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts
    scores = torch.sigmoid(logits.float())
    choice = scores if moe.router_bias is None else scores + moe.router_bias.float()
    groups, kept = arch.moe_router_groups, arch.moe_router_group_topk
    if kept < groups:
        n = choice.shape[0]
        group_scores = choice.view(n, groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.zeros(n, groups, dtype=torch.bool, device=choice.device)
        keep.scatter_(1, torch.topk(group_scores, kept, dim=-1, sorted=False).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(arch.num_experts // groups, dim=1), float("-inf"))
    experts = torch.topk(choice, arch.moe_top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if arch.moe_norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * arch.moe_routed_scaling_factor, experts


# ------------------------------------------------------------------------------------- routing record
def _buffer(seq, arch: ModelArch, max_seq_len: int) -> np.ndarray:
    """The sequence's record buffer [rows, layers, k] (allocated on first use, sized for its longest life)."""
    if seq.routing is None:
        rows = max(len(seq.prompt), min(len(seq.prompt) + seq.params.max_new_tokens, max_seq_len) - 1)
        seq.routing = np.empty((rows, arch.num_layers, arch.moe_top_k), dtype=np.int16)
    return seq.routing


def store_routing(routing: torch.Tensor, arch: ModelArch, max_seq_len: int, decode: list, chunks: list,
                  copies: list) -> None:
    """Copy one step's record [N, layers, k] (decode rows first, then the prompt chunks, as packed) into the
    sequences' buffers; prefix-shared prompt rows come from the donor's buffer."""
    rec = routing.numpy()
    for seq, donor, length in copies:
        _buffer(seq, arch, max_seq_len)[:length] = donor.routing[:length]
    for row, seq in enumerate(decode):
        _buffer(seq, arch, max_seq_len)[len(seq.prompt) + len(seq.output) - 1] = rec[row]
    offset = len(decode)
    for seq, start, length in chunks:
        _buffer(seq, arch, max_seq_len)[start:start + length] = rec[offset:offset + length]
        offset += length


def routing_record(seq) -> torch.Tensor | None:
    """int16 [P + R - 1, layers, k] of a sequence whose prompt was computed and which sampled a token
    (None otherwise: recording off, or aborted before its first token)."""
    if seq.routing is None or not seq.output or seq.prefilled < len(seq.prompt):
        return None
    return torch.from_numpy(seq.routing[:len(seq.prompt) + len(seq.output) - 1].copy())
