"""The Megatron-core policy trainer: model, DDP, optimizer, schedules, and the loss-function hook.

`MegatronTrainer.train_step(batch, loss_fn)` runs Megatron's `get_forward_backward_func` schedule
(no pipelining, or 1F1B with PP > 1) over micro-batches, then an optimizer step.

The loss hook. `loss_fn(logprobs, micro_batch, entropy) -> (loss, metrics)` receives the
token-aligned log-probabilities `logprobs[b, t] = log pi(tokens[b, t] | tokens[b, :t])` and the policy's
entropy at each of those positions ([b, S] float32, column 0 is 0; both differentiable) of one
micro-batch and returns that micro-batch's *share of the global loss*: the sum over its
tokens or sequences divided by a normaliser the loss function computed over the whole global batch
(all micro-batches and data-parallel ranks). The trainer undoes Megatron's own division by the number
of micro-batches and its gradient averaging over data-parallel ranks, so the gradient is exactly that
of the global loss, whatever the micro-batching and DP size. The reported `train/loss` is the
global loss (the sum of the shares); the hook's other metrics are scalars averaged over micro-batches
and data-parallel ranks. Only the batch's `loss_positions()` (by default where `loss_mask` is non-zero)
are computed, 0 elsewhere: the output layer and softmax are skipped on prompt and padding tokens. Without
pipeline parallelism each micro-batch is trimmed after its last loss position (the trimmed micro-batch
is what the hook receives).
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from megatron.core.transformer.module import Float16Module

from megatron_rl.config import ConfigError
from megatron_rl.kernels.logprob import fused_logprobs_and_entropy, soft_cap
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.lora_layout import (
    base_checksum,
    megatron_to_peft,
    peft_to_megatron,
    read_peft_adapter,
)
from megatron_rl.models.megatron_layout import (
    MegatronLayout,
    hf_to_megatron,
    megatron_to_hf,
)
from megatron_rl.models.pretrained import (
    MEGATRON_META,
    load_megatron_shard,
    load_pretrained,
    read_megatron_layout,
    refuse_adapter_dir,
    resolve_model_path,
)
from megatron_rl.trainer import cpu_compat, local_fusions, lora
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.model import (
    build_gpt_model,
    resolve_layer_spec,
    transformer_config,
)
from megatron_rl.trainer.moe import NO_RECORD, MoERouting
from megatron_rl.trainer.packing import (
    balanced_rows,
    pack_micro_batch,
    row_extents,
    token_budget_micro_batches,
)
from megatron_rl.trainer.parallel import setup_model_parallel
from megatron_rl.types import TrainBatch

LossFn = Callable[[torch.Tensor, TrainBatch, torch.Tensor], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def _hidden_states_head(input_, weight=None, runtime_gather_output=None, **kwargs):
    """Stands in for the output layer's forward: the model returns final hidden states, and the
    log-prob kernel applies the output weight chunk by chunk (no [tokens, vocab] logits in memory)."""
    return input_, None


def params_dtype(config: TrainerConfig) -> torch.dtype:
    """`trainer.precision` as a dtype (auto: bf16 on CUDA, fp32 on CPU)."""
    if config.precision == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[config.precision]


class MegatronTrainer:
    """One rank's share of a Megatron-core GPT policy, with its optimizer and schedules."""

    def __init__(self, arch: ModelArch, config: TrainerConfig, *, pg_collection=None,
                 hf_state: dict[str, torch.Tensor] | None = None, frozen: bool = False):
        """`frozen`: a forward-only copy (e.g. the reference model of a KL penalty): no gradient
        buffers, optimizer or LR schedule, so it costs only its weights."""
        self.arch = arch
        self.config = config
        self.frozen = frozen
        self.step_count = 0
        # the model path the weights came from (`load_policy`): recorded beside LoRA adapters
        self.base_model: str | None = None
        self._base_checksum: str | None = None  # of the frozen base (LoRA), computed on first use
        # Called before each micro-batch and before each transformer layer's forward and backward: a CPU
        # trainer that shares its host's cores with a generator process re-takes its thread count here.
        # Per layer (tens of ms), not per micro-batch (seconds): a trainer still running on a core the
        # generator has just taken back oversubscribes the host, and its OpenMP barriers then wait on a
        # descheduled thread (measured: a 3.3 s micro-batch took 12 s).
        self.between_layers: Callable[[], Any] | None = None
        with cpu_compat.redirect_cuda_to_cpu():
            self._build(pg_collection, hf_state)

    # --- construction -----------------------------------------------------------------------------
    def _build(self, pg_collection, hf_state) -> None:
        cfg, parallel = self.config, self.config.parallel
        if not self.arch.is_moe and parallel.expert_parallel > 1:
            raise ConfigError(f"trainer.parallel.expert_parallel={parallel.expert_parallel} needs a mixture-of-experts "
                              f"model (this {self.arch.family} model is dense)")
        self.pg = pg_collection if pg_collection is not None else setup_model_parallel(parallel)
        self.tp_rank, self.tp_size = self.pg.tp.rank(), self.pg.tp.size()
        self.pp_rank, self.pp_size = self.pg.pp.rank(), self.pg.pp.size()
        self.dp_size = self.pg.dp.size()
        self.ep_rank, self.ep_size = (self.pg.ep.rank(), self.pg.ep.size()) if self.arch.is_moe else (0, 1)
        if cfg.moe_routing_replay and cfg.recompute_activations:
            raise ConfigError("trainer.moe_routing_replay with trainer.recompute_activations is not supported "
                             "(the recomputed forward would route by itself)")
        self.lora = cfg.lora if cfg.lora.enabled and not self.frozen else None
        # LoRA's low-rank path runs beside Megatron's local linears (its Transformer Engine path is not built).
        self.layout = MegatronLayout(self.arch, tp=self.tp_size, pp=self.pp_size,
                                     layer_spec=resolve_layer_spec(cfg.layer_spec, self.arch, lora=bool(self.lora)),
                                     vocab_divisible_by=cfg.vocab_divisible_by, ep=self.ep_size,
                                     first_stage_layers=parallel.first_stage_layers,
                                     last_stage_layers=parallel.last_stage_layers)
        self.params_dtype = params_dtype(cfg)
        torch.manual_seed(cfg.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed, inference_rng_tracker=not torch.cuda.is_available())
        if cfg.fp8 != "none" and self.layout.layer_spec != "te":
            raise ValueError(f"trainer.fp8={cfg.fp8!r} needs Transformer Engine layers, which need the "
                             "transformer_engine package and a CUDA GPU (pip install -e .[gpu])")
        self.tf_config = transformer_config(self.arch, tensor_parallel=self.tp_size, pipeline_parallel=self.pp_size,
                                            params_dtype=self.params_dtype, recompute=cfg.recompute_activations,
                                            fp8_recipe=None if cfg.fp8 == "none" else cfg.fp8,
                                            fp8_amax_history_len=cfg.fp8_amax_history_len,
                                            expert_parallel=self.ep_size, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
                                            moe_token_dispatcher=cfg.moe_token_dispatcher,
                                            moe_expert_bias_update_rate=cfg.moe_expert_bias_update_rate,
                                            first_stage_layers=parallel.first_stage_layers,
                                            last_stage_layers=parallel.last_stage_layers)
        self.sequence_parallel = bool(self.tf_config.sequence_parallel)
        model = build_gpt_model(self.layout, self.tf_config, self.pg, pre_process=self.is_first_stage,
                                post_process=self.is_last_stage)
        self.routing = MoERouting(model, num_experts=self.arch.num_experts, top_k=self.arch.moe_top_k,
                                  replay=cfg.moe_routing_replay,
                                  sequence_parallel_size=self.tp_size if self.sequence_parallel else 1,
                                  ) if self.arch.is_moe else None
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        self.gpt = model
        if self.is_last_stage:
            model.output_layer.forward = _hidden_states_head
            if self.sequence_parallel:
                # The head sees whole sequences: gather the sequence-parallel chunks. The log-prob kernel
                # all-reduces its hidden-state gradient over TP already, so backward only keeps this
                # rank's chunk (no second reduction).
                model.output_layer.forward = lambda input_, *args, **kwargs: _hidden_states_head(
                    gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False, group=self.pg.tp))
        if hf_state is not None:
            self.load_hf_state(hf_state)
        if self.lora is not None:
            if self.arch.is_mla and "linear_qkv" in self.lora.targets:
                raise ConfigError("trainer.lora.targets: linear_qkv does not exist under multi-latent attention "
                                  "(its q/kv down and up projections take no adapters yet): target linear_proj, "
                                  "linear_fc1, linear_fc2", field="trainer.lora.targets")
            first_expert = self.ep_rank * self.layout.local_experts if self.arch.is_moe else 0
            adapted = lora.add_adapters(model, self.lora, seed=cfg.seed, first_expert=first_expert,
                                        first_layer=self.layout.stage_layers(self.pp_rank).start)
            if not adapted:
                raise ConfigError(f"trainer.lora.targets {self.lora.targets} match no linear of this model")
            if self.lora.init_from:
                peft_state = read_peft_adapter(self.lora.init_from, rank=self.lora.rank, alpha=self.lora.alpha,
                                               targets=self.lora.targets)
                shards = peft_to_megatron(peft_state, self.layout, self.lora.targets)
                try:
                    self._load_into(self.checkpoint_state(), shards[self.pp_rank][self.tp_rank])
                except ValueError as exc:  # another model's adapter: its shapes do not fit
                    raise ConfigError(f"trainer.lora.init_from {self.lora.init_from}: {exc}") from None
        self._hook_layer_boundaries(model)
        model = self._network(model)
        if self.params_dtype != torch.float32:
            model = Float16Module(self.tf_config, model)
        if self.frozen:
            model.requires_grad_(False)
            self.model = model
            return
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.model = DistributedDataParallel(self.tf_config, ddp_config, model, pg_collection=self.pg)
        self.tf_config.finalize_model_grads_func = finalize_model_grads
        opt_config = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=self.params_dtype == torch.bfloat16, fp16=False,
            params_dtype=self.params_dtype, use_distributed_optimizer=cfg.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model], config_overrides=self._param_group_overrides(opt_config),
                                                use_gloo_process_groups=False, pg_collection=self.pg)
        local_fusions.fuse_adam(self.optimizer)  # (torch's Adam when neither TE nor Apex is installed)
        decay_steps = max(cfg.lr_decay_steps, cfg.lr_warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr,
            min_lr=cfg.min_lr if cfg.lr_decay_style != "constant" else cfg.lr,
            lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=cfg.lr_decay_style,
            start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay_steps,
            wd_incr_style="constant")

    def _network(self, gpt):
        """The module DDP wraps and trains: the GPTModel itself. Subclasses wrap it to add parameters
        (e.g. the value model's scalar head) that the optimizer and gradient buffers must include."""
        return gpt

    def _hook_layer_boundaries(self, model) -> None:
        """Call `between_layers` before each layer's forward and, through a gradient hook on its
        output, before its backward (both free when `between_layers` is None)."""
        def before(*_):
            if self.between_layers is not None:
                self.between_layers()

        def after_forward(_module, _inputs, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if self.between_layers is not None and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(before)

        decoder = getattr(model, "decoder", None)
        blocks = list(getattr(decoder, "layers", []))
        if getattr(decoder, "final_layernorm", None) is not None:
            blocks.append(decoder.final_layernorm)
        for block in blocks:
            block.register_forward_pre_hook(before)
            block.register_forward_hook(after_forward)

    def _param_group_overrides(self, opt_config):
        """Megatron optimizer param-group overrides (None: Megatron's standard ones). Subclasses give
        added parameters their own learning rate."""
        return None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # --- weights ----------------------------------------------------------------------------------
    def load_hf_state(self, hf_state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of HF-named weights into the model (and the optimizer's master copy)."""
        self.load_shard(hf_to_megatron(hf_state, self.layout)[self.pp_rank][self.layout.shard_index(self.tp_rank, self.ep_rank)])

    def _base_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named model weights without adapters (views)."""
        return {k: v for k, v in self.gpt.state_dict().items()
                if "_extra_state" not in k and v is not None and not lora.is_adapter_tensor(k)}

    def load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """Copy Megatron-named model weights (no adapters) into this rank's model."""
        self._base_checksum = None
        self._load_into(self._base_state(), shard)

    def _load_into(self, own: dict[str, torch.Tensor], shard: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(own) - set(shard))
        unexpected = sorted(set(shard) - set(own))
        if missing or unexpected:
            raise ValueError(f"weights do not fit this rank (tp={self.tp_rank}, pp={self.pp_rank}): "
                             f"missing {missing[:4]}, unexpected {unexpected[:4]}")
        with torch.no_grad():
            for name, tensor in own.items():
                if tensor.shape != shard[name].shape:
                    raise ValueError(f"tensor '{name}': shape {tuple(shard[name].shape)} does not fit "
                                     f"{tuple(tensor.shape)} on tp={self.tp_rank}, pp={self.pp_rank}")
                tensor.copy_(shard[name])
        if hasattr(self, "optimizer"):
            self.optimizer.reload_model_params()

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's Megatron-named weights as the policy computes with them (views, not copies; with LoRA,
        each adapted weight merged with its adapter: W + scaling * B A)."""
        base = self._base_state()
        return lora.merged_weights(self.gpt, base, self.lora) if self.lora is not None else base

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this rank's model: its weights, or with LoRA the adapters alone (the
        frozen base is named by `base_checksum`)."""
        if self.lora is None:
            return self.shard_state()
        return {k: v for k, v in self.gpt.state_dict().items() if lora.is_adapter_tensor(k)}

    def load_checkpoint_state(self, shard: dict[str, torch.Tensor]) -> None:
        """Inverse of `checkpoint_state` (`load_shard` without LoRA, which subclasses extend)."""
        if self.lora is None:
            self.load_shard(shard)
        else:
            self._load_into(self.checkpoint_state(), shard)

    def base_checksum(self) -> str:
        """Checksum of this rank's frozen base weights (LoRA), computed once."""
        if self._base_checksum is None:
            self._base_checksum = base_checksum(self._base_state())
        return self._base_checksum

    def adapters_disabled(self):
        """Context: the frozen base model (LoRA's adapters off), e.g. to score the KL reference policy."""
        return lora.adapters_disabled(self.gpt)

    def export_hf_state(self) -> dict[str, torch.Tensor]:
        """HF-named weights for a colocated engine. With one trainer rank these are views of the live
        parameters (the engine copies them into its own layout); otherwise a gather to every rank."""
        if dist.get_world_size() == 1:
            return megatron_to_hf([[self.shard_state()]], self.layout)
        state = self.gather_hf_state(dst=0)
        box = [state]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_hf_state(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """All shards gathered to global rank `dst` and converted to HF names (None elsewhere).
        For export and tests; weight sync to engines uses the bucketed, resharded path instead."""
        shards = self._gather_shards(self.shard_state(), dst)
        return None if shards is None else megatron_to_hf(shards, self.layout)

    def gather_peft_state(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """LoRA: the adapters of every rank gathered to global rank `dst` under PEFT's names (None elsewhere)."""
        if self.lora is None:
            raise RuntimeError("this trainer has no adapters (trainer.lora.rank is 0)")
        shards = self._gather_shards(self.checkpoint_state(), dst)
        return None if shards is None else megatron_to_peft(shards, self.layout, self.lora.targets)

    def _gather_shards(self, state: dict[str, torch.Tensor], dst: int) -> list[list[dict]] | None:
        """Every rank's `state` on global rank `dst` as shards[pp_rank][shard_index] (None elsewhere)."""
        world = dist.get_world_size()
        shard = {k: v.detach().float().cpu() if v.dtype == torch.float32 else v.detach().cpu()
                 for k, v in state.items()}
        if world == 1:
            return [[shard]]
        gathered: list = [None] * world if dist.get_rank() == dst else None
        # With expert parallelism a stage's shards differ over (TP, EP) ranks; the expert-data-parallel
        # replicas (and, without EP, the data-parallel ones) hold copies.
        replica = self.pg.expt_dp.rank() if self.arch.is_moe else self.pg.dp.rank()
        index = self.layout.shard_index(self.tp_rank, self.ep_rank)
        dist.gather_object((index, self.pp_rank, replica, shard), gathered, dst=dst)
        if gathered is None:
            return None
        shards = [[None] * self.layout.shards_per_stage for _ in range(self.pp_size)]
        for index, pp_rank, replica, state in gathered:
            if replica == 0:
                shards[pp_rank][index] = state
        return shards

    # --- colocated offload ------------------------------------------------------------------------
    def _optimizer_state(self) -> list[dict]:
        if self.frozen:
            return []
        wrappers = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [state for w in wrappers for state in w.optimizer.state.values()]

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: parameters, gradient buffers, optimizer states (and fp32 master
        copies, which Megatron keeps as optimizer state when training in bf16)."""
        size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
        params = list(self.model.parameters())
        grads = [] if self.frozen else [b.grad_data for b in getattr(self.model, "buffers", [])] or [
            p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        states = [t for state in self._optimizer_state() for t in state.values() if torch.is_tensor(t) and t.dim()]
        return {"params": size(params), "grads": size(grads), "optimizer": size(states)}

    def move_optimizer_state(self, device: str | torch.device) -> int:
        """Move the optimizer's state tensors (Adam moments) to `device`, e.g. to host memory while a
        colocated engine generates, and back before the next step. Returns the bytes moved."""
        moved = 0
        device = torch.device(device)
        for state in self._optimizer_state():
            for key, tensor in state.items():
                if torch.is_tensor(tensor) and tensor.dim() and tensor.device != device:
                    state[key] = tensor.to(device, non_blocking=True)
                    moved += tensor.numel() * tensor.element_size()
        if moved and device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        return moved

    # --- forward ----------------------------------------------------------------------------------
    def _output_weight(self) -> torch.Tensor:
        return self.gpt.shared_embedding_or_output_weight() if self.arch.tie_word_embeddings else \
            self.gpt.output_layer.weight

    def _token_logprobs(self, hidden: torch.Tensor, tokens: torch.Tensor,
                        where: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, S-1, H] final hidden states of tokens[:, :-1] -> token-aligned (log-probs, entropy), each
        [b, S] float32, via the fused vocab-parallel kernel (padding rows of the vocabulary excluded).
        With `where` ([b, S]), only positions where it is non-zero are computed (0 elsewhere): the
        output layer and softmax then cost nothing on prompt and padding tokens."""
        weight = self._output_weight()
        targets = tokens[:, 1:]
        select = None
        if where is not None:
            select = where[:, 1:].to(hidden.device) != 0
            hidden, targets = hidden[select], targets[select]
        logprobs, entropy = fused_logprobs_and_entropy(
            hidden, weight, targets, tp_group=self.pg.tp if self.tp_size > 1 else None,
            vocab_start=self.tp_rank * weight.shape[0], vocab_size=self.arch.vocab_size,
            softcap=self.arch.final_logit_softcapping)
        if select is not None:
            logprobs = logprobs.new_zeros(select.shape).masked_scatter(select, logprobs)
            entropy = entropy.new_zeros(select.shape).masked_scatter(select, entropy)
        pad = logprobs.new_zeros(tokens.shape[0], 1)
        return torch.cat([pad, logprobs], dim=1), torch.cat([pad, entropy], dim=1)

    def _packs(self, trim: bool) -> bool:
        """Whether a schedule packs its micro-batches (`trainer.sequence_packing`, for the passes that read only
        loss positions: `trim`)."""
        return self.config.sequence_packing and trim

    def _micro_batches(self, batch: TrainBatch, trim: bool) -> tuple[list[TrainBatch], torch.Tensor | None]:
        """The schedule's micro-batches: `micro_batch_size` rows each, or filled by tokens up to
        `max_tokens_per_micro_batch` when packing. `trim`: each ends at its last loss column (without pipeline
        parallelism, whose stages exchange activations of one fixed shape, unless packed to a fixed length).
        Also returns the batch's row index of the micro-batches' rows in order (None: the batch's own order)."""
        if self._packs(trim) and self.config.max_tokens_per_micro_batch:
            return token_budget_micro_batches(batch, self.config.max_tokens_per_micro_batch)
        micro = list(batch.micro_batches(self.config.micro_batch_size))
        if trim and (self.pp_size == 1 or self._packs(trim)):
            micro = [mb.trimmed() for mb in micro]
        return micro, None

    def data_parallel_share(self, batch: TrainBatch) -> TrainBatch:
        """This data-parallel rank's rows of a global batch: micro-batch i of `micro_batch_size` rows to rank
        i mod DP (the batch padded with empty rows to a whole number of micro-batches per rank), or, with a
        token budget, near-equal token counts per rank (`packing.balanced_rows`)."""
        rank = self.pg.dp.rank()
        if self.config.max_tokens_per_micro_batch:
            batch = batch.padded_rows(self.dp_size) if batch.batch_size < self.dp_size else batch
            return batch.select(balanced_rows(batch, self.dp_size)[rank])
        micro = self.config.micro_batch_size
        return batch.padded_rows(micro * self.dp_size).data_parallel_share(rank, self.dp_size, micro)

    def _run_schedule(self, micro: list[TrainBatch], on_hidden, forward_only: bool, packed: bool = False):
        """Run Megatron's schedule over `micro` (from `_micro_batches`); `on_hidden(hidden, tokens,
        micro_batch) -> (loss, outputs)` runs on the last stage (hidden: final hidden states [b, S-1, H] of the
        micro-batch) for each micro-batch. Returns the per-micro-batch outputs (last stage only). `packed`:
        each micro-batch runs as one packed row (trainer/packing.py); `on_hidden` still sees [b, S-1, H]."""
        # Sequence parallelism (MoE at TP > 1) splits the sequence over TP: inputs are padded to a multiple
        # of TP at the end (a causal model's earlier positions do not see them) and the padding dropped again.
        multiple = self.tp_size if self.sequence_parallel else 1
        fixed = None
        if packed and self.pp_size > 1:  # pipeline stages exchange one shape: every packed row the budget's length
            fixed = -(-self.config.max_tokens_per_micro_batch // math.lcm(multiple, micro[0].token_multiple))
            fixed *= math.lcm(multiple, micro[0].token_multiple)
        seq = fixed or -(-(max(mb.seq_length for mb in micro) - 1) // multiple) * multiple
        device = self._device()
        sp_rank = self.tp_rank if multiple > 1 else 0

        def forward_step(data_iterator, model):
            mb: TrainBatch = next(data_iterator)
            if self.between_layers is not None:
                self.between_layers()
            tokens = mb.tokens.to(device)
            if packed:
                rows = pack_micro_batch(mb, multiple=math.lcm(multiple, mb.token_multiple), length=fixed, device=device)
                if self.routing is not None:
                    record = None if mb.routed_experts is None else rows.pack(
                        self.routing.fit_record(mb.routed_experts, rows.columns), NO_RECORD)
                    self.routing.set_micro_batch(record, rows.valid, rows.length, sp_rank, multiple)
                output = model(rows.inputs, rows.positions, None, packed_seq_params=rows.params)
                if self.routing is not None:
                    self.routing.finish_micro_batch()
                return output, lambda hidden: on_hidden(rows.unpack(hidden), tokens, mb)
            inputs = tokens[:, :-1]
            width = inputs.shape[1]
            if width % multiple:
                inputs = torch.cat([inputs, inputs.new_zeros(inputs.shape[0], multiple - width % multiple)], dim=1)
            positions = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
            if self.routing is not None:
                self.routing.set_micro_batch(mb.routed_experts, _routed_positions(mb, inputs.shape[1]),
                                             inputs.shape[1], sp_rank, multiple)
            output = model(inputs, positions, None)
            if self.routing is not None:
                self.routing.finish_micro_batch()
            if self.is_last_stage and output.shape[1] != width:
                output = output[:, :width]
            return output, lambda hidden: on_hidden(hidden, tokens, mb)

        schedule = get_forward_backward_func()
        return schedule(forward_step_func=forward_step, data_iterator=iter(micro), model=[self.model],
                        num_microbatches=len(micro), seq_length=seq,
                        micro_batch_size=1 if packed else self.config.micro_batch_size, forward_only=forward_only)

    def _forward_only(self, batch: TrainBatch, on_hidden, key: str, trim: bool = False) -> torch.Tensor | None:
        """Concatenated `key` outputs of a forward-only pass (last stage; None elsewhere). Pads the batch
        with empty rows up to a multiple of micro_batch_size (pipelines need equal micro-batches) and drops
        them again. `trim` as in `_micro_batches` (`on_hidden` then sees each
        micro-batch's columns up to its last loss position only, packed with `trainer.sequence_packing`)."""
        rows = batch.batch_size
        batch = batch.padded_rows(self.config.micro_batch_size)
        self._check_batch(batch)
        self.model.eval()
        try:
            micro, order = self._micro_batches(batch, trim)
            outputs = self._run_schedule(micro, on_hidden, forward_only=True, packed=self._packs(trim))
        finally:
            self.model.train()
        if not self.is_last_stage:
            return None
        result = torch.cat([o[key] for o in outputs])
        if order is not None:
            result = torch.empty_like(result).index_copy_(0, order.to(result.device), result)
        return result[:rows]

    def _broadcast_from_last_stage(self, result: torch.Tensor | None, shape, dtype) -> torch.Tensor:
        if self.pp_size == 1:
            return result.cpu()
        buffer = result.to(self._device()) if result is not None else torch.empty(shape, dtype=dtype, device=self._device())
        dist.broadcast(buffer, src=dist.get_global_rank(self.pg.pp, self.pp_size - 1), group=self.pg.pp)
        return buffer.cpu()

    def _check_batch(self, batch: TrainBatch) -> None:
        if not self.config.max_tokens_per_micro_batch and batch.batch_size % self.config.micro_batch_size:
            raise ValueError(f"batch of {batch.batch_size} rows is not a multiple of micro_batch_size="
                             f"{self.config.micro_batch_size} (pipeline schedules need equal micro-batches)")
        if batch.seq_length > self.arch.max_position_embeddings:
            raise ValueError(f"sequence length {batch.seq_length} exceeds the model's "
                             f"max_position_embeddings={self.arch.max_position_embeddings}")

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token-aligned log pi(tokens) [B, S] (float32, CPU) on every rank of this DP replica; with
        `trainer.sequence_packing`, at the batch's loss positions only (0 elsewhere), packed like training."""
        packing = self.config.sequence_packing
        width = batch.seq_length

        def on_hidden(hidden, tokens, mb):
            logprobs = self._token_logprobs(hidden, tokens, where=mb.loss_positions() if packing else None)[0]
            return hidden.new_zeros(()), {"logprobs": F.pad(logprobs, (0, width - logprobs.shape[1]))}

        with cpu_compat.redirect_cuda_to_cpu():
            result = self._forward_only(batch, on_hidden, "logprobs", trim=packing)
            return self._broadcast_from_last_stage(result, (batch.batch_size, batch.seq_length), torch.float32)

    @torch.no_grad()
    def compute_logits(self, batch: TrainBatch) -> torch.Tensor:
        """Full-vocabulary logits [B, S-1, vocab_size] (float32, CPU) predicting tokens[:, 1:], gathered
        over TP (padding dropped), on every rank of this DP replica. For parity checks and evaluation."""
        def on_hidden(hidden, tokens, mb):
            logits = soft_cap(hidden.float() @ self._output_weight().float().t(), self.arch.final_logit_softcapping)
            full = gather_from_tensor_model_parallel_region(logits)[..., :self.arch.vocab_size]
            return hidden.new_zeros(()), {"logits": full}

        with cpu_compat.redirect_cuda_to_cpu():
            result = self._forward_only(batch, on_hidden, "logits")
            return self._broadcast_from_last_stage(
                result, (batch.batch_size, batch.seq_length - 1, self.arch.vocab_size), torch.float32)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on `batch` (this DP rank's rows). Returns averaged metrics on every rank."""
        def head_loss(hidden, tokens, mb):
            logprobs, entropy = self._token_logprobs(hidden, tokens, where=mb.loss_positions())
            return loss_fn(logprobs, mb, entropy)

        diagnostics = self.replay_diagnostics(batch) if self.config.moe_replay_diagnostics else {}
        return {**self.train_step_on_hidden(batch, head_loss, trim=True), **diagnostics}

    def replay_diagnostics(self, batch: TrainBatch) -> dict[str, float]:
        """The log-prob mismatch with the engine over `batch`'s sampled tokens with the engine's routing
        replayed and with the trainer's own (two forward passes at the current weights; averaged over DP),
        and the same over the routing-sensitive tokens alone: those whose two log-probs differ (a route that
        differs at the token or, through attention, before it). Empty for dense models and batches without
        a routing record or behaviour log-probs."""
        if self.routing is None or batch.routed_experts is None or batch.behaviour_logprobs is None:
            return {}
        sampled = (batch.loss_mask != 0) & torch.isfinite(batch.behaviour_logprobs)
        trained_with = self.routing.replay
        logprobs = {}
        try:
            for replay in (True, False):
                self.routing.replay = replay
                logprobs[replay] = self.compute_logprobs(batch)[sampled].double()
        finally:
            self.routing.replay = trained_with
            self.routing.reset_stats()
        behaviour = batch.behaviour_logprobs[sampled].double()
        gaps = [(logprobs[replay] - behaviour).abs() for replay in (True, False)]
        # the same routing gives the same kernels, so the same bits; 1e-6 leaves room for the order in which
        # a token's experts are summed
        sensitive = (logprobs[True] - logprobs[False]).abs() > 1e-6
        sums = torch.tensor([float(gaps[0].sum()), float(gaps[1].sum()), float(gaps[0].numel()),
                             float(gaps[0][sensitive].sum()), float(gaps[1][sensitive].sum()), float(sensitive.sum())],
                            dtype=torch.float64)
        peaks = torch.tensor([float(g.max()) if g.numel() else 0.0 for g in gaps], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(sums, group=self.pg.dp)
            dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=self.pg.dp)
        count, sensitive_count = max(float(sums[2]), 1.0), float(sums[5])
        metrics = {"moe/logprob_mismatch_replay": float(sums[0]) / count,
                   "moe/logprob_mismatch_own_routing": float(sums[1]) / count,
                   "moe/logprob_mismatch_replay_max": float(peaks[0]),
                   "moe/logprob_mismatch_own_routing_max": float(peaks[1]),
                   "moe/routing_sensitive_tokens": sensitive_count / count}
        if sensitive_count:
            metrics.update({"moe/logprob_mismatch_replay_sensitive": float(sums[3]) / sensitive_count,
                            "moe/logprob_mismatch_own_routing_sensitive": float(sums[4]) / sensitive_count})
        return metrics

    def train_step_on_hidden(self, batch: TrainBatch, head_loss, *, trim: bool = False) -> dict[str, float]:
        """One optimizer step where `head_loss(hidden [b, S-1, H], tokens [b, S], micro_batch) ->
        (loss share, metrics)` turns a micro-batch's final hidden states into its share of the global
        loss (the contract of the loss hook in the module docstring). `trim`: micro-batches end at
        their last `loss_positions()` column."""
        if self.frozen:
            raise RuntimeError("a frozen trainer (forward only) cannot take an optimizer step")
        self._check_batch(batch)
        micro, _ = self._micro_batches(batch, trim)
        num_micro = len(micro)
        # Megatron divides each micro-batch loss by their count and averages gradients over DP; the
        # hook's loss is already a share of the global loss, so scale those back out (module doc).
        scale = num_micro * self.dp_size

        def on_hidden(hidden, tokens, mb):
            loss, metrics = head_loss(hidden, tokens, mb)
            # Metrics are averaged over micro-batches and DP ranks; the loss is a share, so its total is
            # the sum: report it pre-multiplied by the number of shares.
            reported = {"loss": loss.detach() * scale, **{k: v.detach() for k, v in metrics.items()}}
            return loss * scale, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in reported.items()}

        start = time.perf_counter()
        if self.routing is not None:
            self.routing.reset_stats()
        with cpu_compat.redirect_cuda_to_cpu():
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run_schedule(micro, on_hidden, forward_only=False, packed=self._packs(trim))
            finite = self._loss_and_grads_finite(outputs)
            # A NaN/Inf loss or gradient would poison the weights and Adam's moments for good: skip
            # the update (weights, optimizer state and LR schedule untouched) and report it.
            update_ok, grad_norm, _ = self.optimizer.step() if finite else (False, math.nan, None)
            if update_ok:
                self.scheduler.step(increment=1)
                self.step_count += 1
            metrics = self._reduce_metrics(outputs)
            if self.routing is not None:
                metrics.update(self.routing.metrics(micro_batches=num_micro))
        metrics.update({"train/grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
                        "train/lr": self.optimizer.param_groups[0]["lr"],
                        "train/update_skipped": float(not update_ok),
                        "train/nonfinite": float(not finite),
                        "perf/train_step_time": time.perf_counter() - start})
        return metrics

    def _loss_and_grads_finite(self, outputs: list[dict[str, torch.Tensor]]) -> bool:
        """Whether every micro-batch loss (last stage) and every gradient (all ranks) is finite; the
        verdict is agreed over the TP, PP and DP groups so that every rank skips or steps together."""
        bad = torch.zeros((), dtype=torch.float32, device=self._device())
        if self.is_last_stage and any(not torch.isfinite(o["loss"]).all() for o in outputs):
            bad.fill_(1.0)
        grads = [g for g in (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                             for p in self.model.parameters()) if g is not None]
        if grads and not bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            bad.fill_(1.0)
        for group, size in ((self.pg.tp, self.tp_size), (self.pg.pp, self.pp_size), (self.pg.dp, self.dp_size)):
            if size > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return not bool(bad.item())

    def _reduce_metrics(self, outputs: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        names = sorted(outputs[0]) if outputs else []
        count = torch.tensor([len(names)], dtype=torch.float64, device=self._device())
        if self.pp_size > 1:  # only the last stage computed losses: tell the others how many metrics
            dist.broadcast(count, src=dist.get_global_rank(self.pg.pp, self.pp_size - 1), group=self.pg.pp)
        values = torch.zeros(int(count.item()), dtype=torch.float64, device=self._device())
        if self.is_last_stage and names:
            values = torch.stack([torch.stack([o[n] for o in outputs]).double().mean() for n in names]).to(values.device)
        if self.pp_size > 1:
            dist.broadcast(values, src=dist.get_global_rank(self.pg.pp, self.pp_size - 1), group=self.pg.pp)
            names_box = [names]
            dist.broadcast_object_list(names_box, src=dist.get_global_rank(self.pg.pp, self.pp_size - 1), group=self.pg.pp)
            names = names_box[0]
        if self.dp_size > 1:
            dist.all_reduce(values, group=self.pg.dp)
            values /= self.dp_size
        return {(n if "/" in n else f"train/{n}"): float(v) for n, v in zip(names, values.tolist())}


def _routed_positions(mb: TrainBatch, width: int) -> torch.Tensor:
    """[b, width] bool: input positions up to each row's last loss position (the router statistics skip
    right padding and rows without loss)."""
    return torch.arange(width).unsqueeze(0) < row_extents(mb).unsqueeze(1)


def load_policy(model_path: str, config: TrainerConfig, *, pg_collection=None, pretrained=None) -> MegatronTrainer:
    """A trainer holding `model_path`'s weights. A Megatron checkpoint written at this rank's TP x PP is
    read shard by shard (each rank reads only its own file); any other source is converted in memory
    (from `pretrained`, a `load_pretrained(model_path, lazy=True)` the caller also uses, when given)."""
    path = resolve_model_path(model_path)
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, MEGATRON_META)):
        refuse_adapter_dir(path)
        saved = read_megatron_layout(path)
        trainer = MegatronTrainer(saved.arch, config, pg_collection=pg_collection)
        trainer.base_model = model_path
        if (saved.tp, saved.pp, saved.ep, saved.layer_spec, saved.padded_vocab_size) == (
                trainer.tp_size, trainer.pp_size, trainer.ep_size, trainer.layout.layer_spec,
                trainer.layout.padded_vocab_size):
            trainer.load_shard(load_megatron_shard(path, trainer.tp_rank, trainer.pp_rank,
                                                   trainer.ep_rank if trainer.ep_size > 1 else None))
            return trainer
        trainer.load_hf_state((pretrained or load_pretrained(path)).state)
        return trainer
    model = pretrained or load_pretrained(path)
    trainer = MegatronTrainer(model.arch, config, pg_collection=pg_collection, hf_state=model.state)
    trainer.base_model = model_path
    return trainer
