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
from megatron_rl.sim.config import CostAssumptions, HardwareSpec

GiB = float(2**30)


# --- shapes ----------------------------------------------------------------------------------------
def padded_vocab(arch: ModelArch, tp: int, divisible_by: int = 128) -> int:
    multiple = divisible_by * tp
    return -(-arch.vocab_size // multiple) * multiple


def layer_parameters(arch: ModelArch, tp: int = 1) -> float:
    """Parameters of one transformer layer on one TP rank (the RMSNorm weights, q/k norms included, are
    replicated; q/k/v biases are split like their rows)."""
    h, f = arch.hidden_size, arch.ffn_hidden_size
    sharded = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * f
    if arch.attention_bias:
        sharded += arch.q_size + 2 * arch.kv_size
    replicated = 2 * h + (2 * arch.head_dim if arch.qk_norm else 0)
    return sharded / tp + replicated


def stage_parameters(arch: ModelArch, tp: int, pp: int, stage: int, vocab_divisible_by: int = 128) -> float:
    """Parameters held by one GPU of pipeline stage `stage` (layers + embedding / output / final norm)."""
    params = layer_parameters(arch, tp) * arch.num_layers / pp
    embed = padded_vocab(arch, tp, vocab_divisible_by) * arch.hidden_size / tp
    last = stage == pp - 1
    if stage == 0:
        params += embed
    if last:
        params += arch.hidden_size
        if not arch.tie_word_embeddings or pp > 1:
            params += embed
    return params


def kv_bytes_per_token(arch: ModelArch, dtype_bytes: int) -> float:
    """K and V of every layer for one token (all KV heads)."""
    return 2 * arch.num_layers * arch.kv_size * dtype_bytes


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


def layer_activation_elements(arch: ModelArch, seq_len: int, tp: int,
                              attention: Literal["flash", "unfused"]) -> float:
    """Elements one token keeps alive per transformer layer for the backward pass (no recompute).

    Counted tensor by tensor for Megatron's Llama layer (checked on CPU against the saved tensors
    of a real step): each RMSNorm keeps its input's rsqrt statistic and two products (x * rstd, then
    x the weight) [2h + 1], the two residual sums [2h]; attention keeps q after RoPE, k and v expanded
    to every query head, and the context [4q] plus the softmax probabilities [heads * s] when unfused,
    or q, k, v, output and the log-sum-exp [2q + 2kv + heads] with flash attention; the SwiGLU MLP keeps
    fc1's output [2f], silu(gate), the product and fc2's input [3f]. Norms and residuals are replicated
    over TP (no sequence parallelism); the rest is split."""
    h, f, q, kv, heads = arch.hidden_size, arch.ffn_hidden_size, arch.q_size, arch.kv_size, arch.num_attention_heads
    replicated = 6 * h + 2
    if attention == "unfused":
        attn = 4 * q + heads * seq_len
    else:
        attn = 2 * q + 2 * kv + heads
    return replicated + (attn + 5 * f) / tp


def logprob_workspace_bytes(arch: ModelArch, tokens: int, tp: int, on_gpu: bool) -> float:
    """The fused log-prob kernel's logits tile (kernels/logprob.py chunk sizes) and its exp."""
    local_vocab = padded_vocab(arch, tp) / tp
    if on_gpu:
        return 2 * min(GPU_CHUNK_BYTES, tokens * local_vocab * 4)
    return 2 * min(tokens, DEFAULT_CHUNK_SIZE) * min(local_vocab, DEFAULT_VOCAB_CHUNK_SIZE) * 4


def trainer_memory(arch: ModelArch, layout: TrainerLayout, assumptions: CostAssumptions, *,
                   on_gpu: bool = True) -> dict[str, float]:
    """Bytes per GPU on the fullest pipeline stage, by term."""
    worst: dict[str, float] = {}
    for stage in sorted({0, layout.pp - 1}):
        params = stage_parameters(arch, layout.tp, layout.pp, stage, layout.vocab_divisible_by)
        optimizer_bytes = 12 if layout.params_bytes == 2 else 8  # fp32 master (bf16 only) + Adam m, v
        terms = {
            "weights": params * layout.params_bytes,
            "gradients": params * 4,
            "optimizer": params * optimizer_bytes / (layout.dp if layout.distributed_optimizer else 1),
        }
        terms.update(_activations(arch, layout, assumptions, stage, on_gpu))
        if sum(terms.values()) > sum(worst.values()):
            worst = terms
    return worst


def _activations(arch: ModelArch, layout: TrainerLayout, assumptions: CostAssumptions, stage: int,
                 on_gpu: bool) -> dict[str, float]:
    tokens = layout.micro_batch_size * layout.seq_len
    act_bytes = layout.params_bytes
    layers = arch.num_layers / layout.pp
    in_flight = min(layout.pp - stage, layout.micro_batches)  # 1F1B: stage s holds PP - s micro-batches
    per_layer = layer_activation_elements(arch, layout.seq_len, layout.tp, assumptions.attention) * tokens * act_bytes
    if layout.recompute:  # full, uniform: each layer keeps its input; one layer is rebuilt at a time
        stored = layers * in_flight * tokens * arch.hidden_size * act_bytes + per_layer
    else:
        stored = layers * in_flight * per_layer
    terms = {"activations": stored}
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
    """Bytes per GPU of an inference engine holding `sequences` of up to `context` tokens."""
    weight_bytes = 1 if precision == "fp8" else 2
    params = arch.num_parameters()
    scales = params / 128 ** 2 * 4 if precision == "fp8" else 0.0  # one fp32 scale per 128x128 block
    return {"weights": (params * weight_bytes + scales) / engine_tp,
            "kv_cache": sequences * context * kv_bytes_per_token(arch, assumptions.kv_cache_dtype_bytes) / engine_tp}


def kv_capacity(arch: ModelArch, engine_tp: int, precision: str, context: int, hw: HardwareSpec,
                assumptions: CostAssumptions, other_bytes: float = 0.0) -> int:
    """Sequences of `context` tokens whose KV cache fits next to the weights (and `other_bytes`)."""
    free = hw.hbm_bytes * assumptions.memory_fraction - engine_memory(arch, engine_tp, precision, 0, context,
                                                                      assumptions)["weights"] - other_bytes
    per_sequence = context * kv_bytes_per_token(arch, assumptions.kv_cache_dtype_bytes) / engine_tp
    return max(0, int(free // per_sequence))


# --- time ----------------------------------------------------------------------------------------
def allreduce_seconds(nbytes: float, group: int, hw: HardwareSpec, *, within_node: bool) -> float:
    """Ring all-reduce: latency + 2 (g - 1) / g x bytes over the link bandwidth."""
    if group <= 1:
        return 0.0
    latency = (hw.nvlink_latency_us if within_node else hw.ib_latency_us) * 1e-6
    bandwidth = (hw.nvlink_gbps if within_node else hw.ib_gbps) * 1e9
    return latency + 2 * (group - 1) / group * nbytes / bandwidth


def decode_step_seconds(arch: ModelArch, *, tp: int, pp: int = 1, precision: str, batch: int, context: float,
                        hw: HardwareSpec, assumptions: CostAssumptions, cuda_graphs: bool) -> float:
    """Time of one decode step (one new token for each of `batch` sequences) of one engine."""
    weight_bytes = arch.num_parameters() * (1 if precision == "fp8" else 2) / (tp * pp)
    kv_bytes = batch * context * kv_bytes_per_token(arch, assumptions.kv_cache_dtype_bytes) / (tp * pp)
    memory_s = (weight_bytes + kv_bytes) / (hw.hbm_tbps * 1e12 * assumptions.hbm_efficiency)
    peak = (hw.fp8_tflops if precision == "fp8" else hw.bf16_tflops) * 1e12
    compute_s = 2 * arch.num_parameters() * batch / (tp * pp) / (peak * assumptions.decode_flop_efficiency)
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
    return 2 * arch.num_parameters() * tokens / (gpus * peak * assumptions.decode_flop_efficiency)


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
                  fp8: bool, hw: HardwareSpec, assumptions: CostAssumptions) -> float:
    """One optimizer step over `tokens` tokens on `gpus` GPUs."""
    flops = (8 if recompute else 6) * arch.num_parameters() * tokens
    rate = gpus * hw.bf16_tflops * 1e12 * assumptions.train_mfu * (assumptions.fp8_train_speedup if fp8 else 1.0)
    seconds = flops / rate
    if assumptions.pipeline_bubble and pp > 1:
        seconds *= (micro_batches + pp - 1) / micro_batches
    return seconds


def sync_seconds(arch: ModelArch, *, engines: int, engine_tp: int, precision: str, trainer_gpus: int,
                 hw: HardwareSpec, assumptions: CostAssumptions) -> float:
    """Disaggregated weight sync (LlamaRL's DDMA): every engine GPU receives its shard of the weights
    over InfiniBand while trainer GPUs send in parallel; the slower side bounds the time."""
    payload = arch.num_parameters() * (1 if precision == "fp8" else 2)
    link = hw.ib_gbps * 1e9 * assumptions.sync_efficiency
    receive = payload / engine_tp / link
    send = payload * engines / max(trainer_gpus, 1) / link
    return max(receive, send)
