"""Delta weight sync (weight_sync/delta.py): each encoding against a brute-force element count and a
full copy, the shared-memory write into strided views, the wire form, and whole runs that sync by delta
and end with the bits of a run that syncs everything."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.weight_sync.delta import (
    DeltaEncoder,
    WeightDelta,
    encode,
    from_wire,
    to_wire,
    write_changed,
)
from tests.test_reliability import _config, _final_weights

_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _changed(held: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`held` with about `fraction` of its elements moved to another value, plus the changes a float `!=`
    misses: a 0.0 that became -0.0 and a NaN whose payload bits changed."""
    generator = torch.Generator().manual_seed(seed)
    new = held.clone()
    flat = new.view(-1)
    picked = torch.rand(flat.numel(), generator=generator) < fraction
    flat[picked] = flat[picked] + 0.5 + torch.rand(int(picked.sum()), generator=generator).to(flat.dtype)
    if fraction > 0:
        held.view(-1)[0], flat[0] = 0.0, -0.0
        bits = _INT[held.dtype]
        held.view(-1)[1:2].view(bits).fill_(int(torch.tensor(float("nan"), dtype=held.dtype).view(bits)))
        flat[1:2].view(bits).copy_(held.view(-1)[1:2].view(bits) + 1)  # another NaN
    return new


