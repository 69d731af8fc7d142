"""Weight sync over a dedicated process group with SGLang's protocol (init_weights_update_group +
update_weights_from_distributed), on CPU with gloo: trainer rank 0 broadcasts, two engines (TP 1 and
TP 2: three receiving workers) rebuild every tensor bit for bit, in bf16 and as block fp8."""
from __future__ import annotations

import torch

from megatron_rl.placement.launch import run_distributed
from megatron_rl.trainer.parallel import free_port

ENGINE_TP = [1, 2]


class _RecordingEngine:
    """Stands in for an SGLang server on the trainer's side: records what the trainer asked of it
    (the receiving workers, in other processes, follow the same calls)."""

    def __init__(self):
        self.calls = []

    def init_weights_update_group(self, *args):
        self.calls.append(("init", args))

    def update_weights_from_distributed(self, names, dtypes, shapes, version=None, group_name=None, flush_cache=True):
        self.calls.append(("update", list(names), list(dtypes), [list(s) for s in shapes], version))


def _state(fp8):
    from megatron_rl.models.arch import preset
    from megatron_rl.weight_sync.fp8 import quantize_state
    from tests.helpers import tiny_state

    state = {k: v.to(torch.bfloat16) for k, v in tiny_state(preset("tiny"), seed=5).items()}
    return quantize_state(state, block=32) if fp8 else state


def _worker(rank, world_size, ports, bucket_bytes):
    return {fp8: _sync(rank, world_size, ports[fp8], fp8, bucket_bytes) for fp8 in (False, True)}


def _sync(rank, world_size, port, fp8, bucket_bytes):
    from megatron_rl.weight_sync.distributed import (
        BroadcastWeightSender,
        buckets,
        init_weight_update_group,
        receive_broadcast,
    )

    state = _state(fp8)
    if rank == 0:
        engines = [_RecordingEngine() for _ in ENGINE_TP]
        sender = BroadcastWeightSender(engines, ENGINE_TP, master_address="127.0.0.1", master_port=port,
                                       backend="gloo", bucket_bytes=bucket_bytes)
        stats = sender.push(state.items(), version=7)
        sender.close()
        return {"calls": [e.calls for e in engines], "stats": stats}
    group = init_weight_update_group("127.0.0.1", port, rank, world_size, backend="gloo")
    received = {}
    for bucket in buckets(state.items(), bucket_bytes):  # the names/dtypes/shapes the server was told
        received.update(receive_broadcast(group, [n for n, _ in bucket], [str(t.dtype)[6:] for _, t in bucket],
                                          [list(t.shape) for _, t in bucket], backend="gloo"))
    torch.distributed.destroy_process_group(group)
    return received


def _check(results, fp8):
    state = _state(fp8)
    results = [r[fp8] for r in results]
    sender = results[0]
    for received in results[1:]:  # every TP worker of every engine holds every tensor, bit for bit
        assert list(received) == list(state)
        for name, tensor in state.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name].view(torch.uint8),
                                                                        tensor.view(torch.uint8)), name
    init_calls = [calls[0] for calls in sender["calls"]]
    # rank offsets: engine 0's worker is rank 1, engine 1's two workers ranks 2 and 3; world 4
    assert [c[1][2] for c in init_calls] == [1, 2] and all(c[1][3] == 4 for c in init_calls)
    updates = [c for c in sender["calls"][0] if c[0] == "update"]
    assert len(updates) == sender["stats"]["weight_sync/buckets"] > 1
    # the new version rides on the last bucket only (SGLang labels tokens with it from that bucket on)
    assert [n for u in updates for n in u[1]] == list(state)
    assert [u[4] for u in updates] == [None] * (len(updates) - 1) + [7]
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    assert sender["stats"]["weight_sync/bytes"] == nbytes
    return nbytes


def test_broadcast_weight_sync_bf16_and_fp8():
    results = run_distributed(_worker, 1 + sum(ENGINE_TP), {False: free_port(), True: free_port()}, 16 << 10,
                              timeout=120)
    bf16 = _check(results, fp8=False)
    fp8 = _check(results, fp8=True)
    assert fp8 < 0.6 * bf16  # fp8 projections + fp32 block scales: about half the bytes


