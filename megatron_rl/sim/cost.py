"""The cost model: memory per GPU and time of generation, training and weight sync.

Every term is derived from the model's shapes, the layout and the hardware numbers, under the
assumptions in `CostAssumptions` (no term is fitted to a measurement):

- Memory of a trainer rank (worst pipeline stage): weights (params x dtype bytes), gradients (Megatron's
  DDP buffer, fp32: grad_reduce_in_fp32), optimizer states (Adam m and v, plus an fp32 master copy for
  bf16 weights; divided by DP under the distributed optimizer), activations of the micro-batches 1F1B
  keeps in flight (counted tensor by tensor for our Megatron layer, see `layer_activation_elements`),
  and the fused log-prob kernel's logits tile.
- Decode: one step of an engine streams its weight shard and the KV cache it attends over from HBM;
  its time is max(bytes / (HBM bandwidth x efficiency), flops / (peak x efficiency)) plus per-layer fixed
  costs (kernel launches or a CUDA-graph replay, and two TP all-reduces). A pipeline-parallel engine
  runs its stages one after another for each token. Generation takes as many steps as its longest
  response (the decode latency floor) times the waves its batch limit forces.
- Training: (6 + 2 if recomputing) x params x tokens flops at `train_mfu` of the peak, plus the 1F1B bubble.
- Weight sync: bytes each receiving GPU must take in, over the link that feeds it.

Mixture-of-experts models (docs/moe.md, "Planning MoE layouts") split every count into dense parameters
(attention, embeddings, norms, the router) and expert parameters. Expert weights are spread over the
expert-parallel group (EP, times the expert tensor-parallel size ETP) and their optimizer states over the
expert data-parallel group, Megatron's layout; routed tokens add their own activations, scaled by the
imbalance of the busiest expert rank; flops count the active parameters (top-k experts per token); every
MoE layer pays a dispatch and a combine all-to-all over the EP group (NVLink inside a node, InfiniBand
across). Engines hold every expert and per decode step read the experts the batch's tokens touch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

from megatron_rl.kernels.logprob import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_VOCAB_CHUNK_SIZE,
    GPU_CHUNK_BYTES,
)
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import pipeline_stage_layers, stage_layer_range
from megatron_rl.sim.config import CostAssumptions, HardwareSpec

GiB = float(2**30)


# --- shapes ----------------------------------------------------------------------------------------
def padded_vocab(arch: ModelArch, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return -(-arch.vocab_size // multiple) * multiple


StageSplit = tuple[int | None, int | None]
"""(first_stage_layers, last_stage_layers) of Megatron's uneven pipeline split; (None, None): an even one."""


def stage_layers(arch: ModelArch, pp: int, stage: int, split: StageSplit = (None, None)) -> range:
    """The global layers pipeline stage `stage` holds."""
    return stage_layer_range(pipeline_stage_layers(arch.num_layers, pp, *split), stage)


def dense_layer_parameters(arch: ModelArch, tp: int = 1, layer: int | None = None) -> float:
    """Non-expert parameters of one transformer layer on one TP rank: attention, norms and the dense MLP,
    or for an MoE layer the router [experts, hidden] and any shared expert instead of the MLP. The RMSNorm weights (q/k norms
    included) and the router are replicated over TP; q/k/v biases are split like their rows. `layer` None: an
    MoE layer of an MoE model."""
    h = arch.hidden_size
    if arch.is_mla:  # the latent norms replicated, every projection split (Megatron's MLA)
        norms = arch.q_lora_rank + arch.kv_lora_rank
        sharded, replicated = arch.attention_parameters() - norms, 2 * h + norms
    else:
        sharded = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h
        if arch.attention_bias:
            sharded += arch.q_size + 2 * arch.kv_size
        replicated = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    if _moe_layer(arch, layer):  # the router; a shared expert is split over TP like a dense MLP, its gate replicated
        replicated += arch.num_experts * h + (h if arch.shared_expert_gate else 0)
        sharded += 3 * h * arch.shared_expert_ffn_hidden_size
    else:
        sharded += 3 * h * arch.ffn_hidden_size
    return sharded / tp + replicated


def _moe_layer(arch: ModelArch, layer: int | None) -> bool:
    return arch.layer_is_moe(layer) if layer is not None else arch.is_moe


