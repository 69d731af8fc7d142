"""Wiring of a WaltzRL run into the one Controller: the feedback policy (its own Megatron trainer and
rollout engine), the episode producer, the two-stage schedule and the safety evaluation."""
from __future__ import annotations

import dataclasses
import os

from megatron_rl.algorithms.waltz import training_stage
from megatron_rl.controller.objectives import PolicyGradientObjective
from megatron_rl.recipes.waltz.episodes import WaltzEpisodes, evaluate_waltz
from megatron_rl.recipes.waltz.data import build_safety_datasets
from megatron_rl.recipes.waltz.judge import build_judge
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.trainer.trainer import MegatronTrainer


def setup_waltz(controller, config, model):
    """Add the feedback policy to `controller` and return (train, heldout, episode producer)."""
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.controller.loop import PolicyExecutor, make_engine

    waltz = config.waltz
    feedback_model = model if waltz.feedback_model in (None, config.model.path) else load_pretrained(waltz.feedback_model)
    trainer_config = waltz.feedback_trainer or dataclasses.replace(config.trainer)
    # Both trainers live on the same ranks and layout: the feedback trainer reuses the process groups.
    trainer = MegatronTrainer(feedback_model.arch, trainer_config, pg_collection=controller.policy.pg,
                              hf_state=feedback_model.state)
    engine = make_engine(config, feedback_model)
    objective = PolicyGradientObjective(dataclasses.replace(config, trainer=trainer_config), controller.tokenizer,
                                        feedback_model, policy=trainer)
    feedback = PolicyExecutor("feedback", trainer, engine, objective, controller.weight_channel(trainer, engine))
    controller.policies.append(feedback)
    judge = build_judge(waltz.judge, config.engine)
    record = os.path.join(config.run_dir, "episodes.jsonl") if waltz.record_episodes else None
    episodes = WaltzEpisodes(controller.engine, feedback.engine, controller.tokenizer, judge, waltz,
                             sampling=SamplingParams.for_rollouts(config.rollout, None), samples_per_prompt=config.rollout.samples_per_prompt,
                             record_path=record, feedback_temperature=waltz.feedback_temperature)

    def train_schedule(policy, step: int) -> bool:
        # Stage 1: the conversation agent is frozen; stage 2: both agents train every step.
        return policy.name == "feedback" or training_stage(step, waltz.stage1_steps) == 2

    def evaluate() -> dict[str, float]:
        return evaluate_waltz(controller.engine, feedback.engine, controller.tokenizer, judge, waltz,
                              list(controller.heldout), max_new_tokens=config.eval.max_new_tokens,
                              record_path=os.path.join(config.run_dir, "eval_episodes.jsonl"),
                              step=controller.version)

    controller.train_schedule = train_schedule
    controller.evaluate_hook = evaluate
    train, heldout = build_safety_datasets(waltz.data)
    return train, heldout, episodes
