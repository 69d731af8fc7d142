"""`megatron-rl plan CONFIG.yaml`: validate a cluster layout and predict memory and step time, no GPU.

Checks, in order, each failing with a message that names the field: the world (nodes x GPUs per node)
splits into the generator group and a trainer whose TP x PP divides it; TP divides the KV heads and
fits in a node; PP divides the layers; the engines' TP fits the heads and a node; the global batch
splits into whole micro-batches per data-parallel rank. Then memory per GPU, term by term, for a
trainer rank and an engine GPU; a term that overflows the usable memory is named in the error. Last,
the predicted times of generation, training and weight sync, and the step under the configured
placement (colocated: the sum; disaggregated: the overlap of generation with training, plus sync).
"""
from __future__ import annotations

import dataclasses
import math
import os

from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.arch import PRESETS, ModelArch, preset
from megatron_rl.sim import cost
from megatron_rl.sim.config import ClusterConfig, HardwareSpec

GiB = cost.GiB


class LayoutError(ConfigError):
    """The layout cannot run: a divisibility rule or a memory budget is violated."""


def resolve_arch(cluster: ClusterConfig, model_path: str) -> ModelArch:
    name = cluster.arch or model_path
    if name in PRESETS:
        return preset(name)
    candidate = name if name.endswith(".json") else os.path.join(name, "config.json")
    if os.path.isfile(candidate):
        return families.from_json(candidate)
    raise ConfigError(f"field 'cluster.arch': cannot find the model shape '{name}' (a preset: "
                      f"{', '.join(PRESETS)}, or an HF config.json / directory holding one)")


@dataclasses.dataclass
class Plan:
    """The planner's answer for one recipe."""

    arch_name: str
    world: int
    placement: str
    trainer_gpus: int
    tp: int
    pp: int
    dp: int
    micro_batches: int
    generator_gpus: int
    num_engines: int
    engine_tp: int
    engine_precision: str
    trainer_memory: dict[str, float]
    engine_memory: dict[str, float]
    usable_bytes: float
    times: dict[str, float]
    hardware: HardwareSpec
    sequences: int
    seq_len: int
    engine_batch: int

    def summary(self) -> dict:
        return {"world": self.world, "placement": self.placement, "trainer": {"gpus": self.trainer_gpus, "tp": self.tp,
                "pp": self.pp, "dp": self.dp}, "generator": {"gpus": self.generator_gpus, "engines": self.num_engines,
                "engine_tp": self.engine_tp, "precision": self.engine_precision},
                "trainer_memory_gib": {k: round(v / GiB, 2) for k, v in self.trainer_memory.items()},
                "engine_memory_gib": {k: round(v / GiB, 2) for k, v in self.engine_memory.items()},
                "times_s": {k: round(v, 3) for k, v in self.times.items()}}


def _fail(field: str, message: str) -> None:
    raise LayoutError(f"field '{field}': {message}", field=field, reason=message)


