"""The trainer's configuration, importable without torch: the policy trainer (`trainer:`), its
parallel layout (`trainer.parallel:`) and the PCL value model (`curriculum.value:`)."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import RECIPE_PATH_FIELD, ConfigError, require


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How trainer ranks split the model: tensor x pipeline x data parallel (data = world / (TP * PP))."""

    tensor_parallel: int = 1
    """Tensor-parallel size (Megatron TP); must divide the model's key/value heads."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (Megatron PP); must divide the number of layers, or the layers left after
    first_stage_layers / last_stage_layers must split evenly over the other stages."""
    first_stage_layers: int | None = None
    """Layers of the first pipeline stage, which also holds the embedding (Megatron's
    num_layers_in_first_pipeline_stage; None: an even share). E.g. DeepSeek-V3's 61 layers over PP 16: 3, with
    last_stage_layers 2 and 4 on each other stage."""
    last_stage_layers: int | None = None
    """Layers of the last pipeline stage, which also holds the output layer and the loss (Megatron's
    num_layers_in_last_pipeline_stage; None: an even share)."""
    expert_parallel: int = 1
    """Expert-parallel size (Megatron EP, mixture-of-experts models only): each EP rank holds num_experts / EP
    experts of every layer; must divide num_experts and the data-parallel size (EP groups are carved out of
    the data-parallel ranks, experts keep TP as their tensor-parallel size). docs/moe.md."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto picks nccl when CUDA is available, else gloo."""
    timeout_minutes: int = 30
    """Collective timeout."""

    def __post_init__(self) -> None:
        require(self.tensor_parallel >= 1, "tensor_parallel", "must be >= 1")
        require(self.pipeline_parallel >= 1, "pipeline_parallel", "must be >= 1")
        require(self.expert_parallel >= 1, "expert_parallel", "must be >= 1")
        require(self.timeout_minutes >= 1, "timeout_minutes", "must be >= 1")


    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if world_size % model_parallel:
            raise ConfigError(f"world size {world_size} is not a multiple of tensor_parallel x pipeline_parallel "
                              f"= {self.tensor_parallel} x {self.pipeline_parallel}")
        data = world_size // model_parallel
        if data % self.expert_parallel:
            raise ConfigError(f"expert_parallel={self.expert_parallel} does not divide the data-parallel size {data} "
                              f"(world {world_size} / (tensor_parallel {self.tensor_parallel} x pipeline_parallel "
                              f"{self.pipeline_parallel})): expert-parallel groups are made of data-parallel ranks")
        return data


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021) on the policy's linear layers, with the base weights frozen:
    only the adapters get gradients and optimizer state (trainer/lora.py, docs/lora.md)."""

    rank: int = 0
    """Rank r of each adapter (0: no adapters, the whole model trains)."""
    alpha: float = 32.0
    """The adapter's output is scaled by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapter's input during training (PEFT's `lora_dropout`)."""
    targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    """Megatron's linears that get adapters: linear_qkv (the fused q/k/v projection), linear_proj (attention
    output), linear_fc1 (MLP in: fused gate/up) and linear_fc2 (MLP out); in a mixture-of-experts layer the
    last two are every expert's."""
    init_from: str = dataclasses.field(default="", metadata={RECIPE_PATH_FIELD: True})
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors, e.g. from `convert --to peft`)
    to start the adapters from, instead of PEFT's initialisation (B = 0); its r, lora_alpha and target modules
    must be this section's."""

    def __post_init__(self) -> None:
        require(self.rank >= 0, "rank", f"must be >= 0 (0: no adapters), got {self.rank!r}")
        require(0 < self.alpha < float("inf"), "alpha", f"must be a finite number > 0, got {self.alpha!r}")
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown:
            require(False, "targets", f"unknown target {unknown[0]!r} (choose from {', '.join(LORA_TARGETS)})")
        require(bool(self.targets) and len(set(self.targets)) == len(self.targets), "targets",
                "must name at least one linear, each once")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The Megatron policy trainer: parallel layout, precision, optimizer."""

    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Tensor / pipeline layout of the trainer ranks."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Parameter dtype: auto is bf16 on GPU (fp32 master weights in the optimizer), fp32 on CPU."""
    lr: float = 1e-6
    """Peak learning rate (Adam)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (with lr_decay_style cosine/linear)."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps from 0 to lr."""
    lr_decay_steps: int = 0
    """Steps over which the learning rate decays to min_lr (0: constant after warm-up)."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay shape after warm-up."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    micro_batch_size: int = 4
    """Rows per forward/backward micro-batch on each data-parallel rank (without a token budget)."""
    sequence_packing: bool = False
    """Pack each micro-batch's rows into one row without padding (positions restart and attention stays
    inside each row: Transformer Engine's THD attention on GPU, a variable-length path on the local layers),
    each row up to its last loss position. Log-probs, losses and gradients equal the padded computation;
    compute follows the real tokens. docs/performance.md (bench packing)."""
    max_tokens_per_micro_batch: int = 0
    """Fill micro-batches by tokens instead of rows: at most this many packed tokens each (first-fit
    decreasing; a longer row gets a micro-batch of its own), and data-parallel ranks get equal token counts,
    not equal rows. Needs sequence_packing. 0: micro_batch_size rows per micro-batch."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer, ZeRO-1)."""
    recompute_activations: bool = False
    """Recompute every layer's activations in the backward pass (full, uniform)."""
    layer_spec: Literal["auto", "local", "te"] = "auto"
    """Transformer Engine layers when TE + CUDA are present (auto), or Megatron's local layers."""
    fp8: Literal["none", "delayed", "tensorwise"] = "none"
    """Transformer Engine FP8 GEMMs (needs the TE layer spec, so TE + CUDA): delayed scaling (amax
    history) or tensorwise current scaling. Weights and master weights stay bf16 / fp32."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: steps of amax history per tensor."""
    vocab_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times TP (padding logits are masked out)."""
    seed: int = 1234
    """Seed for initialisation (and Megatron's model-parallel RNG tracker)."""
    max_nonfinite_steps_in_a_row: int = 3
    """A step whose loss or gradients hold NaN/Inf is skipped (weights and optimizer state untouched,
    counted as train/nonfinite); the run stops with an error after this many such steps in a row."""
    moe_aux_loss_coeff: float | None = None
    """Mixture of experts: coefficient of Megatron's load-balancing (switch) loss added to the policy loss;
    None takes the model's `router_aux_loss_coef` (HF config), 0 turns it off. Dense models ignore it."""
    moe_expert_bias_update_rate: float = 1e-3
    """Mixture of experts with a sigmoid router's expert bias (GLM-4.5, DeepSeek-V3): after each step every MoE
    layer's bias moves by this much towards a uniform load, +rate for each expert with fewer tokens than the mean
    over the step, -rate for more (aux-loss-free balancing, Megatron's `moe_router_bias_update_rate`); 0 keeps
    the bias fixed. Logged as moe/expert_bias_mean_abs. Other models ignore it."""
    moe_routing_replay: bool = False
    """Mixture of experts: recompute log-probs and gradients with the experts the rollout engine chose
    (`Completion.routed_experts`, through Megatron's RouterReplay), so the trainer's policy is the one that
    sampled; positions without a record use the trainer's own routing. docs/moe.md."""
    moe_replay_diagnostics: bool = False
    """Mixture of experts: before each step, two extra forward passes (no gradient) score the batch with the
    engine's experts replayed and with the trainer's own routing, and report both log-prob mismatches with
    the engine (`moe/logprob_mismatch_replay`, `moe/logprob_mismatch_own_routing`: mean |log pi - log mu|
    over sampled tokens; `_max` the largest), whichever of the two trains; `moe/routing_sensitive_tokens` is the
    share of sampled tokens whose two log-probs differ, and `_sensitive` the two mismatches over those tokens
    alone (where replay can matter). Costs two forwards per step."""
    moe_token_dispatcher: Literal["auto", "allgather", "alltoall"] = "auto"
    """Megatron's MoE token dispatcher: auto is alltoall on CUDA and allgather on CPU (Megatron's alltoall
    dispatcher needs CUDA streams)."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """Low-rank adapters with the base frozen (`rank: 0`, the default: full fine-tuning). docs/lora.md."""

    def __post_init__(self) -> None:
        # Adam's step is about lr per weight: above 1 every weight is rewritten each step.
        require(0 <= self.lr <= 1, "lr", f"must be a finite number in [0, 1], got {self.lr!r}")
        require(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr={self.lr!r}], got {self.min_lr!r}")
        require(0 <= self.weight_decay <= 1, "weight_decay", f"must be in [0, 1], got {self.weight_decay!r}")
        require(0 < self.adam_eps < 1, "adam_eps", f"must be in (0, 1), got {self.adam_eps!r}")
        require(self.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
        require(self.max_tokens_per_micro_batch >= 0, "max_tokens_per_micro_batch", "must be >= 0 (0: rows)")
        require(not self.max_tokens_per_micro_batch or self.sequence_packing, "max_tokens_per_micro_batch",
                "fills packed micro-batches; set trainer.sequence_packing: true")
        require(not self.sequence_packing or self.parallel.pipeline_parallel == 1 or self.max_tokens_per_micro_batch,
                "sequence_packing", "with pipeline_parallel > 1 needs max_tokens_per_micro_batch (pipeline stages "
                "exchange packed rows of that one length)")
        require(0 <= self.clip_grad < float("inf"), "clip_grad", "must be a finite number >= 0 (0 disables clipping)")
        require(0 <= self.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
        require(0 <= self.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
        require(self.vocab_divisible_by >= 1, "vocab_divisible_by", "must be >= 1")
        require(self.max_nonfinite_steps_in_a_row >= 1, "max_nonfinite_steps_in_a_row", "must be >= 1")
        require(self.fp8 == "none" or self.layer_spec != "local", "fp8",
                "FP8 runs through Transformer Engine layers; set layer_spec to auto or te")
        require(not self.lora.enabled or self.layer_spec != "te", "lora",
                "adapters run beside Megatron's local linears; set trainer.layer_spec to auto or local")
        require(not self.lora.enabled or self.fp8 == "none", "lora",
                "adapters run on the local layers, without Transformer Engine's FP8; set trainer.fp8: none")
        require(self.fp8_amax_history_len >= 1, "fp8_amax_history_len", "must be >= 1")
        require(self.lr_warmup_steps >= 0 and self.lr_decay_steps >= 0, "lr_warmup_steps",
                "warm-up and decay steps must be >= 0")
        require(0 <= self.moe_expert_bias_update_rate < float("inf"), "moe_expert_bias_update_rate",
                f"must be a finite number >= 0, got {self.moe_expert_bias_update_rate!r}")
        require(self.moe_aux_loss_coeff is None or 0 <= self.moe_aux_loss_coeff < float("inf"), "moe_aux_loss_coeff",
                f"must be a finite number >= 0 (or null: the model's router_aux_loss_coef), got {self.moe_aux_loss_coeff!r}")



@dataclasses.dataclass(kw_only=True)
class ValueModelConfig:
    """PCL's value model: its initial weights, size, head and optimizer."""

    init_from: str = dataclasses.field(default="policy", metadata={RECIPE_PATH_FIELD: True})
    """'policy': a copy of the policy's starting weights; otherwise a model path (any form `model.path`
    accepts) with the policy's tokenizer and vocabulary."""
    num_layers: int = 0
    """Keep only the first N transformer layers of the initial weights (0: all): a smaller, cheaper
    value model built from the same network."""
    head: Literal["sigmoid", "linear"] = "sigmoid"
    """sigmoid: V in (0, 1), for rewards in [0, 1]; linear: unbounded V."""
    head_lr: float = 1e-4
    """Adam learning rate of the scalar head (the backbone uses trainer.lr)."""
    updates_per_step: int = 1
    """Optimizer steps of V on each training step's groups (the paper: 1)."""
    standardize_features: bool = True
    """The head reads the state standardised per feature with running mean/variance of the states V
    was trained on (module docstring: the raw state is dominated by a prompt-independent component,
    so a head on it learns per-prompt differences only slowly). The paper does not specify the head."""
    mean_reward_prior: bool = True
    """Offset the head's logit by logit(mean target of its last training batch) (linear head: the mean
    itself), so V starts each step at the recent mean reward and the learned part is the per-prompt
    residual. The paper's V is a plain regression; this is a non-learned baseline, the loss is the
    paper's."""
    replay_prompts: int = 0
    """Also regress V on this many most recent (prompt, mean reward) pairs of earlier steps (0: only
    the step's own groups, as in the paper). The paper trains on m = 512 prompts a step; with a small
    m, one step's targets (each a mean of n 0/1 rewards) are too few and too noisy to fit, and a short
    replay of targets a step or two old (the policy moves little between steps) gives V a batch to
    fit. A pair is kept for at most replay_prompts / m steps."""
    trainer: TrainerConfig = dataclasses.field(default_factory=lambda: TrainerConfig(lr=1e-5, micro_batch_size=8))
    """Backbone optimizer, precision and micro-batching. The value model runs on the policy trainer's
    ranks with the policy's process groups, so `trainer.parallel` is not used."""

    def __post_init__(self) -> None:
        require(bool(self.init_from.strip()), "init_from", "must be 'policy' or a model path")
        require(self.num_layers >= 0, "num_layers", "must be >= 0 (0: all layers)")
        require(0 <= self.head_lr <= 1, "head_lr", f"must be a finite number in [0, 1], got {self.head_lr!r}")
        require(self.updates_per_step >= 1, "updates_per_step", "must be >= 1")
        require(self.replay_prompts >= 0, "replay_prompts", "must be >= 0 (0: no replay)")
        require(not self.trainer.lora.enabled, "trainer.lora", "the value model trains all its weights (no adapters)")


@dataclasses.dataclass(kw_only=True)
class CriticConfig:
    """PPO's learned critic (`algorithm.objective: ppo`): a Megatron value model V(s_t) per token on the
    policy's ranks and process groups (same TP/PP/DP), trained in the same step as the policy and
    checkpointed with it (trainer/value.py: CriticTrainer)."""

    init_from: str = dataclasses.field(default="policy", metadata={RECIPE_PATH_FIELD: True})
    """'policy': the policy's starting weights with a zero scalar head (V = 0 everywhere at first);
    otherwise a model path (any form `model.path` accepts, e.g. a reward model's backbone) with the
    policy's vocabulary."""
    value_clip: float | None = 0.5
    """c of the clipped value loss: V may move at most c from the values the step's advantages were
    computed with (verl's cliprange_value 0.5). null: plain squared error."""
    warmup_steps: int = 0
    """Steps at the start of a run where only the critic trains (the policy waits for a useful baseline;
    OpenRLHF's critic pretraining steps)."""
    head_lr: float = 1e-4
    """Adam learning rate of the scalar head (the backbone uses trainer.lr): a zero head moved at the
    backbone's 1e-6..1e-5 would take hundreds of steps to reach the reward scale."""
    updates_per_step: int = 1
    """Critic optimizer steps on each step's batch."""
    trainer: TrainerConfig = dataclasses.field(default_factory=lambda: TrainerConfig(lr=1e-5))
    """Backbone optimizer, precision and micro-batching; `trainer.parallel` is not used (the policy's groups)."""

    def __post_init__(self) -> None:
        require(bool(self.init_from.strip()), "init_from", "must be 'policy' or a model path")
        require(self.value_clip is None or 0 < self.value_clip <= 1000, "value_clip",
                f"must be in (0, 1000] (or null), got {self.value_clip!r}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
        require(0 <= self.head_lr <= 1, "head_lr", f"must be a finite number in [0, 1], got {self.head_lr!r}")
        require(self.updates_per_step >= 1, "updates_per_step", f"must be >= 1, got {self.updates_per_step!r}")
        require(not self.trainer.lora.enabled, "trainer.lora", "the critic trains all its weights (no adapters)")
        require(self.trainer.parallel == ParallelConfig(), "trainer.parallel",
                "the critic runs on the policy's ranks and process groups: set the layout in trainer.parallel")
