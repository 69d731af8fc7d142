"""Weight channels from a Megatron trainer (any TP x PP x DP) to the rollout engine.

Both are planned once from the two layouts (Megatron shards -> the engine's HF tensors, `weight_sync/reshard.py`).
- `SharedMemoryWeightChannel`, to a generator process on the host: every push has each trainer rank of
  data-parallel replica 0 (with expert parallelism: of expert-data-parallel replica 0) write its own
  shard's slices straight into the generator's staging weight arena (shared memory the engine will
  compute from; no gather of the model on one rank, no copy in the engine), a barrier, and the owner
  rank commits the new version: the generator adopts that arena between two decode steps.
- `InProcessWeightChannel`, to an engine the driver holds (in-process, or the client of an SGLang
  generator group): the engine's `update_weights`, fed bucket by bucket with several trainer ranks.
- `AdapterWeightChannel`, a LoRA trainer's adapters only: into the native engine in this process, or as a
  PEFT directory that SGLang servers load (`/load_lora_adapter`).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import time
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError
from megatron_rl.models.lora_layout import peft_adapter_config, write_peft_files
from megatron_rl.ranks import broadcast_records
from megatron_rl.weight_sync.delta import DeltaEncoder, to_wire
from megatron_rl.weight_sync.reshard import EngineLayout, build_reshard_plan
from megatron_rl.weight_sync.shared_memory import SharedBuckets, WeightMismatchError, write_shard

log = logging.getLogger(__name__)


class InProcessWeightChannel:
    """Trainer -> an engine through its `update_weights` (in this process, or a client of one): the
    trainer's HF-named weights, optionally transformed first (e.g. rounded through fp8 blocks). With
    several trainer ranks the driver holds the engine (None elsewhere) and the weights reach it bucket
    by bucket (`assemble_hf_buckets`): the whole model is never gathered on one rank.

    `delta` (weight_sync/delta.py): only the changed elements go. An engine in this process is compared
    with directly (its own tensors are the baseline); a pool of generator ranks gets the deltas as plain
    named tensors over its broadcast group, against a copy the driver keeps of what it sent."""

    def __init__(self, trainer, engine, transform=None, *, bucket_bytes: int = 256 << 20, delta: bool = False):
        self.trainer = trainer
        self.engine = engine
        self.transform = transform
        self.bucket_bytes = bucket_bytes
        self.plan = build_reshard_plan(trainer.layout, EngineLayout(trainer.arch, tp=1)) \
            if dist.get_world_size() > 1 else None
        self.delta = delta_encoder(engine) if delta and engine is not None else None

    def reset(self) -> None:
        """The next push sends every byte (after a resume or a mismatch)."""
        if self.delta is not None:
            self.delta.reset()

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        self._bytes = 0
        if self.plan is None:
            state = self.trainer.export_hf_state()
            self._send(self.transform(state) if self.transform is not None else state.items(), version)
            return self._metrics(start)
        named = assemble_hf_buckets(self.trainer, self.plan, self.bucket_bytes)
        try:
            if self.engine is not None:
                # a transform (fp8 rounding) needs whole tensors by name: the one case that gathers them all
                self._send(self.transform(dict(named)).items() if self.transform is not None else named, version)
        finally:
            for _ in named:  # the other ranks take part in every bucket's collective
                pass
        return self._metrics(start)

    def _metrics(self, start: float) -> dict[str, float]:
        metrics = {"perf/weight_sync_time": time.perf_counter() - start, **self._delta_metrics()}
        if self.engine is not None and self.delta is None:
            metrics["weight_sync/sent_bytes"] = float(self._bytes)
        return metrics

    def _counted(self, named):
        """`named` ((name, tensor) pairs) passed through, its bytes added to this push's count."""
        for name, tensor in named:
            self._bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _send(self, named, version: int) -> None:
        if self.delta is None:
            self.engine.update_weights(self._counted(named.items() if isinstance(named, dict) else named), version)
            return
        try:
            changes = self.delta.encode(named.items() if isinstance(named, dict) else named)
            self.engine.update_weights(changes if self.delta.reads_receiver else to_wire(changes), version)
        except BaseException:
            self.delta.reset()  # what the engine holds is unknown now
            raise

    def _delta_metrics(self) -> dict[str, float]:
        return self.delta.stats.metrics() if self.delta is not None else {}


