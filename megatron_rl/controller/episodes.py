"""Episode producers: how one prompt becomes its group of scored samples.

The rollout producer (controller/producer.py) decides *when* a prompt's group may start (staleness
admission) and keeps the buffer a checkpoint saves; an episode producer decides *what* the group is:

    futures = episodes.submit([GroupRequest(prompt, prompt_ids, request_id, seed), ...])   # no blocking
    samples = episodes.collect(prompt, futures[i])       # waits for group i, scores it: list[Sample]

`SingleTurnSampling` (below) samples n responses of the prompt from one engine and scores them with the
reward; WaltzRL's two-agent episodes (recipes/waltz/episodes.py) and the agent recipe's multi-turn tool
episodes (recipes/agent/episodes.py) are producers behind the same interface (both on `EpisodeRuns`, below),
so staleness admission, partial rollouts, checkpoints, resume and metrics apply to all of them.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from concurrent.futures import Future
from typing import Protocol, Sequence

from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.rewards.registry import Reward, RewardResult
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams, caller_driven
from megatron_rl.types import Completion


@dataclasses.dataclass
class Sample:
    """One scored response."""

    completion: Completion
    """Tokens, behaviour log-probs and per-token versions from the engine."""
    text: str
    """Decoded response."""
    reward: RewardResult
    """Reward, correctness and any scoring error."""
    role: str = "policy"
    """Which policy of the run produced it and trains on it ('policy' in single-policy runs; a
    multi-agent run names its policies, e.g. WaltzRL's 'policy' (conversation) and 'feedback')."""


@dataclasses.dataclass
class Group:
    """The n samples of one prompt, with the step that asked for them."""

    prompt: Prompt
    """The prompt (id, messages, reference answer, metadata)."""
    samples: list[Sample]
    """Its responses, in sample order."""
    requested_at_version: int
    """Trainer version when the group was admitted (the weights it was generated with may be newer)."""
    generate_time: float = 0.0
    """Seconds from submission to the last sample's completion."""


@dataclasses.dataclass
class GroupRequest:
    """One prompt's group to start."""

    prompt: Prompt
    """The prompt."""
    prompt_ids: list[int]
    """Its chat-rendered token ids (already checked against the engine's context)."""
    request_id: str
    """'s{step}-p{slot}-{prompt_id}': unique in the run, stable across a resume."""
    seed: int
    """The group's seed, derived from (run seed, step, slot): a resumed run samples the same."""


class EpisodeProducer(Protocol):
    """Turns prompts into groups of scored samples (see the module docstring)."""

    engines: list
    """The engines it generates with (synchronous runs step them only in the collecting thread)."""
    reward_time: float
    """Seconds spent scoring, cumulative."""
    generated_samples: int
    """Responses generated, cumulative (discarded ones included)."""
    keeps_in_flight_samples: bool
    """True: a checkpoint keeps its in-flight groups' samples (tokens, log-probs, versions) and a resumed
    run trains on them. False: a resumed run generates those groups again, with the same seeds."""

    def begin_step(self, step: int) -> None:
        """Called before the groups of training step `step` (0-based) are collected."""

    def submit(self, groups: Sequence[GroupRequest]) -> list[list[Future]]:
        """Start the groups without blocking (as one submission); per group, futures the producer's
        `collect` and `drain` understand."""

    def collect(self, prompt: Prompt, futures: Sequence[Future]) -> list[Sample]:
        """Wait for one group and score it."""

    def drain(self, futures: Sequence[Future]) -> None:
        """Block until the futures are done (a failure surfaces later, at `collect`)."""

    def pop_metrics(self) -> dict[str, float]:
        """Metrics gathered since the last call."""


BASELINE_ROLE = "baseline"
"""`Sample.role` of a response generated only for its reward, as a baseline (ReMax's greedy response):
scored and kept with its group, never trained on (controller/batching.py)."""


class SingleTurnSampling:
    """n samples of each prompt from one engine (`rollout.samples_per_prompt`), scored by the reward; with
    `greedy_baseline`, one more greedy response per prompt whose reward is ReMax's baseline (role
    BASELINE_ROLE, generated in the same submission)."""

    keeps_in_flight_samples = True

    def __init__(self, engine, tokenizer: ChatTokenizer, reward: Reward, config: RolloutConfig, *,
                 greedy_baseline: bool = False):
        self.engine = engine
        self.engines = [engine]
        self.tokenizer = tokenizer
        self.reward = reward
        self.config = config
        self.greedy_baseline = greedy_baseline
        self.reward_time = 0.0
        self.generated_samples = 0

    def begin_step(self, step: int) -> None:
        pass

    def pop_metrics(self) -> dict[str, float]:
        return {}

    def submit(self, groups: Sequence[GroupRequest]) -> list[list[Future]]:
        # One engine submission for all groups: one scheduling decision, so deterministic mode sees the
        # same batches on every run.
        requests = []
        for g in groups:
            requests.append(GenerateRequest(request_id=g.request_id, prompt_ids=g.prompt_ids,
                                            sampling=SamplingParams.for_rollouts(self.config, g.seed),
                                            group_id=g.prompt.prompt_id))
            if self.greedy_baseline:
                greedy = dataclasses.replace(SamplingParams.for_rollouts(self.config, g.seed), temperature=0.0, n=1)
                requests.append(GenerateRequest(request_id=f"{g.request_id}-greedy", prompt_ids=g.prompt_ids,
                                                sampling=greedy, group_id=g.prompt.prompt_id))
        futures = self.engine.submit(requests) if requests else []
        for future in futures:  # completion times, for the timeline's generation track
            future.add_done_callback(lambda f: setattr(f, "finished_at", time.perf_counter()))
        n = self.config.samples_per_prompt + self.greedy_baseline
        return [futures[i * n:(i + 1) * n] for i in range(len(groups))]

    def collect(self, prompt: Prompt, futures: Sequence[Future]) -> list[Sample]:
        samples = self.score(prompt, self.engine.wait(futures))
        if self.greedy_baseline:
            samples[-1] = dataclasses.replace(samples[-1], role=BASELINE_ROLE)
        return samples

    def drain(self, futures: Sequence[Future]) -> None:
        try:
            self.engine.wait(futures)
        except Exception:  # a failed sample surfaces when its step is consumed; here only wait
            concurrent.futures.wait(futures)

    def score(self, prompt: Prompt, completions: list[Completion]) -> list[Sample]:
        self.generated_samples += len(completions)
        texts = [self.tokenizer.decode(c.output_ids) for c in completions]
        scored_from = time.perf_counter()
        rewards = self.reward.score_batch(texts, [prompt] * len(texts))
        self.reward_time += time.perf_counter() - scored_from
        return [Sample(c, t, r) for c, t, r in zip(completions, texts, rewards)]

    def rollout(self, prompts: Sequence[Prompt], *, tag: str, seed: int) -> list[Group]:
        """Generate and score `prompts` now with the engine's current weights, outside the training
        stream (pre-filtering, benchmarks). Samples like training does (rollout config, n per prompt)."""
        version = self.engine.version
        futures, groups = [], []
        with caller_driven(self.engine):  # submitted one by one, the prompts still share batches
            for index, prompt in enumerate(prompts):
                request = GenerateRequest(request_id=f"{tag}-p{index}-{prompt.prompt_id}",
                                          prompt_ids=self.tokenizer.encode_chat(prompt.messages),
                                          sampling=SamplingParams.for_rollouts(self.config, (seed * 1009 + index) % (2 ** 31)),
                                          group_id=prompt.prompt_id)
                futures.append((prompt, self.engine.submit([request]), time.perf_counter()))
            for prompt, group_futures, submitted in futures:
                completions = self.engine.wait(group_futures)
                groups.append(Group(prompt, self.score(prompt, completions), version,
                                    time.perf_counter() - submitted))
        return groups


class EpisodeRuns:
    """Base of the producers whose samples are episodes advanced turn by turn in the engines' callback
    threads (WaltzRL's two agents, the agent recipe): each of a group's `samples_per_prompt` episodes is one
    run, seeded apart, started without blocking; a subclass says what a run is (`episode_run`) and how a
    finished group is collected."""

    samples_per_prompt: int

    def episode_run(self, prompt: Prompt, run_id: str, seed: int | None):
        """One episode: an object with `start()` and the `future` of its sample."""
        raise NotImplementedError

    def submit(self, groups: Sequence[GroupRequest]) -> list[list[Future]]:
        return [self.start(group.prompt, group.request_id, group.seed) for group in groups]

    def start(self, prompt: Prompt, request_id: str, seed: int | None) -> list[Future]:
        """Start the group's episodes (turns advance in the engines' threads); their futures."""
        runs = [self.episode_run(prompt, f"{request_id}-e{k}", None if seed is None else seed + 7919 * k)
                for k in range(self.samples_per_prompt)]
        for run in runs:
            run.start()
        return [run.future for run in runs]

    def drain(self, futures: Sequence[Future]) -> None:
        concurrent.futures.wait(futures)