def _brute_force_changed(new: torch.Tensor, held: torch.Tensor) -> int:
    bits = _INT[new.dtype]
    return sum(a != b for a, b in zip(new.reshape(-1).view(bits).tolist(), held.reshape(-1).view(bits).tolist()))


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(_INT[a.dtype]), b.reshape(-1).view(_INT[b.dtype]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.05, 0.5, 1.0])
def test_each_encoding_is_the_smallest_and_rebuilds_the_new_tensor(dtype, fraction):
    held = torch.randn(48, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    new = _changed(held, fraction, seed=2)
    count = _brute_force_changed(new, held)
    out = encode(new, held)
    if count == 0:
        assert out is None
        return
    numel, size = new.numel(), new.element_size()
    sizes = {"sparse": count * (4 + size), "mask": math.ceil(numel / 8) + count * size, "whole": numel * size}
    smallest = min(sizes, key=lambda k: (sizes[k], k != "whole"))  # a tie goes whole (no decoding)
    kind = "whole" if isinstance(out, torch.Tensor) else out.encoding
    assert kind == smallest, (count, sizes)
    if isinstance(out, WeightDelta):
        assert out.nbytes == sizes[kind] and out.values.numel() == count
    receiver = held.clone()
    out.apply_to(receiver) if isinstance(out, WeightDelta) else receiver.copy_(out)
    assert _bit_equal(receiver, new)


def test_write_changed_into_a_strided_view_equals_a_copy():
    """The shared-memory channel writes a TP shard's columns into the arena: a non-contiguous view."""
    arena = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    source = arena[:, 8:40].clone()
    source[torch.rand(source.shape, generator=torch.Generator().manual_seed(4)) < 0.1] += 1.0
    count = _brute_force_changed(source, arena[:, 8:40])
    expected = arena.clone()
    expected[:, 8:40].copy_(source)
    assert write_changed(arena[:, 8:40], source) == count * 4
    assert _bit_equal(arena, expected)
    assert write_changed(arena[:, 8:40], source) == 0  # nothing left to change
    # into a bf16 arena: compared (and rounded) in the arena's dtype, as copy_ rounds
    low = torch.zeros(16, 32, dtype=torch.bfloat16)
    write_changed(low, source)
    assert _bit_equal(low, source.to(torch.bfloat16))


def test_the_wire_form_carries_every_encoding_and_shape():
    held = {"w": torch.randn(64, 64), "b": torch.randn(300), "s": torch.tensor(1.0)}
    new = {"w": _changed(held["w"], 0.002, 5), "b": _changed(held["b"], 0.3, 6), "s": torch.tensor(2.0)}
    encoder = DeltaEncoder(held=held.get)
    assert all(isinstance(v, torch.Tensor) for _, v in encoder.encode(new.items()))  # the first sync is whole
    sent = dict(encoder.encode(new.items()))
    assert {n: getattr(v, "encoding", "whole") for n, v in sent.items()} == {"w": "sparse", "b": "mask", "s": "whole"}
    received = from_wire(dict(to_wire(sent.items())))
    for name, value in received.items():
        target = held[name].clone()
        value.apply_to(target) if isinstance(value, WeightDelta) else target.copy_(value)
        assert _bit_equal(target, new[name]), name


def test_an_encoder_that_keeps_copies_tracks_the_receiver_and_resets_to_whole():
    """Without the receiver's tensors at hand the encoder compares with what it sent, in the receiver's
    dtype; `reset` (resume, mismatch) sends everything again."""
    generator = torch.Generator().manual_seed(7)
    weights = {"a": torch.randn(128, 32, generator=generator), "b": torch.randn(32, generator=generator)}
    encoder = DeltaEncoder(dtype=torch.bfloat16)
    receiver: dict[str, torch.Tensor] = {}
    kinds = []
    for step in range(4):
        if step:
            for tensor in weights.values():  # an optimizer step: a few bf16 values cross a rounding boundary
                tensor.add_(1e-3 * torch.randn(tensor.shape, generator=generator))
        if step == 3:
            encoder.reset()
        for name, value in from_wire(dict(to_wire(encoder.encode(weights.items())))).items():
            if isinstance(value, WeightDelta):
                value.apply_to(receiver[name])
            else:
                receiver[name] = value.clone()
        kinds.append(encoder.stats.tensors)
        for name, tensor in weights.items():
            assert _bit_equal(receiver[name], tensor.to(torch.bfloat16)), (step, name)
    assert kinds[0]["whole"] == 2 and kinds[3]["whole"] == 2
    assert kinds[1]["sparse"] + kinds[1]["mask"] + kinds[1]["unchanged"] == 2


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_a_delta_synced_run_ends_with_the_bits_of_a_fully_synced_one(tmp_path, tiny_chat_model, placement):
    """A bf16 engine fed by delta holds what a full sync gives it, so the rollouts, and with them the trained
    weights, are those of the same run with full syncs; its metrics say what each sync sent."""
    extra = ["engine.dtype=bf16", "steps=3", "trainer.lr=1e-4"]
    if placement == "disaggregated":  # the shared-memory channel, one version ahead, reproducible
        extra += ["rollout.placement=disaggregated", "rollout.max_staleness=1", "rollout.deterministic=true"]
    runs = {}
    for mode in ("full", "delta"):
        run_dir = str(tmp_path / mode)
        train(_config(tiny_chat_model, run_dir, *extra, f"rollout.weight_sync={mode}"))
        metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        runs[mode] = (_final_weights(run_dir), [m.get("weight_sync/sent_fraction") for m in metrics])
    (full, no_fractions), (delta, fractions) = runs["full"], runs["delta"]
    assert full.keys() == delta.keys()
    assert all(torch.equal(full[n], delta[n]) for n in full)
    assert no_fractions == [None] * 3
    assert len(fractions) == 3 and all(0 < f < 1 for f in fractions[-1:]), fractions


@pytest.mark.parametrize("engine", [["cluster.generator.backend=vllm"], ["cluster.generator.backend=sglang"],
                                    ["cluster.generator.precision=fp8", "rollout.placement=disaggregated"]])
def test_delta_sync_is_refused_for_engines_that_take_whole_tensors(tmp_path, tiny_chat_model, engine):
    with pytest.raises(ConfigError, match="rollout.weight_sync"):
        _config(tiny_chat_model, str(tmp_path), "rollout.weight_sync=delta", *engine)
    _config(tiny_chat_model, str(tmp_path), "rollout.weight_sync=full", *engine)  # the same engine, synced whole


def _mismatch_worker(rank, world_size, arch, state):
    from megatron_rl.placement.generator_process import GeneratorProcess, WeightMismatchError
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.trainer.config import TrainerConfig
    from megatron_rl.trainer.trainer import MegatronTrainer
    from megatron_rl.weight_sync.channel import SharedMemoryWeightChannel

    trainer = MegatronTrainer(arch, TrainerConfig(vocab_divisible_by=1), hf_state=state)
    generator = GeneratorProcess(arch, trainer.gather_hf_state(dst=0), config=NativeEngineConfig(max_batch_size=2,
                                                                                               dtype="bf16"))
    try:
        channel = SharedMemoryWeightChannel(trainer, generator, delta=True)
        for version in (1, 2):  # each arena written whole once
            channel.push(version)
        commit, rejected = generator.commit_weights, []

        def reject_once(version=None, expected=None):
            if not rejected:
                rejected.append(version)
                commit(version, expected)
                raise WeightMismatchError(f"weight sync to version {version}: checksum mismatch (injected)")
            return commit(version, expected)

        generator.commit_weights = reject_once
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                parameter.add_(1e-2 * parameter.abs().mean())
        pushed = channel.push(3)
        held = channel.arena_views[1 - generator.staging_index]
        expected = {n: t.to(torch.bfloat16) for n, t in trainer.gather_hf_state(dst=0).items()}
        return rejected, pushed["weight_sync/sent_fraction"], generator.version, \
            [n for n, t in expected.items() if not torch.equal(held[n], t)]
    finally:
        generator.close()


def test_a_delta_the_generator_rejects_is_synced_again_whole(tiny_arch):
    """A checksum mismatch after a delta write (injected) makes the channel write the same version again, whole:
    the generator ends on the trainer's weights."""
    from megatron_rl.placement.launch import run_distributed
    from tests.helpers import near_uniform_state

    rejected, fraction, version, differing = run_distributed(_mismatch_worker, 1, tiny_arch,
                                                             near_uniform_state(tiny_arch))[0]
    assert rejected == [3] and fraction == 1.0 and version == 3 and differing == []
