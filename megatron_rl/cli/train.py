"""`megatron-rl train CONFIG.yaml [overrides] [--resume | --fresh]`.

Without a flag a run starts in an empty (or new) run directory, resumes one holding this run's checkpoints
(a relaunch after a crash, a requeued job), starts over where this run died before its first checkpoint,
and refuses another experiment's directory (its config differs: the first differing field is named) or a
config.json no run wrote; `--resume` continues the latest checkpoint, also under a changed config;
`--fresh` moves the run's own files aside (never the user's) and starts over (docs/bad_input.md).
SIGTERM / SIGUSR1 (or a STOP file in the run directory) checkpoint at the next step boundary and exit 0.
A recipe with `objective: reward_model` trains a reward model on preference pairs instead (recipes/reward_model)."""
from __future__ import annotations

import argparse
import json
import os

from megatron_rl.checkpoint.manager import CheckpointManager
from megatron_rl.checkpoints_tools.convert import save_hf
from megatron_rl.config import ConfigError, from_dict, load_yaml_data, split_config_and_overrides, to_dict
from megatron_rl.controller.loop import train
from megatron_rl.controller.recipe import recipe_name
from megatron_rl.data.sources import build_datasets
from megatron_rl.observability.run_log import prepare_run_dir
from megatron_rl.recipes.agent.recipe import agent_datasets
from megatron_rl.recipes.reward_model.config import RewardModelRunConfig
from megatron_rl.recipes.reward_model.data import load_pairs
from megatron_rl.recipes.reward_model.recipe import latest_checkpoint, refuse_used_run_dir, train_reward_model
from megatron_rl.rollout.vllm_engine import vllm_python
from megatron_rl.run_config import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML recipe, e.g. examples/configs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-6 run_dir=runs/x")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument("--check", action="store_true",
                        help="validate the recipe, its data files and the run directory, then exit (no model is "
                             "loaded, nothing is written); prints one JSON line")
    parser.add_argument("--fresh", action="store_true",
                        help="start over in a run directory that holds a previous run, moving its files to "
                             "RUN_DIR/previous_runs/<time>/ (nothing is deleted)")


def run(args: argparse.Namespace) -> int:
    path, overrides = split_config_and_overrides(args.config, args.overrides)
    data, source = load_yaml_data(path, overrides)
    if data.get("objective") == "reward_model":  # not RL: Bradley-Terry training on preference pairs
        return train_reward_model_command(from_dict(RewardModelRunConfig, data, source), args)
    config = from_dict(RunConfig, data, source)  # what load_run_config does, without reading the file again
    if args.check:
        return check(config, resume=args.resume, fresh=args.fresh)
    summary = train(config, resume=args.resume, fresh=args.fresh)  # every rank of a torchrun / srun launch runs it
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"accuracy_before": summary.accuracy_before, "accuracy_after": summary.accuracy_after,
                          "wall_time_s": round(summary.wall_time_s, 1), "run_dir": config.run_dir}))
    return 0


def train_reward_model_command(config: RewardModelRunConfig, args: argparse.Namespace) -> int:
    """`objective: reward_model` (recipes/reward_model): one process; `--resume` continues its latest
    checkpoint."""
    if args.fresh:
        raise ConfigError("--fresh: reward-model training does not move a previous run aside; give it a new "
                          "run_dir (or --resume the one there)", field="run_dir")
    if args.check:
        if args.resume:
            latest_checkpoint(config)
        else:
            refuse_used_run_dir(config.run_dir)
        train_pairs = load_pairs(config.data.train)
        heldout = load_pairs(config.data.heldout, "data.heldout") if config.data.heldout else []
        print(json.dumps({"check": "ok", "objective": "reward_model", "train_pairs": len(train_pairs),
                          "heldout_pairs": len(heldout), "run_dir": config.run_dir}))
        return 0
    summary = train_reward_model(config, export=save_hf, resume=args.resume)  # on every rank of a launch
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"pairwise_accuracy_before": summary.accuracy_before,
                          "pairwise_accuracy_after": summary.accuracy_after, "export": summary.export,
                          "wall_time_s": round(summary.wall_time_s, 1), "run_dir": config.run_dir}))
    return 0


def check(config: RunConfig, *, resume: bool, fresh: bool) -> int:
    """What `train` refuses before its slow set-up, without its side effects: the config, every data
    row, and the run directory (previous run, checkpoint to resume)."""
    if recipe_name(config) == "agent" and not config.agent.openai_agent:
        train_set, heldout = agent_datasets(config.agent)  # the agent's task or its environment library's
    else:
        train_set, heldout = build_datasets(config.data)
    generator = config.cluster.generator
    if generator.backend == "vllm" and not generator.urls:
        vllm_python(generator.vllm_python)  # the environment the run would launch its servers from
    manager = CheckpointManager(config.run_dir, config.checkpoint)
    requested = resume
    resume = resume or (not fresh and manager.resumable())  # as train: a relaunch resumes
    latest = manager.latest() if resume else None
    prepare_run_dir(config.run_dir, resume=resume, fresh=fresh, checkpoint=latest, config=to_dict(config),
                    move=False, requested=requested, keep=config.data.files())
    print(json.dumps({"check": "ok", "train_prompts": len(train_set), "heldout_prompts": len(heldout),
                      "train_stats": train_set.stats, "resume_from": latest, "run_dir": config.run_dir}))
    return 0