def make_plan(config, arch: ModelArch | None = None, *, arch_name: str | None = None) -> Plan:
    """Validate `config` (a RunConfig with a cluster section) and estimate its memory and times."""
    cluster: ClusterConfig = config.cluster
    hw = cluster.hardware_spec()
    arch = arch or resolve_arch(cluster, config.model.path)
    a = cluster.assumptions
    gen = cluster.generator
    world = cluster.nodes * hw.gpus_per_node
    tp, pp = config.trainer.parallel.tensor_parallel, config.trainer.parallel.pipeline_parallel
    placement = config.rollout.placement

    # --- layout rules ------------------------------------------------------------------------------
    if arch.num_query_groups % tp and tp % arch.num_query_groups:
        _fail("trainer.parallel.tensor_parallel", f"TP={tp} must divide the model's {arch.num_query_groups} KV heads")
    if arch.num_query_groups % tp:
        _fail("trainer.parallel.tensor_parallel", f"TP={tp} exceeds the model's {arch.num_query_groups} KV heads "
                                                   "(Megatron gives each TP rank whole query groups)")
    if tp > hw.gpus_per_node:
        _fail("trainer.parallel.tensor_parallel", f"TP={tp} spans nodes ({hw.gpus_per_node} GPUs per node); "
                                                   "keep TP inside NVLink")
    if arch.num_layers % pp:
        _fail("trainer.parallel.pipeline_parallel", f"PP={pp} does not divide the model's {arch.num_layers} layers")
    if placement == "disaggregated":
        if arch.num_attention_heads % gen.engine_tp or (arch.num_query_groups % gen.engine_tp
                                                         and gen.engine_tp % arch.num_query_groups):
            _fail("cluster.generator.engine_tp", f"engine TP={gen.engine_tp} must divide the {arch.num_attention_heads} "
                                                 f"query heads and divide or be a multiple of the {arch.num_query_groups} KV heads")
        if gen.engine_tp > hw.gpus_per_node:
            _fail("cluster.generator.engine_tp", f"engine TP={gen.engine_tp} spans nodes ({hw.gpus_per_node} GPUs per node)")
        generator_gpus = gen.num_engines * gen.engine_tp
        if generator_gpus % hw.gpus_per_node:
            _fail("cluster.generator.num_engines", f"{gen.num_engines} engines x TP {gen.engine_tp} = {generator_gpus} "
                                                   f"GPUs do not fill whole nodes of {hw.gpus_per_node}")
        num_engines, engine_tp, precision = gen.num_engines, gen.engine_tp, gen.precision
        if generator_gpus >= world:
            _fail("cluster.generator.num_engines", f"{gen.num_engines} engines x TP {gen.engine_tp} = {generator_gpus} "
                                                   f"GPUs leave none of the {world} for the trainer")
        trainer_gpus = world - generator_gpus
    else:
        generator_gpus = 0
        trainer_gpus = world
        num_engines, engine_tp, precision = world // (tp * pp), tp, cluster.baseline.precision
    if trainer_gpus % (tp * pp):
        _fail("trainer.parallel", f"the trainer's {trainer_gpus} GPUs are not a multiple of TP x PP = {tp} x {pp}"
              + (f" (world {world} minus {generator_gpus} generator GPUs)" if generator_gpus else ""))
    dp = trainer_gpus // (tp * pp)
    sequences = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    mbs = config.trainer.micro_batch_size
    if sequences % (dp * mbs):
        _fail("trainer.micro_batch_size", f"{sequences} rollouts per step (prompts_per_step x samples_per_prompt) do "
                                          f"not split into DP={dp} ranks x micro-batches of {mbs}")
    micro_batches = sequences // (dp * mbs)
    seq_len = a.prompt_tokens + config.rollout.max_new_tokens
    if seq_len > arch.max_position_embeddings:
        _fail("rollout.max_new_tokens", f"prompt ({a.prompt_tokens}) + max_new_tokens ({config.rollout.max_new_tokens}) "
                                        f"exceeds the model's context of {arch.max_position_embeddings}")

    # --- memory -----------------------------------------------------------------------------------
    precision_name = config.trainer.precision
    params_bytes = 4 if precision_name == "fp32" else 2
    layout = cost.TrainerLayout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, micro_batches=micro_batches,
                                seq_len=seq_len, params_bytes=params_bytes, recompute=config.trainer.recompute_activations,
                                distributed_optimizer=config.trainer.use_distributed_optimizer,
                                vocab_divisible_by=config.trainer.vocab_divisible_by)
    usable = hw.hbm_bytes * a.memory_fraction
    trainer_mem = cost.trainer_memory(arch, layout, a)
    if placement == "disaggregated":
        engine_batch = min(gen.max_running_requests, math.ceil(sequences / num_engines))
        engine_mem = cost.engine_memory(arch, engine_tp, precision, engine_batch, seq_len, a)
    else:  # colocated: the generator reuses the trainer's weights; its KV cache sits next to the training state
        engine_batch = min(cluster.baseline.generation_batch_per_engine, math.ceil(sequences / num_engines))
        engine_mem = {"kv_cache": engine_batch * seq_len * cost.kv_bytes_per_token(arch, a.kv_cache_dtype_bytes) / (tp * pp)}
        resident = {k: v for k, v in trainer_mem.items() if k in ("weights", "gradients", "optimizer")}
        _check_fits("colocated GPU during generation", {**resident, **engine_mem}, usable)
    _check_fits("trainer GPU", trainer_mem, usable)
    if placement == "disaggregated":
        _check_fits("generator GPU", engine_mem, usable)

    # --- time -------------------------------------------------------------------------------------
    tokens = sequences * (a.prompt_tokens + a.mean_response_fraction * config.rollout.max_new_tokens)
    fp8_train = config.trainer.fp8 != "none"
    train_s = cost.train_seconds(arch, tokens=tokens, gpus=trainer_gpus, pp=pp, micro_batches=micro_batches,
                                 recompute=config.trainer.recompute_activations, fp8=fp8_train, hw=hw, assumptions=a)
    if placement == "disaggregated":
        generation = cost.generation_seconds(
            arch, sequences=sequences, engines=num_engines, tp=engine_tp, precision=precision,
            max_new_tokens=config.rollout.max_new_tokens, batch_limit=engine_batch, static_batching=False,
            cuda_graphs=gen.cuda_graphs, hw=hw, assumptions=a)
        sync_s = cost.sync_seconds(arch, engines=num_engines, engine_tp=engine_tp, precision=precision,
                                   trainer_gpus=trainer_gpus, hw=hw, assumptions=a)
        overlapped = config.rollout.max_staleness >= 1
        step = (max(generation.seconds, train_s) if overlapped else generation.seconds + train_s) + sync_s
    else:
        generation = cost.generation_seconds(
            arch, sequences=sequences, engines=num_engines, tp=tp, pp=pp, precision=precision,
            max_new_tokens=config.rollout.max_new_tokens, batch_limit=engine_batch,
            static_batching=cluster.baseline.static_batching, cuda_graphs=cluster.baseline.cuda_graphs, hw=hw,
            assumptions=a)
        sync_s = 0.0  # the generator runs on the trainer's own weights
        step = generation.seconds + train_s
    times = {"generate": generation.seconds, "train": train_s, "weight_sync": sync_s, "step": step,
             "decode_step": generation.decode_step_s, "generation_waves": float(generation.waves)}
    return Plan(arch_name=arch_name or cluster.arch or config.model.path, world=world, placement=placement,
                trainer_gpus=trainer_gpus, tp=tp, pp=pp, dp=dp, micro_batches=micro_batches,
                generator_gpus=generator_gpus, num_engines=num_engines, engine_tp=engine_tp,
                engine_precision=precision, trainer_memory=trainer_mem, engine_memory=engine_mem, usable_bytes=usable,
                times=times, hardware=hw, sequences=sequences, seq_len=seq_len, engine_batch=generation.batch_per_engine)


