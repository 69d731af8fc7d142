"""`megatron-rl plan CONFIG.yaml`: validate a cluster layout and predict memory and step time, no GPU.

Checks, in order, each failing with a message that names the field: the world (nodes x GPUs per node)
splits into the generator group and a trainer whose TP x PP divides it; TP divides the KV heads and
fits in a node; PP divides the layers (or Megatron's uneven split does); the engines' TP fits the heads and
whole nodes (SGLang servers over several nodes when it exceeds one); the global batch
splits into whole micro-batches per data-parallel rank. Then memory per GPU, term by term, for a
trainer rank and an engine GPU; a term that overflows the usable memory is named in the error. Last,
the predicted times of generation, training and weight sync, and the step under the configured
placement (colocated: the sum; disaggregated: the overlap of generation with training, plus sync).

Mixture-of-experts models add the expert layout (`trainer.parallel.expert_parallel`, megatron-core's
`expert_model_parallel_size`; the experts' tensor-parallel size ETP is the trainer's TP): EP divides the
experts, ETP the expert width, and ETP x EP x PP divides the trainer's GPUs (the quotient is the expert
data-parallel group; parallel_state.initialize_model_parallel's rule). `search_expert_parallel` plans
every EP that divides and reports which fit.
"""
from __future__ import annotations

import dataclasses
import math
import os