def test_engine_pool_spreads_groups_and_updates_every_replica(tiny_arch):
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
    from megatron_rl.rollout.native import NativeEngine
    from megatron_rl.rollout.pool import EnginePool
    from tests.helpers import prompt, tiny_state

    state = tiny_state(tiny_arch, seed=1)
    config = NativeEngineConfig(max_batch_size=8, max_seq_len=64, prepack_weights=False)
    engines = [NativeEngine(tiny_arch, state, config=config) for _ in range(2)]
    with EnginePool(engines) as pool:
        requests = [GenerateRequest(request_id=f"g{i}", prompt_ids=prompt(i, 5, tiny_arch.vocab_size),
                                    sampling=SamplingParams(max_new_tokens=4, n=2, seed=i)) for i in range(4)]
        futures = pool.submit(requests)
        assert pool._in_flight == [4, 4]  # two groups of two samples on each replica
        completions = pool.wait(futures)
        assert len(completions) == 8 and all(len(c.output_ids) >= 1 for c in completions)
        # same seeds on one engine alone give the same samples: the pool only routes
        with NativeEngine(tiny_arch, state, config=config) as single:
            alone = single.generate(requests)
        assert [c.request_id for c in completions] == [c.request_id for c in alone]  # order kept
        assert [c.output_ids for c in completions] == [c.output_ids for c in alone]
        assert pool._in_flight == [0, 0]
        changed = {k: v * 0.5 for k, v in state.items()}
        pool.update_weights(changed, version=3)
        assert pool.version == 3 and all(e.version == 3 for e in engines)
        name = "model.layers.0.mlp.up_proj.weight"
        assert all(torch.equal(e.named_weights([name])[name], changed[name]) for e in engines)


def test_wait_until_ready_polls_and_names_the_laggards():
    import pytest

    from megatron_rl.rollout.pool import wait_until_ready

    class Slow:
        base_url = "http://gen7:30000"

        def __init__(self, ready_after):
            self.calls, self.ready_after = 0, ready_after

        def health(self):
            self.calls += 1
            return {"ok": self.calls > self.ready_after}

    engines = [Slow(0), Slow(2)]
    wait_until_ready(engines, timeout=5, poll_s=0.01)
    assert [e.calls for e in engines] == [1, 3]
    with pytest.raises(RuntimeError, match="1 engine\\(s\\) not ready after 0 s: http://gen7:30000"):
        wait_until_ready([Slow(10**6)], timeout=0.05, poll_s=0.01)


def _versions(count: int) -> list[dict[str, torch.Tensor]]:
    """fp32 weights after `count` optimizer-like steps (a few bf16 values cross a rounding boundary each)."""
    from megatron_rl.models.arch import preset
    from tests.helpers import tiny_state

    state = tiny_state(preset("tiny"), seed=5)
    generator = torch.Generator().manual_seed(9)
    out = []
    for _ in range(count):
        state = {n: t + 1e-3 * t.abs().mean() * torch.randn(t.shape, generator=generator) for n, t in state.items()}
        out.append(state)
    return out


def _delta_sync(rank, world_size, port):
    """Rank 0 sends each version by delta (bf16 receiver) over the broadcast group; rank 1 receives what it is
    told (the wire names, as SGLang or a generator rank is told them) and applies it to its tensors."""
    from megatron_rl.weight_sync.delta import DeltaEncoder, WeightDelta, from_wire, to_wire
    from megatron_rl.weight_sync.distributed import (
        BroadcastWeightSender,
        buckets,
        init_weight_update_group,
        receive_broadcast,
    )

    versions = _versions(3)
    if rank == 0:
        engine = _RecordingEngine()
        sender = BroadcastWeightSender([engine], [1], master_address="127.0.0.1", master_port=port, backend="gloo",
                                       bucket_bytes=16 << 10)
        encoder, sent = DeltaEncoder(dtype=torch.bfloat16), []
        for version, state in enumerate(versions, start=1):
            stats = sender.push(to_wire(encoder.encode(state.items())), version=version)
            sent.append((stats["weight_sync/bytes"], encoder.stats.sent_bytes, encoder.stats.full_bytes))
        sender.close()
        return sent
    group = init_weight_update_group("127.0.0.1", port, rank, world_size, backend="gloo")
    mirror, held, after = DeltaEncoder(dtype=torch.bfloat16), {}, []
    for state in versions:  # the names, dtypes and shapes the sender announces before each bucket
        wire = list(to_wire(mirror.encode(state.items())))
        received = {}
        for bucket in buckets(wire, 16 << 10):
            received.update(receive_broadcast(group, [n for n, _ in bucket], [str(t.dtype)[6:] for _, t in bucket],
                                              [list(t.shape) for _, t in bucket], backend="gloo"))
        for name, value in from_wire(received).items():
            if isinstance(value, WeightDelta):
                value.apply_to(held[name])
            else:
                held[name] = value.clone()
        after.append({n: t.clone() for n, t in held.items()})
    torch.distributed.destroy_process_group(group)
    return after


def test_delta_syncs_over_the_broadcast_group_rebuild_every_version_bit_for_bit():
    sent, after = run_distributed(_delta_sync, 2, free_port(), timeout=120)
    for state, held in zip(_versions(3), after):
        assert held.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(held[name].view(torch.int16), tensor.to(torch.bfloat16).view(torch.int16)), name
    (first_wire, first, full), *later = sent
    assert first == full == first_wire  # the first sync is whole
    for wire, delta, full in later:  # the later ones carry what changed: what the group moved is what was counted
        assert wire == delta and 0 < delta < 0.5 * full, (wire, delta, full)
