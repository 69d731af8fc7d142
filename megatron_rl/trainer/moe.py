"""Mixture-of-experts routing in the trainer: routing replay and router statistics (docs/moe.md).

Megatron's `TopKRouter` asks its `RouterReplay` (megatron/core/transformer/moe/router_replay.py, created when
`moe_enable_routing_replay` is set) for the top-k experts of every token. `PartialRouterReplay` extends it so
that a record may cover only some tokens: recorded tokens take the recorded experts (their weights are the
router's own probabilities of those experts, as Megatron's replay computes them), the others (padding, a
response's last token, which no engine forward saw) take the router's own top-k. It also counts how many
recorded tokens the router itself would have sent elsewhere, with replay on or off.

`MoERouting` owns one model's routers: it feeds each micro-batch's record to them (global layer l of
`TrainBatch.routed_experts` to the router of layer l; dense layers have no router and their rows are unused; tokens in Megatron's [sequence, batch] order, this
rank's sequence-parallel chunk) and gathers router entropy, per-expert load and the load-balancing loss.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

if not hasattr(moe_utils, "te_general_gemm"):
    # megatron-core 0.16's router GEMM tests `te_general_gemm is not None`, a name it binds only when
    # Transformer Engine imports: without TE every MoE forward raised NameError. None selects its torch path.
    moe_utils.te_general_gemm = None

NO_RECORD = -1
"""`TrainBatch.routed_experts` value of a position without a record."""


class PartialRouterReplay(RouterReplay):
    """Megatron's RouterReplay for records that may leave tokens out (rows of NO_RECORD)."""

    def __init__(self) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)  # owned by MoERouting, not the global list
        self.mismatched = 0
        self.recorded = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx
        if target is None:
            return own_probs, own
        target = target.to(scores.device)
        have = (target >= 0).all(dim=-1)
        with torch.no_grad():
            differs = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
            self.mismatched += int((differs & have).sum())
            self.recorded += int(have.sum())
        if self.router_replay_action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return own_probs, own  # measuring only
        indices = torch.where(have.unsqueeze(-1), target, own)
        return scores.gather(1, indices), indices


