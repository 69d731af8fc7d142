"""Core lending between a trainer and its generator process on one CPU host (controller/core_share.py):
each side runs on its own share while the other works and on every core while the other idles."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.checkpoints_tools import load_pretrained
from megatron_rl.controller.core_share import CoreShare
from megatron_rl.controller.generator_process import GeneratorProcess
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
from megatron_rl.rollout.native import NativeEngineConfig


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_each_side_takes_every_core_while_the_other_idles(restore_threads):
    share = CoreShare(trainer_threads=1, generator_threads=3)
    trainer, generator = share.for_role("trainer"), share.for_role("generator")
    assert (trainer.threads(), generator.threads()) == (4, 4)  # both idle
    generator.set_busy(True)
    assert (trainer.threads(), generator.threads()) == (1, 4)
    with trainer.working():
        assert torch.get_num_threads() == 1 and generator.threads() == 3
        generator.set_busy(False)
        assert trainer.apply() == 4 and torch.get_num_threads() == 4
    assert not generator.peer_busy() and trainer.switches == 2
    with pytest.raises(RuntimeError, match="for_role"):
        share.threads()


def test_generator_process_follows_the_trainer(tiny_chat_model, restore_threads):
    """Steps of the generator process run on its one thread while the trainer works and on both
    threads while it idles; the generator's busy flag is seen by the trainer across the process boundary."""
    tiny = load_pretrained(tiny_chat_model)
    share = CoreShare(trainer_threads=1, generator_threads=1)
    request = lambda i, n: GenerateRequest(  # noqa: E731
        request_id=f"r{i}", prompt_ids=tiny.tokenizer.encode_chat([{"role": "user", "content": f"{i} + {i}?"}]),
        sampling=SamplingParams(max_new_tokens=n, temperature=1.0, seed=i))
    with GeneratorProcess(tiny.arch, tiny.state, tokenizer=tiny.tokenizer, config=NativeEngineConfig(max_batch_size=2),
                          core_share=share) as remote:
        trainer = remote.trainer_cores
        remote.generate([request(0, 8)])  # the trainer idles: every step on both cores
        assert remote.health().get("steps_on_2_threads", 0) >= 1
        assert not trainer.peer_busy()
        with trainer.working():
            futures = remote.submit([request(1, 64), request(2, 64)])
            seen_busy = False
            while not all(f.done() for f in futures):
                seen_busy |= trainer.peer_busy()
                time.sleep(0.01)
        assert seen_busy
        health = remote.health()
        assert health.get("steps_on_1_threads", 0) >= 1
        deadline = time.monotonic() + 10
        while trainer.peer_busy() and time.monotonic() < deadline:  # an idle engine says so
            time.sleep(0.01)
        assert not trainer.peer_busy()
