"""Admission control: no consumed sample is older than max_staleness versions, under random generator
and trainer speeds, and every prompt is consumed exactly once in stream order."""
from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import pytest

from megatron_rl.controller.episodes import SingleTurnSampling
from megatron_rl.controller.producer import RolloutProducer
from megatron_rl.data.config import DataConfig, SourceConfig
from megatron_rl.data.sources import PromptStream, build_datasets
from megatron_rl.rewards.registry import Reward
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.types import Completion


class _RandomSpeedEngine:
    """Completes each sample after a random delay; tokens record the weight version current when they
    were produced (a partial rollout spans an update). Stands in for the engine's timing only."""

    def __init__(self, seed: int):
        self.version = 0
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def submit(self, requests):
        futures = []
        for request in requests:
            for sample_id in request.sample_ids():
                future = Future()
                start_version = self.version
                delay = self.rng.uniform(0.0, 0.02)
                threading.Timer(delay, self._finish, (future, request, sample_id, start_version)).start()
                futures.append(future)
        return futures

    def wait(self, futures, timeout=None):
        return [f.result(timeout=timeout) for f in futures]

    def _finish(self, future, request, sample_id, start_version):
        future.set_result(Completion(request_id=sample_id, prompt_ids=list(request.prompt_ids), output_ids=[5, 6],
                                     output_logprobs=[-1.0, -1.0], weight_versions=[start_version, self.version],
                                     finish_reason="stop", group_id=request.group_id))


class _Tokenizer:
    def encode_chat(self, messages):
        return [1, 2, 3]

    def decode(self, ids):
        return "7"


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_no_consumed_sample_exceeds_the_staleness_bound(max_staleness):
    data = DataConfig(train=SourceConfig(kind="reasoning_gym", task="chain_sum", size=200, seed=3), heldout_size=4)
    train, _ = build_datasets(data)
    stream = PromptStream(train, seed=5)
    expected_order = [p.prompt_id for p in PromptStream(train, seed=5).next(4 * 12)]
    engine = _RandomSpeedEngine(seed=max_staleness)
    config = RolloutConfig(prompts_per_step=4, samples_per_prompt=2, max_staleness=max_staleness)
    episodes = SingleTurnSampling(engine, _Tokenizer(), Reward(RewardConfig(name="reasoning_gym")), config)
    producer = RolloutProducer(episodes, _Tokenizer(), stream, config, seed=1)
    rng = random.Random(42 + max_staleness)
    consumed, worst = [], 0
    for version in range(12):
        groups = producer.next_groups(version)
        for group in groups:
            consumed.append(group.prompt.prompt_id)
            for sample in group.samples:
                worst = max(worst, version - sample.completion.weight_version)
        time.sleep(rng.uniform(0.0, 0.03))  # the trainer's step
        engine.version = version + 1  # weight sync
    assert worst <= max_staleness
    if max_staleness:
        assert worst == max_staleness  # the generator did run ahead as far as allowed
    assert consumed == expected_order  # exactly once, in stream order