def expert_layer_parameters(arch: ModelArch, ep: int = 1, etp: int = 1, layer: int | None = None) -> float:
    """Expert parameters of one MoE layer on one GPU: E / EP local SwiGLU experts, each split over ETP (0 for
    a dense layer)."""
    if not _moe_layer(arch, layer):
        return 0.0
    return arch.num_experts / ep * 3 * arch.hidden_size * arch.moe_ffn_hidden_size / etp


def layer_parameters(arch: ModelArch, tp: int = 1, ep: int = 1, etp: int | None = None) -> float:
    """Parameters of one transformer layer on one GPU (dense part over TP, experts over EP x ETP)."""
    return dense_layer_parameters(arch, tp) + expert_layer_parameters(arch, ep, tp if etp is None else etp)


def expert_parameters(arch: ModelArch) -> float:
    """Every expert's parameters in the model (0 for a dense model)."""
    return len(arch.moe_layer_indices) * expert_layer_parameters(arch)


def active_parameters(arch: ModelArch) -> float:
    """Parameters one token's forward pass multiplies by: all dense ones and its top-k experts per layer."""
    if not arch.is_moe:
        return float(arch.num_parameters())
    return arch.num_parameters() - expert_parameters(arch) * (1 - arch.moe_top_k / arch.num_experts)


def experts_touched(arch: ModelArch, tokens: float) -> float:
    """Expected distinct experts of one layer that `tokens` tokens route to, each choosing top-k of E
    uniformly: E (1 - (1 - k/E)^tokens); k for one token, nearly E once a batch is large."""
    if not arch.is_moe:
        return 0.0
    return arch.num_experts * (1 - (1 - arch.moe_top_k / arch.num_experts) ** max(tokens, 1.0))


def stage_parameter_split(arch: ModelArch, tp: int, pp: int, stage: int, vocab_divisible_by: int = 128, *,
                          ep: int = 1, etp: int | None = None, split: StageSplit = (None, None)
                          ) -> tuple[float, float]:
    """(dense, expert) parameters held by one GPU of pipeline stage `stage` (layers, plus the embedding /
    output / final norm on the first and last stage)."""
    layers = stage_layers(arch, pp, stage, split)
    dense = sum(dense_layer_parameters(arch, tp, i) for i in layers)
    experts = sum(expert_layer_parameters(arch, ep, tp if etp is None else etp, i) for i in layers)
    embed = padded_vocab(arch, tp, vocab_divisible_by) * arch.hidden_size / tp
    if stage == 0:
        dense += embed
    if stage == pp - 1:
        dense += arch.hidden_size
        if not arch.tie_word_embeddings or pp > 1:
            dense += embed
    return dense, experts


