"""Core lending between a trainer and its generator process on one CPU host (placement/core_share.py):
each side runs on its own share while the other works and on every core while the other idles."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.core_share import CoreShare
from megatron_rl.placement.generator_process import GeneratorProcess
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import GenerateRequest, SamplingParams


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_each_side_takes_every_core_while_the_other_idles(restore_threads):
    torch.set_num_threads(2)  # neither share: so both changes below count, whatever ran before in this process
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


def test_trainer_gives_back_a_core_within_a_micro_batch(tiny_arch, restore_threads):
    """The trainer re-takes its share before every layer's forward and backward, so a generator that
    starts work mid-micro-batch gets its core back within one layer, not at the next micro-batch."""
    from megatron_rl.algorithms.config import LossConfig
    from megatron_rl.algorithms.losses import make_loss_fn
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.types import TrainBatch

    trainer = MegatronTrainer(tiny_arch, TrainerConfig(micro_batch_size=2, lr=1e-3))
    share = CoreShare(trainer_threads=1, generator_threads=1)
    cores, generator = share.for_role("trainer"), share.for_role("generator")
    seen: list[int] = []
    generator_starts_at = [3]  # the generator gets work during the first micro-batch's forward

    def between_layers():
        if len(seen) in generator_starts_at:
            generator.set_busy(True)
        seen.append(cores.apply())

    trainer.between_layers = between_layers
    tokens = torch.randint(0, tiny_arch.vocab_size, (4, 8))
    mask = torch.zeros(4, 8)
    mask[:, 4:] = 1
    batch = TrainBatch(tokens=tokens, loss_mask=mask, advantages=mask.clone(), behaviour_logprobs=torch.zeros(4, 8))
    trainer.train_step(batch, make_loss_fn(LossConfig(name="aipo"), float(mask.sum())))
    layers, micro_batches = tiny_arch.num_layers + 1, 2  # + the final layer norm
    assert len(seen) == micro_batches * (1 + 2 * layers)  # per micro-batch: its start, each forward, each backward
    assert seen[:3] == [2, 2, 2] and seen[3:] == [1] * (len(seen) - 3)
    generator.set_busy(False)
    generator_starts_at.clear()
    seen.clear()
    trainer.compute_logprobs(batch)
    assert seen == [2] * micro_batches * (1 + layers)  # forward only: no backward boundaries
