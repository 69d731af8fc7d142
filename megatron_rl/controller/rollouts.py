"""Rollout production: prompts -> engine samples -> rewards, grouped per prompt, under a staleness bound.

One `RolloutProducer` serves the synchronous and the asynchronous loop. It keeps submitting prompt
groups to the engine while admission control allows: a group may be started only if it will be
consumed no more than `max_staleness` weight versions after the version that generates it. With
`max_staleness: 0` it starts a step's groups only once the previous step's weights are in the engine,
which is exactly the synchronous on-policy loop; with k > 0 the engine runs up to k steps ahead while
the trainer trains (LlamaRL's asynchronous off-policy mode, corrected by AIPO).
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future
from typing import Literal, Sequence

from megatron_rl.config import require
from megatron_rl.data.sources import Prompt, PromptStream
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.rewards.registry import Reward, RewardResult
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.types import Completion


@dataclasses.dataclass(kw_only=True)
class RolloutConfig:
    """Sampling for training: prompts per step, samples per prompt, the sampling distribution, staleness."""

    prompts_per_step: int = 8
    """Prompts (groups) per optimizer step."""
    samples_per_prompt: int = 8
    """Responses sampled per prompt (the group size n for GRPO / RLOO baselines)."""
    max_new_tokens: int = 32
    """Longest response."""
    temperature: float = 1.0
    """Sampling temperature (1.0 samples the raw policy, which the importance weights assume)."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k truncation (-1: off)."""
    max_staleness: int = 0
    """Versions a consumed sample may lag the trainer: 0 is synchronous on-policy training; k >= 1
    lets generation run up to k steps ahead of training (asynchronous, off-policy)."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: the engine shares the trainer's process and cores, and generation and training take
    turns. disaggregated: the engine runs in its own process on `generator_threads` cores while the
    trainer keeps `trainer_threads` (LlamaRL's layout; with max_staleness >= 1 they overlap)."""
    generator_threads: int = 1
    """Cores (torch threads) of the generator process in the disaggregated placement."""
    trainer_threads: int = 1
    """Cores (torch threads) of the trainer in the disaggregated placement."""
    weight_update: Literal["in_flight", "pause"] = "in_flight"
    """in_flight: new weights apply between two decode steps and unfinished responses continue under
    them (partial rollouts; each token records its version). pause: generation is paused for the
    update, and the KV cache is freed (when no response is in flight) before it resumes."""
    verify_weight_sync: bool = False
    """Checksum every tensor on both sides after each weight sync (disaggregated); fail on mismatch."""
    drop_uninformative_groups: bool = True
    """Skip the backward pass for groups whose advantages are all zero (every sample scored the same).
    Their gradient is exactly zero without a KL/entropy term, so this changes speed, not the update."""

    def __post_init__(self) -> None:
        require(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        require(self.samples_per_prompt >= 1, "samples_per_prompt", "must be >= 1")
        require(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        require(self.temperature >= 0, "temperature", "must be >= 0")
        require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        require(self.generator_threads >= 1, "generator_threads", "must be >= 1")
        require(self.trainer_threads >= 1, "trainer_threads", "must be >= 1")

    def sampling(self, seed: int | None) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, n=self.samples_per_prompt, seed=seed)


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


class SingleTurnEpisodes:
    """The default episode: n samples of the prompt from one engine, each scored by the reward."""

    def __init__(self, engine, tokenizer: ChatTokenizer, reward: Reward, config: RolloutConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward = reward
        self.config = config
        self.reward_time = 0.0  # seconds spent scoring, cumulative

    def submit(self, prompt: Prompt, request_id: str, seed: int) -> list[Future]:
        request = GenerateRequest(request_id=request_id, prompt_ids=self.tokenizer.encode_chat(prompt.messages),
                                  sampling=self.config.sampling(seed), group_id=prompt.prompt_id)
        futures = self.engine.submit([request])
        for future in futures:  # completion times, for the timeline's generation track
            future.add_done_callback(lambda f: setattr(f, "finished_at", time.perf_counter()))
        return futures

    def collect(self, prompt: Prompt, futures: list[Future]) -> list[Sample]:
        completions = self.engine.wait(futures)
        texts = [self.tokenizer.decode(c.output_ids) for c in completions]
        scored_from = time.perf_counter()
        rewards = self.reward.score_batch(texts, [prompt] * len(texts))
        self.reward_time += time.perf_counter() - scored_from
        return [Sample(c, t, r) for c, t, r in zip(completions, texts, rewards)]

    def begin_step(self, step: int) -> None:
        """Called before the groups of training step `step` are collected (multi-stage episode producers)."""

    def pop_metrics(self) -> dict[str, float]:
        """Episode metrics gathered since the last call (none for single-turn episodes)."""
        return {}


class RolloutProducer:
    """Keeps the engine(s) fed with prompt groups within the staleness bound; hands out scored groups.

    What one prompt's group is made of is the episode producer's business: `episodes.submit(prompt,
    request_id, seed) -> list[Future]` starts it without blocking, `episodes.collect(prompt, futures)
    -> list[Sample]` waits for it and scores it; `begin_step(step)` and `pop_metrics()` frame each
    training step. The default (`SingleTurnEpisodes`) samples n responses
    from `engine`; multi-turn, multi-agent episodes (WaltzRL) plug in here, under the same admission."""

    def __init__(self, engine, tokenizer: ChatTokenizer, stream: PromptStream, reward: Reward | None,
                 config: RolloutConfig, *, seed: int, timeline=None, episodes=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.stream = stream
        self.reward = reward
        self.config = config
        self.seed = seed
        self.timeline = timeline
        self.episodes = episodes if episodes is not None else SingleTurnEpisodes(engine, tokenizer, reward, config)
        self._in_flight: list[tuple[Prompt, list[Future], int, float]] = []
        self._admitted_steps = 0  # training steps whose groups have been submitted

    @property
    def reward_time(self) -> float:
        """Seconds spent scoring, cumulative."""
        return self.episodes.reward_time

    def _admit(self, trainer_version: int) -> None:
        """Submit groups for every step s whose consumption version s stays within the bound.

        Step s (0-based) is consumed by the trainer at version s; its groups may be generated by
        weights of version >= s - max_staleness, and the engine holds `trainer_version` now."""
        while self._admitted_steps <= trainer_version + self.config.max_staleness:
            step = self._admitted_steps
            for index, prompt in enumerate(self.stream.next(self.config.prompts_per_step)):
                # Seeds derive from (run seed, step, slot): a resumed run samples exactly the same.
                seed = (self.seed * 1_000_003 + step * 1009 + index) % (2 ** 31)
                futures = self.episodes.submit(prompt, f"s{step}-p{index}-{prompt.prompt_id}", seed)
                self._in_flight.append((prompt, futures, step, time.perf_counter()))
            self._admitted_steps += 1

    def next_groups(self, trainer_version: int) -> list[Group]:
        """The groups of the next training step (blocks until they are generated and scored)."""
        self._admit(trainer_version)
        count = self.config.prompts_per_step
        batch, self._in_flight = self._in_flight[:count], self._in_flight[count:]
        groups = []
        for prompt, futures, step, submitted in batch:
            samples = self.episodes.collect(prompt, futures)
            elapsed = time.perf_counter() - submitted
            if self.timeline is not None:
                finished = max(getattr(f, "finished_at", time.perf_counter()) for f in futures)
                self.timeline.add(f"generate {prompt.prompt_id}", submitted, finished, category="generate",
                                  step=step, versions=sorted({s.completion.weight_version for s in samples}))
            groups.append(Group(prompt, samples, step, elapsed))
        return groups

    def resume_at(self, step: int) -> None:
        """Continue a restored run: the next groups admitted belong to training step `step`."""
        if self._in_flight:
            raise RuntimeError("resume_at() needs an idle producer")
        self._admitted_steps = step

    def pending_prompt_ids(self) -> list[str]:
        return [prompt.prompt_id for prompt, *_ in self._in_flight]


def evaluate(engine, tokenizer: ChatTokenizer, prompts: Sequence[Prompt], reward: Reward, *,
             max_new_tokens: int, samples: int = 1, temperature: float = 0.0, seed: int = 0,
             progress: bool = False) -> dict[str, float]:
    """Held-out accuracy: greedy (samples=1, temperature 0) or mean@k (fraction correct over k samples)."""
    from tqdm import tqdm

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=samples,
                            seed=seed if temperature > 0 else None)
    requests = [GenerateRequest(request_id=f"eval-{i}-{p.prompt_id}", prompt_ids=tokenizer.encode_chat(p.messages),
                                sampling=params, group_id=p.prompt_id) for i, p in enumerate(prompts)]
    futures = engine.submit(requests)
    completions: list[Completion] = []
    chunk = 16 * samples  # the engine keeps every request in flight; waiting in chunks feeds the bar
    with tqdm(total=len(prompts), desc="evaluate", disable=not progress, leave=False) as bar:
        for start in range(0, len(futures), chunk):
            completions.extend(engine.wait(futures[start:start + chunk]))
            bar.update(len(futures[start:start + chunk]) // samples)
    correct = total = errors = 0
    lengths = []
    for index, prompt in enumerate(prompts):
        for completion in completions[index * samples:(index + 1) * samples]:
            result = reward(tokenizer.decode(completion.output_ids), prompt)
            correct += int(bool(result.correct))
            errors += int(not result.ok)
            total += 1
            lengths.append(len(completion.output_ids))
    return {"accuracy": correct / max(total, 1), "samples": total, "reward_errors": errors,
            "response_length_mean": sum(lengths) / max(len(lengths), 1)}