def lora_layer_parameters(arch: ModelArch, rank: int, targets: tuple[str, ...], tp: int = 1, ep: int = 1,
                          etp: int = 1, layer: int | None = None) -> tuple[float, float]:
    """(dense, expert) adapter parameters of one layer on one GPU (trainer/lora.py): a column-parallel linear's
    A [r, in] is replicated and B [out / TP, r] split; a row-parallel one's A [r, in / TP] split and B [out, r]
    replicated. In an MoE layer linear_fc1 / linear_fc2 are every local expert's, and a shared expert's (dense)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    qkv = arch.q_size + 2 * arch.kv_size
    attention = {"linear_qkv": rank * (h + qkv / tp), "linear_proj": rank * (arch.q_size / tp + h)}
    dense = sum(v for t, v in attention.items() if t in targets)
    if _moe_layer(arch, layer):
        i, shared = arch.moe_ffn_hidden_size, arch.shared_expert_ffn_hidden_size
        per_expert = (rank * (h + 2 * i / etp) if "linear_fc1" in targets else 0) + \
            (rank * (i / etp + h) if "linear_fc2" in targets else 0)
        if shared:
            dense += (rank * (h + 2 * shared / tp) if "linear_fc1" in targets else 0) + \
                (rank * (shared / tp + h) if "linear_fc2" in targets else 0)
        return dense, arch.num_experts / ep * per_expert
    mlp = {"linear_fc1": rank * (h + 2 * f / tp), "linear_fc2": rank * (f / tp + h)}
    return dense + sum(v for t, v in mlp.items() if t in targets), 0.0


def stage_parameters(arch: ModelArch, tp: int, pp: int, stage: int, vocab_divisible_by: int = 128, *,
                     ep: int = 1, etp: int | None = None, split: StageSplit = (None, None)) -> float:
    """Parameters held by one GPU of pipeline stage `stage` (layers + embedding / output / final norm)."""
    return sum(stage_parameter_split(arch, tp, pp, stage, vocab_divisible_by, ep=ep, etp=etp, split=split))


def stage_active_parameters(arch: ModelArch, pp: int, stage: int, split: StageSplit = (None, None)) -> float:
    """Parameters one token multiplies by on pipeline stage `stage`: its layers' dense parameters and top-k
    experts, and on the last stage the output layer (the embedding is a lookup)."""
    experts = arch.moe_top_k / arch.num_experts if arch.is_moe else 0.0
    active = sum(dense_layer_parameters(arch, 1, i) + expert_layer_parameters(arch, 1, 1, i) * experts
                 for i in stage_layers(arch, pp, stage, split))
    return active + (arch.vocab_size * arch.hidden_size if stage == pp - 1 else 0.0)


def pipeline_balance(arch: ModelArch, pp: int, split: StageSplit = (None, None)) -> float:
    """The busiest pipeline stage's work over the mean stage's (>= 1): in 1F1B every stage waits for the
    slowest, so a step's compute takes this much longer than a perfectly balanced split's."""
    if pp == 1:
        return 1.0
    work = [stage_active_parameters(arch, pp, stage, split) for stage in range(pp)]
    return max(work) * pp / sum(work)


def kv_bytes_per_sequence(arch: ModelArch, context: float, dtype_bytes: int) -> float:
    """K and V of every layer (all KV heads; under multi-latent attention the latent and the rotary key,
    `ModelArch.kv_cache_width`) for a sequence of `context` tokens: a sliding-window layer keeps (and a decode step
    reads) at most its window."""
    positions = sum(min(context, arch.layer_window(layer) or context) for layer in range(arch.num_layers))
    return positions * arch.kv_cache_width * dtype_bytes


# --- memory --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """What the trainer memory model needs to know about one rank's job."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int
    """Micro-batches per step on one data-parallel rank."""
    seq_len: int
    """Tokens per row (prompt + response, padded)."""
    params_bytes: int = 2
    """2 for bf16 weights, 4 for fp32."""
    recompute: bool = False
    distributed_optimizer: bool = True
    vocab_divisible_by: int = 128
    ep: int = 1
    """Expert-parallel size (MoE): each GPU holds num_experts / EP experts."""
    etp: int = 0
    """Expert tensor-parallel size (MoE); 0 = the trainer's TP (Megatron's default)."""
    lora_rank: int = 0
    """LoRA (trainer.lora): adapters of this rank on `lora_targets`, the base frozen (0: full training)."""
    lora_targets: tuple[str, ...] = ()
    split: StageSplit = (None, None)
    """Megatron's uneven pipeline split (trainer.parallel.first_stage_layers / last_stage_layers)."""

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Megatron's expert data-parallel size: the trainer's GPUs / (ETP x EP x PP)."""
        return max(1, self.tp * self.dp // (self.expert_tp * self.ep))


def layer_activation_elements(arch: ModelArch, seq_len: int, tp: int, attention: Literal["flash", "unfused"],
                              layer: int | None = None) -> float:
    """Elements one token keeps alive per transformer layer for the backward pass (no recompute).

    Counted tensor by tensor for our Megatron layer (checked on CPU against the tensors autograd saves in a
    real step, with the fused RMSNorm / SwiGLU / RoPE of trainer/local_fusions.py and torch's SDPA, which
    save what Transformer Engine's fused modules save): the layer input and the mid-layer residual sum [2h],
    each RMSNorm's output (the next projection's input) and its rsqrt statistic [2h + 2]; with flash
    attention, the qkv projection's output (v is a view of it) [q + 2kv], q and k after RoPE [q + kv], the
    attention output [q] and the log-sum-exp [heads]; unfused (Megatron's materialised scores), q after
    RoPE, k and v expanded to every query head and the context [4q] plus the softmax probabilities
    [heads * s]; the SwiGLU MLP keeps fc1's output [2f] and fc2's input [f]. Norms and residuals are
    replicated over TP (no sequence parallelism); the rest is split.

    An MoE layer keeps, instead of the MLP, the router's logits and probabilities [2E] (the routed experts'
    own tensors are `routed_activation_elements`). Megatron trains MoE with TP > 1 only under sequence
    parallelism, which splits the norms and residuals over TP as well, in its dense layers too. `layer` None:
    an MoE layer of an MoE model."""
    h, f, q, kv, heads = arch.hidden_size, arch.ffn_hidden_size, arch.q_size, arch.kv_size, arch.num_attention_heads
    replicated = 4 * h + 2
    if attention == "unfused":
        attn = 4 * q + heads * seq_len
    else:
        attn = 3 * q + 3 * kv + heads
    if _moe_layer(arch, layer):
        return replicated / tp + attn / tp + 2 * arch.num_experts
    if arch.is_moe:  # a dense layer of an MoE model: sequence-parallel too
        return (replicated + attn + 3 * f) / tp
    return replicated + (attn + 3 * f) / tp


def routed_activation_elements(arch: ModelArch, tp: int, etp: int, imbalance: float,
                               layer: int | None = None) -> float:
    """Elements per token of one MoE layer on the busiest expert rank: each token is dispatched to k experts,
    and under EP the rank receives `imbalance` x the mean share; every routed copy keeps its permuted input
    [h] and Megatron's expert MLP (Python SwiGLU, routing weight applied inside the expert): fc1's output
    [2f], silu(gate), up, their product, the weighted product (fc2's input) [4f], f = the expert's width
    over ETP (checked on CPU against the saved tensors of a real step). Tokens arrive split over TP
    (sequence parallelism). 0 for a dense layer."""
    if not _moe_layer(arch, layer):
        return 0.0
    per_copy = arch.hidden_size + 6 * arch.moe_ffn_hidden_size / etp
    return imbalance * arch.moe_top_k * per_copy / tp


def logprob_workspace_bytes(arch: ModelArch, tokens: int, tp: int, on_gpu: bool) -> float:
    """The fused log-prob kernel's logits tile (kernels/logprob.py chunk sizes) and its exp."""
    local_vocab = padded_vocab(arch, tp) / tp
    if on_gpu:
        return 2 * min(GPU_CHUNK_BYTES, tokens * local_vocab * 4)
    return 2 * min(tokens, DEFAULT_CHUNK_SIZE) * min(local_vocab, DEFAULT_VOCAB_CHUNK_SIZE) * 4


def trainer_memory(arch: ModelArch, layout: TrainerLayout, assumptions: CostAssumptions, *,
                   on_gpu: bool = True) -> dict[str, float]:
    """Bytes per GPU on the fullest pipeline stage, by term. An MoE model adds expert_weights,
    expert_gradients, expert_optimizer (states sharded over the expert data-parallel group) and
    routed_tokens."""
    worst: dict[str, float] = {}
    for stage in range(layout.pp):
        params, experts = stage_parameter_split(arch, layout.tp, layout.pp, stage, layout.vocab_divisible_by,
                                                ep=layout.ep, etp=layout.expert_tp, split=layout.split)
        optimizer_bytes = 12 if layout.params_bytes == 2 else 8  # fp32 master (bf16 only) + Adam m, v
        trained, trained_experts = params, experts
        weights, expert_weights = params, experts
        if layout.lora_rank:  # only the adapters train; the frozen base keeps its weights alone
            adapters = [lora_layer_parameters(arch, layout.lora_rank, layout.lora_targets, layout.tp, layout.ep,
                                              layout.expert_tp, i)
                        for i in stage_layers(arch, layout.pp, stage, layout.split)]
            trained, trained_experts = (sum(a[j] for a in adapters) for j in (0, 1))
            weights, expert_weights = params + trained, experts + trained_experts
        terms = {
            "weights": weights * layout.params_bytes,
            "gradients": trained * 4,
            "optimizer": trained * optimizer_bytes / (layout.dp if layout.distributed_optimizer else 1),
        }
        if arch.is_moe:
            terms["expert_weights"] = expert_weights * layout.params_bytes
            terms["expert_gradients"] = trained_experts * 4
            terms["expert_optimizer"] = trained_experts * optimizer_bytes / (
                layout.expert_dp if layout.distributed_optimizer else 1)
        terms.update(_activations(arch, layout, assumptions, stage, on_gpu))
        if sum(terms.values()) > sum(worst.values()):
            worst = terms
    return worst


def _activations(arch: ModelArch, layout: TrainerLayout, assumptions: CostAssumptions, stage: int,
                 on_gpu: bool) -> dict[str, float]:
    tokens = layout.micro_batch_size * layout.seq_len
    act_bytes = layout.params_bytes
    layers = stage_layers(arch, layout.pp, stage, layout.split)
    in_flight = min(layout.pp - stage, layout.micro_batches)  # 1F1B: stage s holds PP - s micro-batches
    imbalance = assumptions.moe_imbalance if layout.ep > 1 else 1.0  # one EP rank computes every routed copy
    per_layer = [layer_activation_elements(arch, layout.seq_len, layout.tp, assumptions.attention, i) * tokens
                 * act_bytes for i in layers]
    routed = [routed_activation_elements(arch, layout.tp, layout.expert_tp, imbalance, i) * tokens * act_bytes
              for i in layers]
    if layout.recompute:  # full, uniform: each layer keeps its input; one layer is rebuilt at a time
        stored = len(layers) * in_flight * tokens * arch.hidden_size * act_bytes + max(per_layer)
        routed_stored = max(routed)
    else:
        stored = in_flight * sum(per_layer)
        routed_stored = in_flight * sum(routed)
    terms = {"activations": stored}
    if arch.is_moe:
        terms["routed_tokens"] = routed_stored
    extra = 0.0
    if assumptions.attention == "unfused":  # Megatron's global buffer for the [b, heads, s, s] scores
        extra += layout.micro_batch_size * arch.num_attention_heads / layout.tp * layout.seq_len ** 2 * act_bytes
    if stage == layout.pp - 1:  # final norm, hidden states into the log-prob kernel, its tile
        extra += 4 * arch.hidden_size * tokens * act_bytes
        extra += logprob_workspace_bytes(arch, tokens, layout.tp, on_gpu)
    if stage == 0:
        extra += arch.hidden_size * tokens * act_bytes  # embedding output
    terms["activation_buffers"] = extra
    return terms


def engine_memory(arch: ModelArch, engine_tp: int, precision: str, sequences: int, context: int,
                  assumptions: CostAssumptions) -> dict[str, float]:
    """Bytes per GPU of an inference engine holding `sequences` of up to `context` tokens. An MoE engine
    holds every expert (split over its GPUs, by TP or EP alike): they are the `expert_weights` term."""
    weight_bytes = 1 if precision == "fp8" else 2

    def stored(params: float) -> float:
        scales = params / 128 ** 2 * 4 if precision == "fp8" else 0.0  # one fp32 scale per 128x128 block
        return (params * weight_bytes + scales) / engine_tp

    experts = expert_parameters(arch)
    terms = {"weights": stored(arch.num_parameters() - experts)}
    if arch.is_moe:
        terms["expert_weights"] = stored(experts)
    terms["kv_cache"] = sequences * kv_bytes_per_sequence(arch, context, assumptions.kv_cache_dtype_bytes) / engine_tp
    return terms


def kv_capacity(arch: ModelArch, engine_tp: int, precision: str, context: int, hw: HardwareSpec,
                assumptions: CostAssumptions, other_bytes: float = 0.0) -> int:
    """Sequences of `context` tokens whose KV cache fits next to the weights (and `other_bytes`)."""
    weights = engine_memory(arch, engine_tp, precision, 0, context, assumptions)
    free = (hw.hbm_bytes * assumptions.memory_fraction - weights["weights"] - weights.get("expert_weights", 0.0)
            - other_bytes)
    per_sequence = kv_bytes_per_sequence(arch, context, assumptions.kv_cache_dtype_bytes) / engine_tp
    return max(0, int(free // per_sequence))


# --- time ----------------------------------------------------------------------------------------
def allreduce_seconds(nbytes: float, group: int, hw: HardwareSpec, *, within_node: bool) -> float:
    """Ring all-reduce: latency + 2 (g - 1) / g x bytes over the link bandwidth."""
    if group <= 1:
        return 0.0
    latency = (hw.nvlink_latency_us if within_node else hw.ib_latency_us) * 1e-6
    bandwidth = (hw.nvlink_gbps if within_node else hw.ib_gbps) * 1e9
    return latency + 2 * (group - 1) / group * nbytes / bandwidth


def alltoall_seconds(nbytes: float, ep: int, hw: HardwareSpec, assumptions: CostAssumptions, *,
                     etp: int = 1) -> float:
    """One all-to-all in which each GPU of an EP group sends `nbytes` spread evenly over the group (1/EP
    stays local). Megatron's rank order (tp-cp-ep-dp-pp) puts EP ranks ETP apart, so gpus_per_node / ETP
    of them share a node: their share goes over NVLink, the rest over InfiniBand, both at once; the slower
    link bounds the time, at `alltoall_efficiency` of its bandwidth."""
    if ep <= 1:
        return 0.0
    per_peer = nbytes / ep
    in_node = min(ep, max(1, hw.gpus_per_node // etp)) - 1
    across = ep - 1 - in_node
    latency = (hw.ib_latency_us if across else hw.nvlink_latency_us) * 1e-6
    nvlink = in_node * per_peer / (hw.nvlink_gbps * 1e9)
    ib = across * per_peer / (hw.ib_gbps * 1e9)
    return latency + max(nvlink, ib) / assumptions.alltoall_efficiency


def moe_alltoall_bytes(arch: ModelArch, tokens: float, assumptions: CostAssumptions, dtype_bytes: int = 2) -> float:
    """Bytes one GPU exchanges in one dispatch (or combine) of an MoE layer: each of its `tokens` goes to k
    experts as a [hidden] row; the busiest rank receives `moe_imbalance` x the mean."""
    if not arch.is_moe:
        return 0.0
    return tokens * arch.moe_top_k * arch.hidden_size * dtype_bytes * assumptions.moe_imbalance


def decode_step_seconds(arch: ModelArch, *, tp: int, pp: int = 1, precision: str, batch: int, context: float,
                        hw: HardwareSpec, assumptions: CostAssumptions, cuda_graphs: bool) -> float:
    """Time of one decode step (one new token for each of `batch` sequences) of one engine. An MoE engine
    streams its dense weights and only the experts the batch's tokens route to (`experts_touched`), and
    multiplies by the active parameters."""
    untouched = 1 - experts_touched(arch, batch) / max(arch.num_experts, 1)
    read = arch.num_parameters() - expert_parameters(arch) * untouched
    weight_bytes = read * (1 if precision == "fp8" else 2) / (tp * pp)
    kv_bytes = batch * kv_bytes_per_sequence(arch, context, assumptions.kv_cache_dtype_bytes) / (tp * pp)
    memory_s = (weight_bytes + kv_bytes) / (hw.hbm_tbps * 1e12 * assumptions.hbm_efficiency)
    peak = (hw.fp8_tflops if precision == "fp8" else hw.bf16_tflops) * 1e12
    compute_s = 2 * active_parameters(arch) * batch / (tp * pp) / (peak * assumptions.decode_flop_efficiency)
    per_stage = max(memory_s, compute_s)
    layers = arch.num_layers / pp
    launch = (assumptions.kernel_overhead_us if cuda_graphs else assumptions.kernels_per_layer * assumptions.launch_us) * 1e-6
    activation = batch * arch.hidden_size * 2
    comm = 2 * allreduce_seconds(activation, tp, hw, within_node=tp <= hw.gpus_per_node)
    per_stage += layers * (launch + comm)
    hop = (hw.ib_latency_us * 1e-6 + activation / (hw.ib_gbps * 1e9)) if pp > 1 else 0.0
    return pp * per_stage + (pp - 1) * hop  # stages run one after another for each token


def prefill_seconds(arch: ModelArch, *, gpus: int, tokens: float, precision: str, hw: HardwareSpec,
                    assumptions: CostAssumptions) -> float:
    peak = (hw.fp8_tflops if precision == "fp8" else hw.bf16_tflops) * 1e12
    return 2 * active_parameters(arch) * tokens / (gpus * peak * assumptions.decode_flop_efficiency)


@dataclasses.dataclass(frozen=True)
class GenerationEstimate:
    seconds: float
    waves: int
    batch_per_engine: int
    decode_step_s: float
    steps: float


def generation_seconds(arch: ModelArch, *, sequences: int, engines: int, tp: int, pp: int = 1, precision: str,
                       max_new_tokens: int, batch_limit: int, static_batching: bool, cuda_graphs: bool,
                       hw: HardwareSpec, assumptions: CostAssumptions) -> GenerationEstimate:
    """Time for `engines` replicas to generate `sequences` responses.

    Static batching: each wave of `batch_limit` sequences runs max_new_tokens steps (its longest
    response). Continuous batching: finished sequences are replaced at once, so an engine runs
    total_tokens / batch steps, but never fewer than max_new_tokens (the latency floor)."""
    per_engine = math.ceil(sequences / engines)
    batch = max(1, min(per_engine, batch_limit))
    mean_new = assumptions.mean_response_fraction * max_new_tokens
    context = assumptions.prompt_tokens + mean_new / 2 if not static_batching else assumptions.prompt_tokens + max_new_tokens / 2
    step = decode_step_seconds(arch, tp=tp, pp=pp, precision=precision, batch=batch, context=context, hw=hw,
                               assumptions=assumptions, cuda_graphs=cuda_graphs)
    if static_batching:
        waves = math.ceil(per_engine / batch)
        steps = waves * max_new_tokens
    else:
        waves = math.ceil(per_engine / batch)
        steps = max(max_new_tokens, per_engine * mean_new / batch)
    prefill = prefill_seconds(arch, gpus=engines * tp * pp, tokens=sequences * assumptions.prompt_tokens,
                              precision=precision, hw=hw, assumptions=assumptions)
    return GenerationEstimate(seconds=steps * step + prefill, waves=waves, batch_per_engine=batch,
                              decode_step_s=step, steps=steps)


def train_seconds(arch: ModelArch, *, tokens: float, gpus: int, pp: int, micro_batches: int, recompute: bool,
                  fp8: bool, hw: HardwareSpec, assumptions: CostAssumptions, tp: int = 1, ep: int = 1,
                  etp: int | None = None, micro_batch_tokens: float = 0.0, split: StageSplit = (None, None)) -> float:
    """One optimizer step over `tokens` tokens on `gpus` GPUs. Under PP the busiest stage paces the rest
    (`pipeline_balance`, the output layer counted on the last stage).

    MoE: flops count the active parameters, the routed experts' share scaled by `moe_imbalance` under EP
    (the busiest expert rank sets the pace), plus every MoE layer's dispatch and combine all-to-all of each
    micro-batch of `micro_batch_tokens` (split over TP by sequence parallelism), forward and backward and
    again when recomputing, not overlapped with compute."""
    experts = expert_parameters(arch) * (arch.moe_top_k / arch.num_experts if arch.is_moe else 0.0)
    imbalance = assumptions.moe_imbalance if ep > 1 else 1.0  # without EP each rank computes its own tokens' experts
    flops = (8 if recompute else 6) * (active_parameters(arch) - experts + experts * imbalance) * tokens
    rate = gpus * hw.bf16_tflops * 1e12 * assumptions.train_mfu * (assumptions.fp8_train_speedup if fp8 else 1.0)
    seconds = flops / rate * pipeline_balance(arch, pp, split) + train_alltoall_seconds(
        arch, pp=pp, micro_batches=micro_batches, recompute=recompute, hw=hw, assumptions=assumptions, tp=tp, ep=ep,
        etp=etp, micro_batch_tokens=micro_batch_tokens, split=split)
    if assumptions.pipeline_bubble and pp > 1:
        seconds *= (micro_batches + pp - 1) / micro_batches
    return seconds


def train_alltoall_seconds(arch: ModelArch, *, pp: int, micro_batches: int, recompute: bool, hw: HardwareSpec,
                           assumptions: CostAssumptions, tp: int = 1, ep: int = 1, etp: int | None = None,
                           micro_batch_tokens: float = 0.0, split: StageSplit = (None, None)) -> float:
    """A GPU of the pipeline stage with the most MoE layers: its expert-parallel all-to-all time in one step
    (before the pipeline bubble): per micro-batch and MoE layer, a dispatch and a combine in forward, backward
    and any recompute."""
    if not arch.is_moe or ep <= 1:
        return 0.0
    passes = 2 * (3 if recompute else 2)
    per_layer = alltoall_seconds(moe_alltoall_bytes(arch, micro_batch_tokens / tp, assumptions), ep, hw, assumptions,
                                 etp=tp if etp is None else etp)
    moe_layers = max(sum(arch.layer_is_moe(i) for i in stage_layers(arch, pp, stage, split)) for stage in range(pp))
    return micro_batches * moe_layers * passes * per_layer


def sync_seconds(arch: ModelArch, *, engines: int, engine_tp: int, precision: str, trainer_gpus: int,
                 hw: HardwareSpec, assumptions: CostAssumptions) -> float:
    """Disaggregated weight sync (LlamaRL's DDMA): every engine GPU receives its shard of the weights
    over InfiniBand while trainer GPUs send in parallel; the slower side bounds the time."""
    payload = arch.num_parameters() * (1 if precision == "fp8" else 2)
    link = hw.ib_gbps * 1e9 * assumptions.sync_efficiency
    receive = payload / engine_tp / link
    send = payload * engines / max(trainer_gpus, 1) / link
    return max(receive, send)
