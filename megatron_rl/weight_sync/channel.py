"""The weight channel from a Megatron trainer (any TP x PP x DP) to a generator process on the host.

Planned once from the two layouts (Megatron shards -> the engine's HF tensors, `kernels.reshard`);
then every push has each trainer rank of data-parallel replica 0 write its own shard's slices
straight into the generator's staging weight arena (shared memory the engine will compute from; no
gather of the model on one rank, no copy in the engine), a barrier, and the owner rank commits the
new version: the generator adopts that arena between two decode steps.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_rl.controller.ranks import broadcast_records
from megatron_rl.kernels.reshard import EngineLayout, build_reshard_plan
from megatron_rl.weight_sync.shared_memory import SharedBuckets, write_shard


class InProcessWeightChannel:
    """Trainer -> an engine through its `update_weights` (in this process, or a client of one): the
    trainer's HF-named weights, optionally transformed first (e.g. rounded through fp8 blocks). With
    several trainer ranks the shards are gathered to the driver, which holds the engine (None elsewhere)."""

    def __init__(self, trainer, engine, transform=None):
        self.trainer = trainer
        self.engine = engine
        self.transform = transform

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        state = self.trainer.export_hf_state() if dist.get_world_size() == 1 else self.trainer.gather_hf_state(dst=0)
        if self.engine is not None:
            self.engine.update_weights(self.transform(state) if self.transform is not None else state, version)
        return {"perf/weight_sync_time": time.perf_counter() - start}


def make_weight_channel(trainer, engine, transform=None):
    """The channel for `engine`: its shared-memory arenas when it runs in its own process (and the
    weights go as they are), else its `update_weights`. Collective: every trainer rank calls it, the
    driver (rank 0) with its engine, the others with None."""
    shared = broadcast_records(transform is None and getattr(engine, "shared_weights", None) is not None)
    if shared:
        return SharedMemoryWeightChannel(trainer, engine)
    return InProcessWeightChannel(trainer, engine, transform)


class SharedMemoryWeightChannel:
    """Trainer -> generator weight sync over shared memory; collective over the trainer's world."""

    def __init__(self, trainer, generator=None, *, owner_rank: int = 0, group=None):
        """`generator` (a GeneratorProcess) is given on `owner_rank` only; every trainer rank constructs
        the channel (the buffer's descriptor is broadcast from the owner)."""
        self.trainer = trainer
        self.generator = generator
        self.owner_rank = owner_rank
        self.group = group
        box = [generator.shared_weights if generator is not None else None]
        dist.broadcast_object_list(box, src=owner_rank, group=group)
        self.arenas = [SharedBuckets.attach(descriptor) for descriptor in box[0]]
        self.plan = build_reshard_plan(trainer.layout, EngineLayout(trainer.arch, tp=1))
        self.arena_views = [arena.views() for arena in self.arenas]
        self.writes = trainer.pg.dp.rank() == 0  # one data-parallel replica holds every shard once

    def push(self, version: int) -> dict[str, float]:
        """Write every shard into the engine's buffer and commit `version`. Returns timings (owner)."""
        start = time.perf_counter()
        staging = torch.tensor([self.generator.staging_index if self.generator is not None else 0])
        dist.broadcast(staging, src=self.owner_rank, group=self.group)
        written = 0
        if self.writes:
            written = write_shard(self.plan, self.trainer.pp_rank, self.trainer.tp_rank,
                                  self.trainer.shard_state(), {0: self.arena_views[int(staging)]})
        total = torch.tensor([written], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)  # doubles as the barrier: every shard is written
        staged = time.perf_counter()
        if self.generator is not None:
            self.generator.commit_weights(version)
        dist.barrier(group=self.group)
        end = time.perf_counter()
        return {"perf/weight_sync_time": end - start, "perf/weight_sync_write_time": staged - start,
                "perf/weight_sync_commit_time": end - staged, "perf/weight_sync_bytes": float(total.item())}