class AdapterWeightChannel:
    """LoRA trainer -> engines, adapters only: each push gathers them (PEFT's names; every trainer rank takes
    part). A native engine in this process applies them beside the base weights it was built with through its
    `update_adapters` (rollout/native/lora.py); engines that load PEFT directories (`load_adapters`: a pool of
    SGLang servers, `/load_lora_adapter`) get one written under `directory` per version, the previous one
    deleted once the new one is loaded. Megabytes per sync instead of the model."""

    def __init__(self, trainer, engine, directory: str | None = None):
        if trainer.lora is None:
            raise ConfigError("rollout.weight_sync: adapters needs LoRA training (trainer.lora.rank > 0)",
                              field="rollout.weight_sync")
        in_process = hasattr(engine, "update_adapters")
        if engine is not None and not in_process and not (hasattr(engine, "load_adapters") and directory):
            raise ConfigError(f"rollout.weight_sync: adapters needs the native engine in this process (the colocated "
                              f"placement) or SGLang servers (cluster.generator.urls); {type(engine).__name__} takes "
                              "merged weights (use rollout.weight_sync full)", field="rollout.weight_sync")
        self.trainer, self.engine = trainer, engine
        self.directory = None if in_process else directory
        self.scaling = trainer.lora.alpha / trainer.lora.rank
        self._written: str | None = None  # the directory of the adapters the engines serve

    def reset(self) -> None:
        """Every push sends all the adapters: nothing to forget."""

    def push(self, version: int) -> dict[str, float]:
        start = time.perf_counter()
        adapters = self.trainer.gather_peft_state(dst=0)
        if self.engine is None:
            return {}
        if self.directory is None:
            self.engine.update_adapters(adapters, scaling=self.scaling, version=version)
        else:
            self.engine.load_adapters(self._write(adapters, version), version)
        return {"perf/weight_sync_time": time.perf_counter() - start,
                "weight_sync/sent_bytes": float(sum(t.numel() * t.element_size() for t in adapters.values()))}

    def _write(self, adapters: dict[str, torch.Tensor], version: int) -> str:
        """The PEFT directory of version `version` (written whole under a temporary name, then renamed)."""
        lora = self.trainer.lora
        config = peft_adapter_config(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets,
                                     base_model=getattr(self.trainer, "base_model", None))
        target = os.path.join(self.directory, f"v{version}")
        partial = target + ".partial"
        for stale in (partial, target):  # ours: a sync of this version that a crash interrupted
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(partial)
        write_peft_files(partial, adapters, config)
        os.rename(partial, target)
        previous, self._written = self._written, target
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)  # the servers hold what they loaded from it
        return target


def delta_encoder(engine) -> DeltaEncoder:
    """The delta encoder for `engine`: compared with its own tensors when it is in this process, else
    with a copy of what was sent (engines that take plain named tensors: a pool of generator ranks)."""
    if hasattr(engine, "named_weights") and hasattr(engine, "weights"):  # a native engine in this process
        return DeltaEncoder(held=lambda name: engine.named_weights((name,)).get(name), dtype=engine.dtype)
    if getattr(engine, "takes_weight_deltas", False):
        return DeltaEncoder(dtype=engine.weight_dtype)
    raise ConfigError(f"rollout.weight_sync: delta needs an engine that applies weight deltas (the native engine in "
                      f"this process, in a generator process or on generator ranks); {type(engine).__name__} does not",
                      field="rollout.weight_sync")


def shard_writer(trainer) -> tuple[bool, int, object]:
    """Which trainer ranks write the weights once: (this rank writes, its shard's index in the reshard
    plan's stage, the group of all writers). One data-parallel replica holds every shard once; with
    expert parallelism a stage's shards are the (TP, EP) ranks of one expert-data-parallel replica
    (the plan reads dense tensors from EP rank 0, each expert from the EP rank that holds it)."""
    if trainer.arch.is_moe:
        return (trainer.pg.expt_dp.rank() == 0, trainer.layout.shard_index(trainer.tp_rank, trainer.ep_rank),
                trainer.pg.tp_ep_pp)
    return trainer.pg.dp.rank() == 0, trainer.tp_rank, trainer.pg.mp