def _check_fits(what: str, terms: dict[str, float], usable: float) -> None:
    total = sum(terms.values())
    if total <= usable:
        return
    largest = max(terms, key=terms.get)
    detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in terms.items())
    raise LayoutError(f"{what} needs {total / GiB:.1f} GiB but {usable / GiB:.1f} GiB is usable: '{largest}' "
                      f"overflows ({largest} alone {terms[largest] / GiB:.1f} GiB; terms in GiB: {detail}). "
                      + _advice(largest), field="cluster", reason=largest)


def _advice(term: str) -> str:
    return {
        "weights": "Raise TP/PP (trainer) or engine_tp, or use fp8 engines.",
        "gradients": "Raise TP or PP: gradients are sharded only by model parallelism.",
        "optimizer": "Set trainer.use_distributed_optimizer: true or raise DP.",
        "activations": "Set trainer.recompute_activations: true, lower micro_batch_size, or raise TP/PP.",
        "activation_buffers": "Lower micro_batch_size or rollout.max_new_tokens.",
        "kv_cache": "Lower cluster.generator.max_running_requests (or the colocated generation batch), or add engines.",
    }.get(term, "")


def format_plan(plan: Plan) -> str:
    hw = plan.hardware
    lines = [f"model {plan.arch_name} on {plan.world} x {hw.description or 'GPU'} "
             f"({plan.world // hw.gpus_per_node} nodes), placement {plan.placement}",
             f"trainer: {plan.trainer_gpus} GPUs = TP {plan.tp} x PP {plan.pp} x DP {plan.dp}; "
             f"{plan.sequences} sequences of <= {plan.seq_len} tokens, {plan.micro_batches} micro-batches per DP rank",
             (f"generator: {plan.num_engines} engines x TP {plan.engine_tp} = {plan.generator_gpus} GPUs, "
              f"{plan.engine_precision}, up to {plan.engine_batch} sequences per engine")
             if plan.placement == "disaggregated" else
             f"generator: colocated on the trainer's GPUs ({plan.num_engines} replicas of TP {plan.tp} x PP {plan.pp}, "
             f"{plan.engine_precision}, {plan.engine_batch} sequences per wave)",
             f"memory per GPU (usable {plan.usable_bytes / GiB:.1f} of {hw.hbm_gib:.0f} GiB):"]
    for title, terms in (("trainer", plan.trainer_memory), ("generator", plan.engine_memory)):
        body = ", ".join(f"{k} {v / GiB:.2f}" for k, v in terms.items())
        lines.append(f"  {title:9s} {sum(terms.values()) / GiB:7.2f} GiB  ({body})")
    t = plan.times
    lines.append(f"predicted step: generate {t['generate']:.1f} s ({t['generation_waves']:.0f} wave(s), "
                 f"{t['decode_step'] * 1e3:.1f} ms per decode step), train {t['train']:.1f} s, "
                 f"weight sync {t['weight_sync']:.2f} s -> step {t['step']:.1f} s")
    return "\n".join(lines)
