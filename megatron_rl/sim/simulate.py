"""`megatron-rl bench sim`: predicted RL step of a colocated synchronous system (DeepSpeed-Chat-like)
against LlamaRL's asynchronous disaggregated design, at the paper's 8B, 70B and 405B settings.

Both systems are priced by the planner's cost model (sim/cost.py) on the same recipe
(examples/configs/llama3_{8b,70b,405b}.yaml), so the comparison shares every assumption:

- colocated, synchronous: all GPUs train with the recipe's TP x PP; generation reuses the trainer's
  model in inference mode on the same GPUs: bf16 weights, the trainer's TP x PP per replica (a
  token crosses the pipeline stages one after another), eager kernels, static waves of
  `baseline.generation_batch_per_engine` sequences that each run to max_new_tokens; the step is
  generation + training (the generator reads the trainer's weights: no sync).
- asynchronous, disaggregated (LlamaRL): the generator group (fp8 engines, small TP, CUDA graphs,
  continuous batching) on its own GPUs, the trainer on the rest with the same TP x PP; generation of
  step k+1 overlaps training of step k, so the step is max(generate, train) + the weight sync (DDMA).

LlamaRL's theory (docs/algorithms.md section 2): generation G(N) = a/N + b with a decode latency floor b,
training T(N) = c/N; the asynchronous step beats (a + c)/N + b because the floor is paid in parallel
with training and because small-TP fp8 engines lower b itself.
"""
from __future__ import annotations

import logging
import os

from megatron_rl.run_config import load_run_config
from megatron_rl.sim.planner import LayoutError, make_plan

log = logging.getLogger(__name__)

PAPER_SPEEDUPS = {"8b": 2.52, "70b": 3.98, "405b": 10.7}
"""LlamaRL (arXiv 2505.24034) reported step-time speed-ups over a DeepSpeed-Chat-like system."""


def recipes_dir() -> str:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(here, "examples", "configs")


def simulate_recipe(path: str, overrides: list[str] | None = None) -> dict:
    """Plan the recipe as written (asynchronous) and as the colocated synchronous baseline."""
    overrides = list(overrides or [])
    config = load_run_config(path, overrides)
    asynchronous = make_plan(config)
    colocated = make_plan(load_run_config(path, overrides + [
        "rollout.placement=colocated", "rollout.max_staleness=0"]))
    return {"async": asynchronous, "colocated": colocated,
            "speedup": colocated.times["step"] / asynchronous.times["step"]}


def best_split(path: str, overrides: list[str] | None = None) -> tuple[int, float] | None:
    """The theory's min over N_g + N_t = N of the asynchronous step: try every whole-node generator group
    of the recipe's engine TP; returns (generator GPUs, step seconds) of the fastest layout that fits."""
    base = load_run_config(path, list(overrides or []))
    per_node = base.cluster.hardware_spec().gpus_per_node
    best = None
    for nodes in range(1, base.cluster.nodes):
        engines = nodes * per_node // base.cluster.generator.engine_tp
        try:
            plan = make_plan(load_run_config(path, list(overrides or []) + [
                f"cluster.generator.num_engines={engines}"]))
        except LayoutError:
            continue
        if best is None or plan.times["step"] < best[1]:
            best = (plan.generator_gpus, plan.times["step"])
    return best


def bench_sim(options: dict) -> dict:
    directory = str(options.get("recipes", recipes_dir()))
    overrides = [f"{k}={v}" for k, v in options.items() if "." in k]
    result: dict = {}
    errors = []
    log.info(f"{'model':6s} {'GPUs':>5s} | {'colocated sync: gen + train = step':>36s} | "
             f"{'async: max(gen, train) + sync = step':>40s} | predicted  paper  rel.err")
    for size, paper in PAPER_SPEEDUPS.items():
        sim = simulate_recipe(os.path.join(directory, f"llama3_{size}.yaml"), overrides)
        c, a = sim["colocated"].times, sim["async"].times
        error = (sim["speedup"] - paper) / paper
        errors.append(abs(error))
        log.info(f"{size:6s} {sim['async'].world:5d} | {c['generate']:9.1f} + {c['train']:6.1f} = {c['step']:7.1f} s "
                 f"({c['generation_waves']:.0f} waves) | max({a['generate']:7.1f}, {a['train']:6.1f}) + {a['weight_sync']:4.2f}"
                 f" = {a['step']:6.1f} s | {sim['speedup']:8.2f}x {paper:6.2f}x {error:+7.1%}")
        split = best_split(os.path.join(directory, f"llama3_{size}.yaml"), overrides)
        if split:
            log.info(f"{'':6s} theory's best split for this recipe: {split[0]} generator GPUs, step {split[1]:.1f} s "
                     f"({c['step'] / split[1]:.2f}x over colocated)")
        result[size] = {"speedup": round(sim["speedup"], 3), "paper": paper, "rel_error": round(error, 4),
                        "best_split_generator_gpus": split[0] if split else None,
                        "best_split_speedup": round(c["step"] / split[1], 3) if split else None,
                        "colocated_step_s": round(c["step"], 2), "async_step_s": round(a["step"], 2),
                        "colocated": {k: round(v, 3) for k, v in c.items()},
                        "async": {k: round(v, 3) for k, v in a.items()}}
    return {"ratio": round(result["405b"]["speedup"], 3), "max_rel_error": round(max(errors), 4), **result}
