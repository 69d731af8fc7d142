"""`megatron-rl eval [CONFIG.yaml] [overrides]`: held-out accuracy (greedy, mean@k) or likelihood of a model."""
from __future__ import annotations

import argparse
import json

from megatron_rl.config import ConfigError
from megatron_rl.controller.evaluate import evaluate
from megatron_rl.controller.objectives import make_objective
from megatron_rl.data.sources import build_datasets
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.recipes.jepo.likelihood import evaluate_likelihood
from megatron_rl.rewards.registry import Reward
from megatron_rl.rollout.config import MAX_TEMPERATURE
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.run_config import load_run_config
from megatron_rl.trainer.trainer import MegatronTrainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML recipe (its data, reward and eval sections are used)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides; model.path=DIR evaluates a checkpoint "
                                                     "(e.g. RUN_DIR/checkpoints/step_00000020/model)")
    parser.add_argument("--samples", type=int, default=1, help="k > 1 reports mean@k at --temperature")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature for mean@k")
    parser.add_argument("--metric", choices=["accuracy", "likelihood"], action="append",
                        help="accuracy (default): greedy accuracy with the reward; likelihood: held-out proxy "
                             "NLL of the references with the n-sample bound (eval.likelihood.*). Repeatable")


def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {args.samples}")
    if not 0 <= args.temperature <= MAX_TEMPERATURE:  # also refuses nan and inf
        raise ConfigError(f"--temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {args.temperature}")
    config = load_run_config(args.config, args.overrides)
    model = load_pretrained(config.model.path)
    _, heldout = build_datasets(config.data)
    reward = Reward(config.reward)
    metrics = args.metric or ["accuracy"]
    if "likelihood" in metrics:
        # the objective's reference budget applies to evaluation too (skip or error, as configured)

        objective = make_objective(config, model.tokenizer, model)
        if hasattr(objective, "filter_prompts"):
            heldout = objective.filter_prompts(heldout, "heldout")
    with NativeEngine(model.arch, model.state, tokenizer=model.tokenizer, config=config.engine) as engine:
        result = {"model": config.model.path, "heldout_size": len(heldout)}
        if "likelihood" in metrics:
            scorer = MegatronTrainer(model.arch, config.trainer, hf_state=model.state, frozen=True)
            result.update(evaluate_likelihood(engine, scorer, model.tokenizer, list(heldout),
                                              config.eval.likelihood, seed=config.seed))
        if "accuracy" in metrics:
            greedy = evaluate(engine, model.tokenizer, list(heldout), reward,
                              max_new_tokens=config.eval.max_new_tokens, progress=True)
            result["accuracy_greedy"] = greedy["accuracy"]
        if "accuracy" in metrics and args.samples > 1:
            sampled = evaluate(engine, model.tokenizer, list(heldout), reward, max_new_tokens=config.eval.max_new_tokens,
                               samples=args.samples, temperature=args.temperature, seed=config.seed, progress=True)
            result[f"mean_at_{args.samples}"] = sampled["accuracy"]
    print(json.dumps(result))
    return 0
