"""PCL's prompt selector (Prompt Curriculum Learning, Gao, Kim, Sun et al. 2025, arXiv 2510.01135): a
value model scores k*m candidate prompts in one forward pass, the m with V(x) closest to tau are
generated, and V is regressed on their observed mean rewards after the step (`curriculum.kind: pcl`;
the curriculum hook is controller/curriculum.py, the math algorithms/pcl.py, the value model
trainer/value.py). `bench_selection.py` times it against dynamic sampling on the same candidates."""
from __future__ import annotations

import time
from typing import Any

import torch

from megatron_rl.algorithms.pcl import (
    explained_variance,
    select_closest_to_target,
    value_targets,
)
from megatron_rl.controller.curriculum import PromptSelector, scored_rewards
from megatron_rl.controller.episodes import Group
from megatron_rl.data.prompts import Prompt
from megatron_rl.data.sources import PromptStream
from megatron_rl.trainer.value import ValueTrainer, initial_weights


class PCLSelector(PromptSelector):
    """Value-model selection at intermediate difficulty; V trained on each step's rollouts."""

    def __init__(self, config, value_model, tokenizer):
        self.config = config
        self.value = value_model
        self.tokenizer = tokenizer
        self._predicted: dict[str, float] = {}  # prompt id -> V(x) at selection time
        self._draw_metrics: dict[int, dict[str, float]] = {}
        self._history: list[tuple[float, float]] = []  # (predicted, realised) over the run
        self._replay: list[tuple[list[int], float]] = []  # recent (prompt tokens, mean reward), oldest first

    def draw(self, stream: PromptStream, count: int, step: int) -> list[tuple[int, Prompt]]:
        start = time.perf_counter()
        indexed = stream.next_indexed(count * self.config.candidates_factor)
        candidates = [prompt for _, prompt in indexed]
        values = self.value.predict([self.tokenizer.encode_chat(p.messages) for p in candidates],
                                    pad_token_id=self.tokenizer.pad_token_id)
        chosen = select_closest_to_target(values, count, self.config.target)
        for i in chosen:
            self._predicted[candidates[i].prompt_id] = float(values[i])
        self._draw_metrics[step] = {
            "curriculum/select_time": time.perf_counter() - start,
            "curriculum/candidate_value_mean": float(values.mean()),
            "curriculum/candidate_value_std": float(values.std()) if len(values) > 1 else 0.0,
            "curriculum/selected_value_mean": float(values[chosen].mean()),
            "curriculum/selected_distance_mean": float((values[chosen] - self.config.target).abs().mean()),
        }
        return [indexed[i] for i in chosen]

    def executors(self) -> dict[str, Any]:
        return {"value": self.value}

    def state_dict(self) -> dict[str, Any]:
        # Predictions of prompts drawn but not yet observed (asynchronous runs), the run's
        # (predicted, realised) pairs behind curriculum/value_explained_variance_run, and V's replay.
        return {"predicted": dict(self._predicted), "history": [list(pair) for pair in self._history],
                "replay": [[list(tokens), target] for tokens, target in self._replay]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._predicted = dict(state.get("predicted", {}))
        self._history = [tuple(pair) for pair in state.get("history", [])]
        self._replay = [(list(tokens), float(target)) for tokens, target in state.get("replay", [])]

    def observe(self, groups: list[Group], step: int) -> dict[str, float]:
        metrics = dict(self._draw_metrics.pop(step, {}))
        groups = [g for g in groups if scored_rewards(g)]
        if not groups:
            return metrics
        realised = value_targets([scored_rewards(g) for g in groups])
        predicted = torch.tensor([self._predicted.pop(g.prompt.prompt_id, float("nan")) for g in groups])
        known = ~torch.isnan(predicted)
        self._history.extend(zip(predicted[known].tolist(), realised[known].tolist()))
        history = torch.tensor(self._history) if self._history else torch.zeros(0, 2)
        metrics.update({
            "curriculum/predicted_reward_mean": float(predicted[known].mean()) if known.any() else float("nan"),
            "curriculum/realised_reward_mean": float(realised.mean()),
            "curriculum/value_abs_error": float((predicted[known] - realised[known]).abs().mean()) if known.any() else float("nan"),
            "curriculum/value_explained_variance": explained_variance(predicted[known], realised[known]),
            "curriculum/value_explained_variance_run": explained_variance(history[:, 0], history[:, 1]),
        })
        start = time.perf_counter()
        # V is regressed on this step's groups and the replay of earlier steps' (value.replay_prompts).
        current = [(self.tokenizer.encode_chat(g.prompt.messages), float(r)) for g, r in zip(groups, realised.tolist())]
        batch = current + self._replay
        metrics.update(self.value.update([tokens for tokens, _ in batch], torch.tensor([t for _, t in batch]),
                                         pad_token_id=self.tokenizer.pad_token_id))
        keep = self.config.value.replay_prompts
        self._replay = (self._replay + current)[-keep:] if keep else []
        metrics["curriculum/value_update_time"] = time.perf_counter() - start
        metrics["curriculum/value_train_prompts"] = float(len(batch))
        return metrics


def build_value_model(config, *, policy_arch, policy_state, pg_collection):
    """The value executor, initialised from the policy's starting weights or from `config.init_from`."""
    arch, state = initial_weights(config.init_from, policy_arch, policy_state, "curriculum.value.init_from")
    return ValueTrainer(arch, config, hf_state=state, pg_collection=pg_collection)




def build_pcl_selector(config, *, tokenizer, policy_arch, policy_state, pg_collection) -> PCLSelector:
    """`curriculum.kind: pcl` (controller/curriculum.py's SELECTORS)."""
    value = build_value_model(config.value, policy_arch=policy_arch, policy_state=policy_state,
                              pg_collection=pg_collection)
    return PCLSelector(config, value, tokenizer)
