"""Configuration of everything that generates rollouts, importable without torch: the sampling and
staleness of training rollouts (`rollout:`), the native engine (`engine:`) and the generator group on a
cluster (`cluster.generator:`, e.g. `backend: sglang` to roll out with SGLang)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import require


MAX_TEMPERATURE = 100.0


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Sampling for training: prompts per step, samples per prompt, the sampling distribution, staleness."""

    prompts_per_step: int = 8
    """Prompts (groups) per optimizer step."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt (the group size n for GRPO / RLOO baselines)."""
    max_new_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (1.0 samples the raw policy, which the importance weights assume)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k truncation (-1: off)."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Stop strings: a response ends once its text contains one (e.g. JEPO's answer marker)."""
    max_staleness: int = 0
    """Versions a consumed sample may lag the trainer: 0 is synchronous on-policy training; k >= 1
    lets generation run up to k steps ahead of training (asynchronous, off-policy)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: the engine shares the trainer's process and cores, and generation and training take
    turns. disaggregated: the engine runs in its own process on `generator_threads` cores while the
    trainer keeps `trainer_threads` (LlamaRL's layout; with max_staleness >= 1 they overlap)."""
    generator_threads: int = 1
    """Cores (torch threads) of the generator process in the disaggregated placement."""
    trainer_threads: int = 1
    """Cores (torch threads) of the trainer in the disaggregated placement."""
    lend_idle_cores: bool = True
    """Disaggregated on one CPU host (single policy, one trainer rank): whichever of the trainer and
    the generator process is idle lends its cores to the other (placement/core_share.py), so a
    trainer waiting for rollouts or a generator waiting for admission wastes no core. False keeps
    the fixed generator_threads / trainer_threads split, as `deterministic` runs always do (thread
    counts that follow timing change floating-point summation order)."""
    weight_update: Literal["in_flight", "pause"] = "in_flight"
    """in_flight: new weights apply between two decode steps and unfinished responses continue under
    them (partial rollouts; each token records its version). pause: generation is paused for the
    update, and the KV cache is freed (when no response is in flight) before it resumes."""
    verify_weight_sync: bool = False
    """Checksum every tensor on both sides after each weight sync (disaggregated; vLLM: its parameters read back
    through /weight_checker, rollout/vllm_checksums.py); fail on mismatch."""
    weight_sync: Literal["full", "delta", "adapters"] = "full"
    """full: every weight byte goes to the engine on every sync. delta: only the elements whose bits changed
    (in the engine's dtype) since the version it holds, each tensor sent as nothing, sparse positions, a
    bitmask or whole, whichever is smallest (weight_sync/delta.py); the first sync and the one after a resume
    send everything, and a delta whose checksum mismatches is sent again at once, whole. Native engines only
    (in this process, a generator process or generator ranks): SGLang and vLLM take whole tensors. For
    generator ranks the driver keeps one copy of the engine-dtype weights to compare with. It saves bytes on a
    network; on one host a full sync, a memory copy, is faster (docs/async.md). adapters (LoRA training,
    trainer.lora.rank > 0): only the adapters go, and the native engine in this process (colocated placement)
    applies them beside the base weights it was built with (docs/lora.md)."""
    offload_idle: bool = True
    """Colocated synchronous runs (max_staleness 0): while the trainer steps, the engine frees its KV
    cache (and on a GPU moves its weights to host memory); while the engine generates, the trainer's
    optimizer state waits in host memory (GPU). On CPU nothing moves, and the bytes are reported."""
    deterministic: bool = False
    """Make an asynchronous run reproducible bit for bit (slower): the groups of step s are generated
    entirely by the weights of version max(0, s - max_staleness), because every in-flight response is
    finished before the engine takes new weights, and each admission is one engine submission into an
    idle engine (the same batches, so the same floating-point results) with per-request seeds. A run
    killed and resumed from its checkpoints then ends with the weights of an uninterrupted run. The
    trainer still overlaps with generation; what is lost is generation running on into the next
    version while the weight sync waits."""
    on_overlong_prompt: Literal["error", "skip"] = "error"
    """A prompt whose rendered tokens do not fit the engine's context (engine.max_seq_len, or the
    model's): error names the prompt, its source file and row; skip counts it (rollout/skipped_prompts)
    and draws the next prompt in its place."""
    record_routing: bool = False
    """MoE policies: the engine records the experts it routed every position to (`Completion.routed_experts`)
    so the trainer can replay them; the engine reads `engine.record_routing`, which whoever builds the engine
    sets from this (or the trainer's routing replay). Ignored for dense models."""
    drop_uninformative_groups: bool = True
    """Skip the backward pass for groups whose advantages are all zero (every sample scored the same).
    Their gradient is exactly zero without a KL/entropy term, so this changes speed, not the update."""

    def __post_init__(self) -> None:
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        require(self.samples_per_prompt >= 1, "samples_per_prompt", "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        # Above 100 the distribution is uniform to float precision: a typo, not a setting.
        require(0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
                f"must be a finite number in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {self.temperature!r}")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.generator_threads >= 1, "generator_threads", "must be >= 1")
        require(self.trainer_threads >= 1, "trainer_threads", "must be >= 1")

    @property
    def is_async(self) -> bool:
        """Whether generation may run ahead of training (off-policy), as opposed to taking turns with it."""
        return self.max_staleness > 0


