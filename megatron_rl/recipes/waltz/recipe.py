"""The WaltzRL recipe: a conversation policy and a feedback policy, each its own Megatron trainer and
rollout engine, trained in the one loop on two-agent episodes (recipes/waltz/episodes.py), with the
two-stage schedule (stage 1: the feedback agent alone) and the safety evaluation."""
from __future__ import annotations

import dataclasses
import os

from megatron_rl.algorithms.waltz import training_stage
from megatron_rl.controller.evaluate import HeldoutEvaluation
from megatron_rl.controller.objectives import PolicyGradientObjective
from megatron_rl.controller.recipe import PolicyExecutor, RunParts, build_policy
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.generators import make_engine, policy_weight_channel
from megatron_rl.recipes.waltz.data import build_safety_datasets
from megatron_rl.recipes.waltz.episodes import WaltzEpisodes, evaluate_waltz
from megatron_rl.recipes.waltz.judge import build_judge
from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.trainer.trainer import MegatronTrainer


def build_waltz(config, model) -> RunParts:
    """The run's parts: both policies, the episode producer, the schedule and the safety evaluation."""
    conversation, selector = build_policy(config, model, single_policy=False)
    waltz = config.waltz
    feedback_model = model if waltz.feedback_model in (None, config.model.path) else load_pretrained(waltz.feedback_model)
    trainer_config = waltz.feedback_trainer or dataclasses.replace(config.trainer)
    # Both trainers live on the same ranks and layout: the feedback trainer reuses the process groups.
    trainer = MegatronTrainer(feedback_model.arch, trainer_config, pg_collection=conversation.trainer.pg,
                              hf_state=feedback_model.state)
    engine = make_engine(config, feedback_model, single_policy=False)
    objective = PolicyGradientObjective(dataclasses.replace(config, trainer=trainer_config), model.tokenizer,
                                        feedback_model, policy=trainer)
    feedback = PolicyExecutor("feedback", trainer, engine, objective, policy_weight_channel(config, trainer, engine))
    judge = build_judge(waltz.judge, config.engine)
    record = os.path.join(config.run_dir, "episodes.jsonl") if waltz.record_episodes else None
    episodes = WaltzEpisodes(conversation.engine, feedback.engine, model.tokenizer, judge, waltz,
                             sampling=SamplingParams.for_rollouts(config.rollout, None),
                             samples_per_prompt=config.rollout.samples_per_prompt,
                             record_path=record, feedback_temperature=waltz.feedback_temperature)

    def schedule(policy: PolicyExecutor, step: int) -> bool:
        # Stage 1: the conversation agent is frozen; stage 2: both agents train every step.
        return policy.name == "feedback" or training_stage(step, waltz.stage1_steps) == 2

    train, heldout = build_safety_datasets(waltz.data)

    def measure(step: int) -> dict[str, float]:
        return evaluate_waltz(conversation.engine, feedback.engine, model.tokenizer, judge, waltz, list(heldout),
                              max_new_tokens=config.eval.max_new_tokens,
                              record_path=os.path.join(config.run_dir, "eval_episodes.jsonl"), step=step)

    return RunParts(model.tokenizer, [conversation, feedback], train, heldout, episodes, selector,
                    HeldoutEvaluation(config.eval, measure), schedule)