from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.arch import PRESETS, ModelArch, preset
from megatron_rl.models.megatron_layout import pipeline_stage_layers
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
    arch: ModelArch | None = None
    ep: int = 1
    """Expert-parallel size (1 for dense models)."""
    etp: int = 1
    """Expert tensor-parallel size."""
    expert_dp: int = 1
    """Expert data-parallel size: trainer GPUs / (ETP x EP x PP)."""
    stage_layers: tuple[int, ...] = ()
    """Layers per pipeline stage."""

    @property
    def uneven_stages(self) -> bool:
        return len(set(self.stage_layers)) > 1

    def summary(self) -> dict:
        trainer = {"gpus": self.trainer_gpus, "tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.uneven_stages:
            trainer["stage_layers"] = list(self.stage_layers)
        if self.arch is not None and self.arch.is_moe:
            trainer.update(ep=self.ep, etp=self.etp, expert_dp=self.expert_dp)
        return {"world": self.world, "placement": self.placement, "trainer": trainer,
                "generator": {"gpus": self.generator_gpus, "engines": self.num_engines,
                "engine_tp": self.engine_tp, "precision": self.engine_precision},
                "trainer_memory_gib": {k: round(v / GiB, 2) for k, v in self.trainer_memory.items()},
                "engine_memory_gib": {k: round(v / GiB, 2) for k, v in self.engine_memory.items()},
                "times_s": {k: round(v, 3) for k, v in self.times.items()}}


def _fail(field: str, message: str) -> None:
    raise LayoutError(f"field '{field}': {message}", field=field, reason=message)


def expert_layout(config, expert_parallel: int | None = None) -> tuple[int, int]:
    """(EP, ETP) of the trainer: `expert_parallel` if given, else trainer.parallel.expert_parallel; the
    trainer keeps TP as the experts' tensor-parallel size (Megatron's default)."""
    parallel = config.trainer.parallel
    return (parallel.expert_parallel if expert_parallel is None else expert_parallel), parallel.tensor_parallel


def expert_parallel_candidates(arch: ModelArch, trainer_gpus: int, pp: int, etp: int) -> list[int]:
    """Every EP Megatron accepts: it divides the experts and ETP x EP x PP divides the trainer's GPUs."""
    if not arch.is_moe:
        return [1]
    return [ep for ep in range(1, arch.num_experts + 1)
            if arch.num_experts % ep == 0 and trainer_gpus % (etp * ep * pp) == 0]


def make_plan(config, arch: ModelArch | None = None, *, arch_name: str | None = None,
              expert_parallel: int | None = None) -> Plan:
    """Validate `config` (a RunConfig with a cluster section) and estimate its memory and times;
    `expert_parallel` replaces the config's EP (the search)."""
    cluster: ClusterConfig = config.cluster
    hw = cluster.hardware_spec()
    arch = arch or resolve_arch(cluster, config.model.path)
    a = cluster.assumptions
    gen = cluster.generator
    world = cluster.nodes * hw.gpus_per_node
    tp, pp = config.trainer.parallel.tensor_parallel, config.trainer.parallel.pipeline_parallel
    split = (config.trainer.parallel.first_stage_layers, config.trainer.parallel.last_stage_layers)
    ep, etp = expert_layout(config, expert_parallel)
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
    try:
        stage_layers = pipeline_stage_layers(arch.num_layers, pp, *split)
    except ConfigError as exc:
        if split == (None, None):
            _fail("trainer.parallel.pipeline_parallel", f"PP={pp} does not divide the model's {arch.num_layers} layers "
                                                        "(or set trainer.parallel.first_stage_layers / last_stage_layers)")
        _fail(exc.field or "trainer.parallel", str(exc))
    if placement == "disaggregated":
        if arch.num_attention_heads % gen.engine_tp or (arch.num_query_groups % gen.engine_tp
                                                         and gen.engine_tp % arch.num_query_groups):
            _fail("cluster.generator.engine_tp", f"engine TP={gen.engine_tp} must divide the {arch.num_attention_heads} "
                                                 f"query heads and divide or be a multiple of the {arch.num_query_groups} KV heads")
        if gen.engine_tp > hw.gpus_per_node:  # one server over whole nodes (SGLang's --nnodes)
            if gen.engine_tp % hw.gpus_per_node:
                _fail("cluster.generator.engine_tp", f"engine TP={gen.engine_tp} spans nodes ({hw.gpus_per_node} GPUs "
                                                     "per node) without filling whole ones")
            if gen.backend == "vllm":
                _fail("cluster.generator.engine_tp", f"engine TP={gen.engine_tp} spans nodes ({hw.gpus_per_node} GPUs "
                                                     "per node): the launcher starts multi-node engines with SGLang "
                                                     "(backend sglang), not vLLM")
        if arch.is_moe:
            _check_engine_experts(arch, gen.engine_tp, gen.precision)
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
    _check_expert_layout(arch, trainer_gpus, tp, pp, ep, etp)
    expert_dp = trainer_gpus // (etp * ep * pp) if arch.is_moe else dp
    if placement != "disaggregated" and arch.is_moe:  # a colocated replica spans its EP group: every expert
        num_engines = world // (tp * pp * ep)
    sequences = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
    seq_len = a.prompt_tokens + config.rollout.max_new_tokens
    budget = config.trainer.max_tokens_per_micro_batch
    if budget:  # packed micro-batches of up to `budget` tokens; the worst case: every row at full length
        mbs = max(1, budget // seq_len)
        micro_batches = math.ceil(sequences / (dp * mbs))
    else:
        mbs = config.trainer.micro_batch_size
        if sequences % (dp * mbs):
            _fail("trainer.micro_batch_size", f"{sequences} rollouts per step (prompts_per_step x samples_per_prompt) "
                                              f"do not split into DP={dp} ranks x micro-batches of {mbs}")
        micro_batches = sequences // (dp * mbs)
    if seq_len > arch.max_position_embeddings:
        _fail("rollout.max_new_tokens", f"prompt ({a.prompt_tokens}) + max_new_tokens ({config.rollout.max_new_tokens}) "
                                        f"exceeds the model's context of {arch.max_position_embeddings}")

    # --- memory -----------------------------------------------------------------------------------
    precision_name = config.trainer.precision
    params_bytes = 4 if precision_name == "fp32" else 2
    layout = cost.TrainerLayout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, micro_batches=micro_batches,
                                seq_len=seq_len, params_bytes=params_bytes, recompute=config.trainer.recompute_activations,
                                distributed_optimizer=config.trainer.use_distributed_optimizer,
                                vocab_divisible_by=config.trainer.vocab_divisible_by, ep=ep, etp=etp,
                                lora_rank=config.trainer.lora.rank, lora_targets=tuple(config.trainer.lora.targets),
                                split=split)
    usable = hw.hbm_bytes * a.memory_fraction
    trainer_mem = cost.trainer_memory(arch, layout, a)
    trainer_hint = _expert_parallel_hint(arch, layout, a, trainer_gpus, usable) if arch.is_moe else ""
    if placement == "disaggregated":
        engine_batch = min(gen.max_running_requests, math.ceil(sequences / num_engines))
        engine_mem = cost.engine_memory(arch, engine_tp, precision, engine_batch, seq_len, a)
    else:  # colocated: the generator reuses the trainer's weights; its KV cache sits next to the training state
        engine_batch = min(cluster.baseline.generation_batch_per_engine, math.ceil(sequences / num_engines))
        engine_mem = {"kv_cache": engine_batch * cost.kv_bytes_per_sequence(arch, seq_len, a.kv_cache_dtype_bytes)
                      / (tp * pp * (ep if arch.is_moe else 1))}
        resident = {k: v for k, v in trainer_mem.items() if k in RESIDENT_TERMS}
        _check_fits("colocated GPU during generation", {**resident, **engine_mem}, usable)
    _check_fits("trainer GPU", trainer_mem, usable, trainer_hint)
    if placement == "disaggregated":
        _check_fits("generator GPU", engine_mem, usable)

    # --- time -------------------------------------------------------------------------------------
    tokens = sequences * (a.prompt_tokens + a.mean_response_fraction * config.rollout.max_new_tokens)
    fp8_train = config.trainer.fp8 != "none"
    train_s = cost.train_seconds(arch, tokens=tokens, gpus=trainer_gpus, pp=pp, micro_batches=micro_batches,
                                 recompute=config.trainer.recompute_activations, fp8=fp8_train, hw=hw, assumptions=a,
                                 tp=tp, ep=ep, etp=etp, micro_batch_tokens=mbs * seq_len, split=split)
    if placement == "disaggregated":
        generation = cost.generation_seconds(
            arch, sequences=sequences, engines=num_engines, tp=engine_tp, precision=precision,
            max_new_tokens=config.rollout.max_new_tokens, batch_limit=engine_batch, static_batching=False,
            cuda_graphs=gen.cuda_graphs, hw=hw, assumptions=a)
        sync_s = cost.sync_seconds(arch, engines=num_engines, engine_tp=engine_tp, precision=precision,
                                   trainer_gpus=trainer_gpus, hw=hw, assumptions=a)
        overlapped = config.rollout.is_async
        step = (max(generation.seconds, train_s) if overlapped else generation.seconds + train_s) + sync_s
    else:
        replica_tp = tp * (ep if arch.is_moe else 1)  # an MoE replica's EP ranks split its weights like TP
        generation = cost.generation_seconds(
            arch, sequences=sequences, engines=num_engines, tp=replica_tp, pp=pp, precision=precision,
            max_new_tokens=config.rollout.max_new_tokens, batch_limit=engine_batch,
            static_batching=cluster.baseline.static_batching, cuda_graphs=cluster.baseline.cuda_graphs, hw=hw,
            assumptions=a)
        sync_s = 0.0  # the generator runs on the trainer's own weights
        step = generation.seconds + train_s
    times = {"generate": generation.seconds, "train": train_s, "weight_sync": sync_s, "step": step,
             "decode_step": generation.decode_step_s, "generation_waves": float(generation.waves)}
    if arch.is_moe:
        times["train_alltoall"] = cost.train_alltoall_seconds(
            arch, pp=pp, micro_batches=micro_batches, recompute=config.trainer.recompute_activations, hw=hw,
            assumptions=a, tp=tp, ep=ep, etp=etp, micro_batch_tokens=mbs * seq_len, split=split)
    return Plan(arch_name=arch_name or cluster.arch or config.model.path, world=world, placement=placement,
                trainer_gpus=trainer_gpus, tp=tp, pp=pp, dp=dp, micro_batches=micro_batches,
                generator_gpus=generator_gpus, num_engines=num_engines, engine_tp=engine_tp,
                engine_precision=precision, trainer_memory=trainer_mem, engine_memory=engine_mem, usable_bytes=usable,
                times=times, hardware=hw, sequences=sequences, seq_len=seq_len, engine_batch=generation.batch_per_engine,
                arch=arch, ep=ep if arch.is_moe else 1, etp=etp if arch.is_moe else 1, expert_dp=expert_dp,
                stage_layers=stage_layers)


RESIDENT_TERMS = ("weights", "gradients", "optimizer", "expert_weights", "expert_gradients", "expert_optimizer")
"""Trainer memory that stays allocated while a colocated generator runs (activations are freed)."""


def _check_expert_layout(arch: ModelArch, trainer_gpus: int, tp: int, pp: int, ep: int, etp: int) -> None:
    if not arch.is_moe:
        if ep != 1:
            _fail("trainer.parallel.expert_parallel", f"EP={ep} needs a mixture-of-experts model; this one is dense")
        return
    if ep < 1 or arch.num_experts % ep:
        _fail("trainer.parallel.expert_parallel", f"EP={ep} does not divide the model's {arch.num_experts} experts")
    if arch.moe_ffn_hidden_size % etp:
        _fail("trainer.parallel.tensor_parallel", f"ETP={etp} does not divide the experts' width "
                                                          f"{arch.moe_ffn_hidden_size}")
    if trainer_gpus % (etp * ep * pp):
        _fail("trainer.parallel.expert_parallel", f"the trainer's {trainer_gpus} GPUs are not a multiple of "
                                                  f"ETP x EP x PP = {etp} x {ep} x {pp} (Megatron's expert layout)")


def _check_engine_experts(arch: ModelArch, engine_tp: int, precision: str) -> None:
    """SGLang splits every expert's width over the engine's TP; block-fp8 weights need each GPU's slice to be
    whole 128-wide blocks (its fp8 MoE method refuses other shapes at load)."""
    width = arch.moe_ffn_hidden_size
    if width % engine_tp:
        _fail("cluster.generator.engine_tp", f"engine TP={engine_tp} does not divide the experts' width {width}")
    if precision == "fp8" and (width // engine_tp) % 128:
        _fail("cluster.generator.engine_tp", f"engine TP={engine_tp} leaves {width // engine_tp} of each expert's "
                                             f"{width} columns per GPU, not whole 128-wide fp8 blocks")


def _expert_parallel_hint(arch: ModelArch, layout: cost.TrainerLayout, a, trainer_gpus: int, usable: float) -> str:
    """When the trainer does not fit: the smallest valid EP with which it would."""
    for ep in expert_parallel_candidates(arch, trainer_gpus, layout.pp, layout.expert_tp):
        if ep > layout.ep:
            candidate = dataclasses.replace(layout, ep=ep)
            if sum(cost.trainer_memory(arch, candidate, a).values()) <= usable:
                return f" With trainer.parallel.expert_parallel={ep} the trainer fits."
    return ""


@dataclasses.dataclass
class ExpertParallelOption:
    """One EP the search tried: its plan, or why it cannot run."""

    ep: int
    plan: Plan | None
    error: str | None


def search_expert_parallel(config, arch: ModelArch | None = None) -> list[ExpertParallelOption]:
    """Plan every EP Megatron accepts for this trainer (MoE models); one option per EP."""
    arch = arch or resolve_arch(config.cluster, config.model.path)
    if not arch.is_moe:
        return [ExpertParallelOption(1, make_plan(config, arch, expert_parallel=1), None)]
    hw = config.cluster.hardware_spec()
    world = config.cluster.nodes * hw.gpus_per_node
    gen = config.cluster.generator
    generator_gpus = gen.num_engines * gen.engine_tp if config.rollout.placement == "disaggregated" else 0
    _, etp = expert_layout(config)
    options = []
    for ep in expert_parallel_candidates(arch, world - generator_gpus, config.trainer.parallel.pipeline_parallel, etp):
        try:
            options.append(ExpertParallelOption(ep, make_plan(config, arch, expert_parallel=ep), None))
        except LayoutError as exc:
            options.append(ExpertParallelOption(ep, None, f"'{exc.reason}' overflows" if exc.field == "cluster"
                                                else str(exc)))
    return options


def best_expert_parallel(options: list[ExpertParallelOption]) -> ExpertParallelOption | None:
    """The option with the shortest step that fits; on a tie (a generation-bound step) the shorter train
    time, then the smaller EP."""
    fitting = [o for o in options if o.plan is not None]
    return min(fitting, key=lambda o: (round(o.plan.times["step"], 6), round(o.plan.times["train"], 6), o.ep),
               default=None)


def _check_fits(what: str, terms: dict[str, float], usable: float, hint: str = "") -> None:
    total = sum(terms.values())
    if total <= usable:
        return
    largest = max(terms, key=terms.get)
    detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in terms.items())
    raise LayoutError(f"{what} needs {total / GiB:.1f} GiB but {usable / GiB:.1f} GiB is usable: '{largest}' "
                      f"overflows ({largest} alone {terms[largest] / GiB:.1f} GiB; terms in GiB: {detail}). "
                      + _advice(largest) + hint, field="cluster", reason=largest)


def _advice(term: str) -> str:
    return {
        "weights": "Raise TP/PP (trainer) or engine_tp, or use fp8 engines.",
        "gradients": "Raise TP or PP: gradients are sharded only by model parallelism.",
        "optimizer": "Set trainer.use_distributed_optimizer: true or raise DP.",
        "activations": "Set trainer.recompute_activations: true, lower micro_batch_size, or raise TP/PP.",
        "activation_buffers": "Lower micro_batch_size or rollout.max_new_tokens.",
        "kv_cache": "Lower cluster.generator.max_running_requests (or the colocated generation batch), or add engines.",
        "expert_weights": "Raise trainer.parallel.expert_parallel (experts are split over EP x ETP), or engine_tp "
                          "or fp8 for engines.",
        "expert_gradients": "Raise trainer.parallel.expert_parallel: expert gradients are split over EP x ETP only.",
        "expert_optimizer": "Set trainer.use_distributed_optimizer: true, raise EP, or add trainer GPUs (expert "
                            "states are sharded over the expert data-parallel group).",
        "routed_tokens": "Set trainer.recompute_activations: true or lower micro_batch_size (or moe_imbalance).",
    }.get(term, "")


def format_plan(plan: Plan) -> str:
    hw = plan.hardware
    moe = plan.arch is not None and plan.arch.is_moe
    experts = (f"; experts: EP {plan.ep} x ETP {plan.etp} x expert-DP {plan.expert_dp} "
               f"({plan.arch.num_experts // plan.ep} of {plan.arch.num_experts} experts per GPU)") if moe else ""
    lines = [(f"model {plan.arch_name} on {plan.world} x {hw.description or 'GPU'} "
              f"({plan.world // hw.gpus_per_node} nodes), placement {plan.placement}")]
    if moe:
        arch = plan.arch
        lines.append(f"mixture of experts: {arch.num_parameters() / 1e9:.2f}B parameters "
                     f"({cost.expert_parameters(arch) / 1e9:.2f}B in {arch.num_layers} x {arch.num_experts} experts), "
                     f"{cost.active_parameters(arch) / 1e9:.2f}B active per token (top-{arch.moe_top_k})")
    stages = ""
    if plan.uneven_stages:
        counts = plan.stage_layers
        stages = f" (layers per stage: {counts[0]}, {len(counts) - 2} x {counts[1]}, {counts[-1]})" if len(
            set(counts[1:-1])) == 1 and len(counts) > 2 else f" (layers per stage: {', '.join(map(str, counts))})"
    lines += [(f"trainer: {plan.trainer_gpus} GPUs = TP {plan.tp} x PP {plan.pp}{stages} x DP {plan.dp}{experts}; "
               f"{plan.sequences} sequences of <= {plan.seq_len} tokens, {plan.micro_batches} micro-batches per DP rank"),
             (f"generator: {plan.num_engines} engines x TP {plan.engine_tp} = {plan.generator_gpus} GPUs, "
              f"{plan.engine_precision}, up to {plan.engine_batch} sequences per engine")
             if plan.placement == "disaggregated" else
             f"generator: colocated on the trainer's GPUs ({plan.num_engines} replicas of TP {plan.tp} x PP {plan.pp}"
             f"{f' x EP {plan.ep}' if moe else ''}, "
             f"{plan.engine_precision}, {plan.engine_batch} sequences per wave)",
             f"memory per GPU (usable {plan.usable_bytes / GiB:.1f} of {hw.hbm_gib:.0f} GiB):"]
    for title, terms in (("trainer", plan.trainer_memory), ("generator", plan.engine_memory)):
        body = ", ".join(f"{k} {v / GiB:.2f}" for k, v in terms.items())
        lines.append(f"  {title:9s} {sum(terms.values()) / GiB:7.2f} GiB  ({body})")
    t = plan.times
    alltoall = f" (expert all-to-all {t['train_alltoall']:.1f} s of it)" if "train_alltoall" in t else ""
    lines.append(f"predicted step: generate {t['generate']:.1f} s ({t['generation_waves']:.0f} wave(s), "
                 f"{t['decode_step'] * 1e3:.1f} ms per decode step), train {t['train']:.1f} s{alltoall}, "
                 f"weight sync {t['weight_sync']:.2f} s -> step {t['step']:.1f} s")
    return "\n".join(lines)


def format_expert_parallel(options: list[ExpertParallelOption], configured: int) -> str:
    """The EP search as one line per option: trainer memory per GPU and step time, or why it cannot run."""
    best = best_expert_parallel(options)
    lines = ["expert-parallel search (every EP that divides the experts and the trainer's GPUs):"]
    for option in options:
        marks = [m for m, on in (("configured", option.ep == configured),
                                 ("best", best is not None and option.ep == best.ep)) if on]
        if option.plan is None:
            body = f"does not fit: {option.error}"
        else:
            memory = sum(option.plan.trainer_memory.values()) / GiB
            t = option.plan.times
            body = f"trainer {memory:6.2f} GiB per GPU, train {t['train']:.1f} s, step {t['step']:.1f} s"
        lines.append(f"  EP {option.ep:3d}: {body}" + (f"  <- {', '.join(marks)}" if marks else ""))
    return "\n".join(lines)