class MoERouting:
    """Routing replay and statistics for the MoE layers of one model stage."""

    def __init__(self, model: torch.nn.Module, *, num_experts: int, top_k: int,
                 replay: bool, sequence_parallel_size: int = 1) -> None:
        """`sequence_parallel_size`: TP ranks that each route a chunk of the sequence (their load-balancing
        losses are partial sums of the layer's loss)."""
        self.routers: list[TopKRouter] = [m for m in model.modules() if isinstance(m, TopKRouter)]
        self.num_experts, self.top_k = num_experts, top_k
        self.replay = replay
        self.sp_size = sequence_parallel_size
        for router in self.routers:
            if router.router_replay is not None and router.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = PartialRouterReplay()
            router.register_forward_hook(self._observe)
        self._valid: torch.Tensor | None = None
        # Megatron's process-wide tracker sizes its per-layer buffer on first use: drop one another model sized
        get_moe_layer_wise_logging_tracker().pop("load_balancing_loss", None)
        self.reset_stats()

    # --- statistics -------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.tokens = 0.0
        self.entropy_sum = 0.0
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        if tracker is not None:
            tracker["values"].zero_()
        for router in self.routers:
            router.router_replay.mismatched = router.router_replay.recorded = 0

    def _observe(self, router, inputs, output) -> None:
        with torch.no_grad():
            _, routing_map = output
            hidden = inputs[0]
            logits = F.linear(hidden.reshape(-1, hidden.shape[-1]).float(), router.weight.float())
            valid = self._valid if self._valid is not None and self._valid.numel() == logits.shape[0] else None
            valid = None if valid is None else valid.to(logits.device)
            if valid is not None:
                logits, routing_map = logits[valid], routing_map[valid]
            log_probs = torch.log_softmax(logits, dim=-1)
            self.entropy_sum += float(-(log_probs.exp() * log_probs).sum())
            self.tokens += logits.shape[0]
            self.load += routing_map.sum(dim=0).double().cpu()

    def metrics(self, micro_batches: int = 1, group=None) -> dict[str, float]:
        """moe/* metrics since the last reset over `micro_batches` forwards, summed over `group` (all ranks of
        the trainer): router entropy (nats, per token and layer), expert load as a multiple of the uniform
        share, the load-balancing loss without its coefficient (per layer and micro-batch; 0 when its
        coefficient is 0), and the share of recorded tokens the router itself would route differently."""
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        aux = float(tracker["values"].sum()) if tracker is not None else 0.0
        mismatched = sum(r.router_replay.mismatched for r in self.routers)
        recorded = sum(r.router_replay.recorded for r in self.routers)
        biases = [r.expert_bias for r in self.routers if getattr(r, "expert_bias", None) is not None]
        bias_abs = sum(float(b.abs().sum()) for b in biases)
        bias_count = float(sum(b.numel() for b in biases))
        totals = torch.cat([torch.tensor([self.tokens, self.entropy_sum, float(mismatched), float(recorded), aux,
                                          float(len(self.routers)), bias_abs, bias_count], dtype=torch.float64),
                            self.load])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(totals, group=group)
        tokens, entropy, mismatched, recorded, aux, layers, bias_abs, bias_count = totals[:8].tolist()
        load = totals[8:]
        share = load / load.sum().clamp(min=1) * self.num_experts  # 1.0 = a uniform share
        metrics = {"moe/router_entropy": entropy / max(tokens, 1.0),
                   "moe/expert_load_max": float(share.max()), "moe/expert_load_min": float(share.min()),
                   "moe/aux_loss": aux * self.sp_size / max(layers, 1.0) / max(micro_batches, 1)}
        if self.num_experts <= 16:
            metrics.update({f"moe/expert_load_{e}": float(s) for e, s in enumerate(share)})
        if recorded:
            metrics["moe/routing_mismatch"] = mismatched / recorded
        if bias_count:  # aux-loss-free balancing: how far the sigmoid routers' expert biases have moved
            metrics["moe/expert_bias_mean_abs"] = bias_abs / bias_count
        self.reset_stats()
        return metrics

    # --- replay -------------------------------------------------------------------------------------
    def set_micro_batch(self, routed: torch.Tensor | None, valid: torch.Tensor | None, seq_len: int,
                        sp_rank: int = 0, sp_size: int = 1) -> None:
        """Prepare the routers for one micro-batch forward of inputs [b, seq_len] (seq_len already padded to
        a multiple of sp_size). `routed`: [b, >= 0, num_layers_total, k] engine record (NO_RECORD where
        none) or None; `valid`: [b, seq_len] bool positions that count in the statistics."""
        chunk = seq_len // sp_size
        rows = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
        self._valid = None if valid is None else self._tokens_first(valid[:, :seq_len], rows).reshape(-1)
        for router in self.routers:
            replay = router.router_replay
            replay.clear_indices()
            replay.clear_router_replay_action()
        if routed is None:
            return
        routed = self.fit_record(routed, seq_len)
        for router in self.routers:  # Megatron numbers layers globally from 1
            target = self._tokens_first(routed[:, :, router.layer_number - 1], rows).reshape(-1, self.top_k)
            router.router_replay.set_target_indices(target)
            if self.replay:
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def fit_record(self, routed: torch.Tensor, seq_len: int) -> torch.Tensor:
        """The record cropped or padded (NO_RECORD) to seq_len positions."""
        if routed.shape[-1] != self.top_k:
            raise ValueError(f"routed_experts has top-k {routed.shape[-1]}, the model routes to {self.top_k}")
        routed = routed[:, :seq_len].long()
        if routed.shape[1] < seq_len:
            pad = routed.new_full((routed.shape[0], seq_len - routed.shape[1], *routed.shape[2:]), NO_RECORD)
            routed = torch.cat([routed, pad], dim=1)
        return routed

    @staticmethod
    def _tokens_first(per_row: torch.Tensor, rows: slice) -> torch.Tensor:
        """[b, s, ...] -> this rank's [s_chunk, b, ...]: Megatron's token order (sequence-major)."""
        return per_row.transpose(0, 1)[rows].contiguous()

    def finish_micro_batch(self) -> None:
        """Forget the micro-batch's record: backward needs no routing (no activation recompute with replay)."""
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


class ExpertDownProjection(RowParallelLinear):
    """An expert's down projection (`linear_fc2`) whose bias (GPT-OSS) joins the output on expert-TP rank 0 only.
    Megatron sums the experts' TP partial outputs after the MLP has added bias x routing weight on every rank,
    which would count the bias TP times; here the other ranks add zero. The bias is marked sequence-parallel
    (Megatron does so under TP), so finalize_model_grads sums its gradient over TP: rank 0's, everywhere."""


    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is None:
            return output, bias
        if self.tp_group.size() > 1 and self.tp_group.rank() != 0:
            bias = bias * 0  # (still in the graph: a zero gradient, summed over TP with rank 0's)
        # Megatron's MLP adds bias x weight in place, forbidden on the view a single-rank reduction returns
        return output.clone(), bias


class SequenceParallelTorchNorm:
    """torch's RMSNorm for Megatron's local layer spec under sequence parallelism (which Megatron's own
    WrappedTorchNorm refuses): each TP rank normalises its own chunk of the sequence, so the weight's
    gradient is a partial sum that finalize_model_grads all-reduces over TP (the `sequence_parallel` tag)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def sequence_parallel_block_spec(layers: list[ModuleSpec]) -> TransformerBlockSubmodules:
    """The block spec of a stage's local-spec layers with every torch norm made sequence-parallel capable (the
    layer norms, q/k norms and the final norm)."""
    return TransformerBlockSubmodules(layer_specs=[_sequence_parallel_norms(spec) for spec in layers],
                                      layer_norm=SequenceParallelTorchNorm)


def _sequence_parallel_norms(layer: ModuleSpec) -> ModuleSpec:
    layer = copy.deepcopy(layer)
    layer.submodules.input_layernorm = SequenceParallelTorchNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention = layer.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # (kv_layernorm: multi-latent attention's latent)
        if getattr(attention, name, None) not in (None, IdentityOp):
            setattr(attention, name, SequenceParallelTorchNorm)
    return layer