@dataclasses.dataclass(kw_only=True)
class NativeEngineConfig:
    """The native PyTorch rollout engine."""

    max_batch_size: int = 32
    """KV-cache slots: sequences decoded together in one step (requests beyond it wait for a slot)."""
    max_seq_len: int = 4096
    """Longest prompt + response a slot holds; capped at the model's max_position_embeddings (0: use it)."""
    max_prefill_tokens: int = 2048
    """Prompt tokens processed per step (chunked prefill); decode tokens ride along in the same step."""
    device: str = "auto"
    """'cpu', 'cuda', 'cuda:N', or 'auto' (CUDA when available)."""
    dtype: Literal["fp32", "bf16", "auto"] = "fp32"
    """Weights and activations; logits and log-probs are always fp32. auto: bf16 on CUDA, fp32 on CPU."""
    num_threads: int = 0
    """torch intra-op threads for the process (0 leaves torch's setting alone)."""
    prefix_sharing_min_tokens: int = 16
    """A new request whose prompt shares at least this many leading tokens with a running one copies
    that prefix's K/V instead of recomputing it (n samples of one prompt, a common system prompt);
    only prefixes computed with the current weights are shared. 0 disables sharing."""
    prepack_weights: bool = True
    """On CPU, also keep the weight matrices laid out for the GEMM kernel that is fastest for them
    (rollout/native/weights.py `PackedMatrix`). fp32: on CPUs with AVX-512 the fused CPU kernels' panels for
    steps of up to 256 rows (one more copy of the matrices); else (or with `cpu_kernels: disabled`) MKL's
    packed GEMM for nearly full decode batches and transposed [in, out] copies for smaller steps (two more).
    bf16: oneDNN's blocked layout for every step (one more copy; its unpacked F.linear re-lays out the
    weights on every call). Rebuilt lazily between steps after a weight update. Results equal the unpacked
    F.linear path up to float rounding (~1e-7 in fp32)."""
    cpu_kernels: Literal["auto", "required", "disabled"] = "auto"
    """On CPU, the fused C kernels of kernels/cpu_decode.c in place of runs of torch ops: the residual add with
    RMSNorm, RoPE with the KV-cache write, the gated activation, decode attention over the cache, plain
    sampling, and (with `prepack_weights`, AVX-512) the fp32 GEMMs of steps up to 256 rows (docs/performance.md).
    Built on first use with the machine's GCC (about a second, cached under ~/.cache/megatron_rl/kernels).
    auto: where they build (else torch ops, said once in the log); required: refuse to start without them;
    disabled: torch ops. Results equal the torch ops up to the order of fp32 additions in a reduction and exp
    to about an ulp (tests/test_cpu_decode_kernels.py)."""
    record_routing: bool = False
    """MoE models: record each position's expert ids into `Completion.routed_experts` (int16 [P + R - 1,
    layers, top_k]; rollout/native/moe.py). Off by default: it costs layers * top_k * 2 bytes per token."""

    def __post_init__(self) -> None:
        require(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        require(self.max_seq_len >= 0, "max_seq_len", "must be >= 0 (0 = the model's context)")
        require(self.max_prefill_tokens >= 1, "max_prefill_tokens", "must be >= 1")
        require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"), "device",
                f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        require(self.num_threads >= 0, "num_threads", "must be >= 0")
        require(self.prefix_sharing_min_tokens >= 0, "prefix_sharing_min_tokens", "must be >= 0")
        require(self.cpu_kernels in ("auto", "required", "disabled"), "cpu_kernels",
                f"must be 'auto', 'required' or 'disabled', got {self.cpu_kernels!r}")


@dataclasses.dataclass(kw_only=True)
class GeneratorGroupConfig:
    """The generator executor group on a cluster: inference engines on their own GPUs (disaggregated)
    or sharing the trainer's GPUs (colocated, where num_engines and engine_tp are derived)."""

    backend: Literal["native", "sglang", "vllm"] = "native"
    """Engine implementation: the native engine, SGLang (rollout/sglang_engine.py in this process, with
    engine_tp GPUs; or the servers listed in `urls`, which the Slurm scripts start), or vLLM
    (rollout/vllm_engine.py: num_engines `vllm serve` processes the run launches, or the servers in `urls`;
    docs/vllm.md)."""
    num_engines: int = 1
    """Independent engine replicas in the disaggregated group (each serves its share of the prompts)."""
    engine_tp: int = 8
    """Tensor-parallel size of one engine (GPUs per engine); keep it inside one node."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Weights of the inference engines: bf16 (as trained), or fp8 with one scale per block (quantized on
    every weight sync, weight_sync/fp8.py; engines without fp8 GEMMs get the dequantized values, so the
    log-prob gap shows in train/logprob_mismatch on any engine)."""
    fp8_block_size: int = 128
    """Square block edge of the FP8 weight scales (one scale per block x block tile)."""
    max_running_requests: int = 256
    """Most sequences one engine decodes at once (its continuous batch); the KV cache may cap it lower."""
    cuda_graphs: bool = True
    """Decode steps replay CUDA graphs (SGLang default), so per-layer launch cost is small."""
    weight_update_group_port: int = 29600
    """TCP port on trainer rank 0 for the NCCL weight-update group the engines join."""
    urls: list[str] = dataclasses.field(default_factory=list)
    """Base URLs of the engines' SGLang servers (set by examples/slurm_common.sh on a cluster); empty:
    the engine runs inside this process as rollout.placement says."""
    vllm_python: str = ""
    """backend vllm: the Python of vLLM's own environment (default: $MEGATRON_RL_VLLM_PYTHON, else
    .venv-vllm/bin/python, which scripts/setup_vllm_cpu.sh creates)."""
    vllm_args: list[str] = dataclasses.field(default_factory=list)
    """backend vllm: more `vllm serve` flags for the servers the run launches (e.g. ["--enforce-eager"] on CPU:
    starts in about 25 s instead of 70 to 90 s of graph compilation, about 15% slower decoding)."""
    vllm_weight_transfer: Literal["auto", "reload", "nccl", "gloo", "ipc"] = "auto"
    """backend vllm: how weights reach the servers (docs/vllm.md). reload: written as safetensors to this host's
    tmpfs and reloaded in place by the server (a server on this host); nccl / gloo / ipc: vLLM's weight-transfer
    API (nccl: every tensor broadcast from trainer rank 0 to the server's workers on GPUs of their own; gloo: the
    same over TCP, for servers without GPUs, with megatron_rl's vLLM plugin in their environment; ipc: CUDA-IPC
    handles of rank 0's tensors, for a one-worker server beside the trainer on its GPU). auto: nccl with a GPU
    (reload for servers on the trainer's own GPUs, rollout.placement colocated: NCCL refuses two ranks on one
    GPU), else reload. Servers in `urls` must have been started with the matching `--weight-transfer-config`."""
    vllm_kv_cache_gib: float = 2.0
    """backend vllm on CPU: the KV cache of each launched server (VLLM_CPU_KVCACHE_SPACE)."""
    ready_timeout_s: float = 600.0
    """How long a launched engine server may take to answer /health before the run stops with its log's tail."""
    dead_engine_timeout_s: float = 900.0
    """A pool of several engines: how long requests wait for an engine to come back when every engine has failed,
    before the run stops with one line naming them (rollout/pool.py)."""
    hung_engine_timeout_s: float = 1800.0
    """A pool of engines: an engine with requests in flight that finishes none of them for this long is taken out
    as hung (restarted where the run launched it) and its groups go to the live engines; 0: never. Longer than
    the longest generation one group may take."""
    launch_ranks: int = 0
    """Generator ranks inside the launch itself: the last `launch_ranks` ranks of the torchrun / srun
    world each run a native engine (one device each) and serve the driver over torch.distributed,
    with weights broadcast to them after every step (placement/generator_ranks.py). The other ranks
    train. 0: generators are SGLang servers (`urls`) or local (rollout.placement)."""

    def __post_init__(self) -> None:
        require(self.num_engines >= 1, "num_engines", "must be >= 1")
        require(self.launch_ranks >= 0, "launch_ranks", "must be >= 0")
        require(not (self.launch_ranks and self.urls), "launch_ranks",
                "generator ranks in the launch and SGLang server urls are two different generator groups; set one")
        require(self.engine_tp >= 1, "engine_tp", "must be >= 1")
        require(self.fp8_block_size >= 1, "fp8_block_size", "must be >= 1")
        require(self.max_running_requests >= 1, "max_running_requests", "must be >= 1")
        require(self.vllm_kv_cache_gib > 0, "vllm_kv_cache_gib", "must be > 0")
        require(self.ready_timeout_s > 0, "ready_timeout_s", "must be > 0")
        require(self.dead_engine_timeout_s > 0, "dead_engine_timeout_s", "must be > 0")
        require(self.hung_engine_timeout_s >= 0, "hung_engine_timeout_s", "must be >= 0 (0: never)")
        require(self.backend == "vllm" or not (self.vllm_python or self.vllm_args), "vllm_python",
                f"vllm_python / vllm_args are settings of backend vllm, not {self.backend}")
        require(self.backend == "vllm" or self.vllm_weight_transfer == "auto", "vllm_weight_transfer",
                f"a setting of backend vllm, not {self.backend}")
        require(not (self.backend == "vllm" and self.launch_ranks), "launch_ranks",
                "generator ranks run the native engine; backend vllm runs vLLM servers (launched or in urls)")