def assemble_hf_buckets(trainer, plan, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights as HF-named tensors on global rank 0, bucket by bucket; a collective that
    every trainer rank iterates to its end (rank 0 alone yields). Each writing rank (`shard_writer`)
    copies its shard's slices of the bucket's tensors (the reshard plan to one engine rank) into a
    zeroed flat buffer, and one sum-reduce over the writers assembles the bucket on rank 0: the plan
    writes every element exactly once, so the sum is the tensor."""
    writes, index, group = shard_writer(trainer)
    if not writes:
        return
    shard = trainer.shard_state()
    first = next(iter(shard.values()))
    group_size = group.size()
    shapes = plan.shapes[0]
    names = list(shapes)
    start = 0
    while start < len(names):
        end, size = start, 0
        while end < len(names) and (end == start or size + math.prod(shapes[names[end]]) * first.element_size()
                                    <= bucket_bytes):
            size += math.prod(shapes[names[end]]) * first.element_size()
            end += 1
        bucket = names[start:end]
        flat = torch.zeros(size // first.element_size(), dtype=first.dtype, device=first.device)
        views, offset = {}, 0
        for name in bucket:
            count = math.prod(shapes[name])
            views[name] = flat[offset:offset + count].view(shapes[name])
            offset += count
        write_shard(plan, trainer.pp_rank, index, shard, {0: views}, partial=True)
        if group_size > 1:
            dist.reduce(flat, dst=0, group=group)
        if dist.get_rank() == 0:
            yield from views.items()
        start = end


def cpu_tensor_group(group=None):
    """A process group that carries CPU tensors over the ranks of `group` (None: the world): `group`
    itself when its backend has gloo, else a new gloo group (collective: every rank of it calls this).
    On GPU the default world is NCCL, which carries CUDA tensors only."""
    if "gloo" in str(dist.get_backend(group)).lower():
        return group
    return dist.new_group(ranks=None if group is None else dist.get_process_group_ranks(group), backend="gloo")


def make_weight_channel(trainer, engine, transform=None, *, delta: bool = False, adapters: bool = False,
                        adapter_directory: str | None = None):
    """The channel for `engine`: its shared-memory arenas when it runs in its own process (and the
    weights go as they are), else its `update_weights`; `delta` sends only what changed, `adapters` only a
    LoRA trainer's adapters (as PEFT directories under `adapter_directory` for engines that load those).
    Collective: every trainer rank calls it, the driver (rank 0) with its engine, the others with None."""
    if adapters:
        return AdapterWeightChannel(trainer, engine, adapter_directory)
    shared = broadcast_records(transform is None and getattr(engine, "shared_weights", None) is not None)
    if shared:
        return SharedMemoryWeightChannel(trainer, engine, delta=delta)
    return InProcessWeightChannel(trainer, engine, transform, delta=delta)


class SharedMemoryWeightChannel:
    """Trainer -> generator weight sync over shared memory; collective over the trainer's world.

    `delta`: each writer compares its shard's slices with the staging arena (which holds the version
    before the engine's current one) and writes only the elements whose bits differ; the first push into
    each arena and the one after a `reset` write everything, and a delta the generator's checksums reject is
    written again at once, whole."""

    def __init__(self, trainer, generator=None, *, owner_rank: int = 0, group=None, delta: bool = False):
        """`generator` (a GeneratorProcess) is given on `owner_rank` only; every trainer rank constructs
        the channel (the buffer's descriptor is broadcast from the owner)."""
        self.trainer = trainer
        self.generator = generator
        self.owner_rank = owner_rank
        self.group = cpu_tensor_group(group)  # its collectives move CPU tensors (descriptors, counts)
        box = [generator.shared_weights if generator is not None else None]
        dist.broadcast_object_list(box, src=owner_rank, group=self.group)
        self.arenas = [SharedBuckets.attach(descriptor) for descriptor in box[0]]
        self.plan = build_reshard_plan(trainer.layout, EngineLayout(trainer.arch, tp=1))
        self.arena_views = [arena.views() for arena in self.arenas]
        self._arena_bytes = [float(sum(t.numel() * t.element_size() for t in views.values()))
                             for views in self.arena_views]  # a full sync's bytes, against which a delta is counted
        self.writes, self.shard_index, _ = shard_writer(trainer)
        self.delta = delta
        self._full_arenas: set[int] = set(range(len(self.arenas)))  # still to be written whole

    def reset(self) -> None:
        """The next push into each arena writes everything."""
        self._full_arenas = set(range(len(self.arenas)))

    def push(self, version: int) -> dict[str, float]:
        """Write every shard into the engine's buffer and commit `version`. Returns timings (owner)."""
        start = time.perf_counter()
        staging = torch.tensor([self.generator.staging_index if self.generator is not None else 0])
        dist.broadcast(staging, src=self.owner_rank, group=self.group)
        arena = int(staging)
        only_changed = self.delta and arena not in self._full_arenas
        written = 0
        if self.writes:
            written = write_shard(self.plan, self.trainer.pp_rank, self.shard_index, self.trainer.shard_state(),
                                  {0: self.arena_views[arena]}, only_changed=only_changed)
        total = torch.tensor([written], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)  # doubles as the barrier: every shard is written
        staged = time.perf_counter()
        mismatch = torch.zeros(1)
        if self.generator is not None:
            try:
                self.generator.commit_weights(version)
            except WeightMismatchError as error:
                if not only_changed:
                    raise
                log.warning(f"{error}; syncing again, every byte")
                mismatch += 1
        dist.all_reduce(mismatch, group=self.group)  # doubles as the barrier: the version is committed
        self._full_arenas.discard(arena)
        if mismatch.item():  # the engine holds wrong bytes: the same version again, written whole
            self.reset()
            return self.push(version)
        end = time.perf_counter()
        metrics = {"perf/weight_sync_time": end - start, "perf/weight_sync_write_time": staged - start,
                   "perf/weight_sync_commit_time": end - staged, "perf/weight_sync_bytes": float(total.item())}
        metrics["weight_sync/sent_bytes"] = float(total.item())
        if self.delta:
            full = self._arena_bytes[arena]
            metrics.update({"weight_sync/full_bytes": full, "weight_sync/sent_fraction": float(total.item()) / max(full, 1.0)})
        return metrics
