"""Weight sync to SGLang engines over a dedicated NCCL group (`update_weights_from_distributed`).

On a cluster the generator group's engines are SGLang servers on their own nodes. Trainer rank 0 and
every GPU worker of every engine form one extra process group, independent of the trainer's
torch.distributed world (its own TCP rendezvous, `group_name` as the store prefix), exactly as
SGLang's `init_weights_update_group(master_address, master_port, rank_offset, world_size,
group_name, backend)` builds its side: engine e's TP worker t joins as rank 1 + (sum of the TP sizes of
engines before e) + t. A sync then runs, bucket by bucket: every engine is told the names, dtypes and
shapes (`update_weights_from_distributed`, which returns once its workers received them), and rank 0
broadcasts each tensor in that order.

SGLang 0.5.23's rules (managers/scheduler_components/weight_updater.py, tokenizer_control_mixin.py;
docs/gpu.md): updates are refused outside a `begin_weight_update` / `end_weight_update` session, so
every engine's session is opened (and checked) before rank 0 broadcasts anything: a refused bucket
would leave rank 0 in a broadcast no receiver matches. Unless the engine is paused, every update call
takes its writer lock, which waits for all running requests; so a sync pauses an engine nobody paused
(in_place: running requests keep their KV and continue under the new weights) and resumes it after.
The new weight_version rides on the last bucket only, so no token is labelled with a version whose
weights have not all arrived, and no decode step runs between buckets (the engine is paused). The
cache is flushed with the last bucket only where the pause freed the running requests (retract or
abort, the controller's `weight_update: pause`): SGLang refuses to flush while requests run.

`receive_broadcast` is the receiving side as SGLang's model runner performs it (allocate each tensor,
broadcast from rank 0), used by the tests as the stand-in engine on CPU with gloo.

With fp8 engines (`cluster.generator.precision: fp8`) the projection matrices travel as
float8_e4m3fn plus `weight_scale_inv` tensors (weight_sync/fp8.py), half the bytes of bf16.
"""
from __future__ import annotations

import datetime
import inspect
import threading
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

DEFAULT_GROUP_NAME = "weight_update_group"


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                             group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl",
                             timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
    """Join (rank 0: create) a process group outside the default world, with SGLang's rendezvous:
    a TCP store at master_address:master_port (rank 0 serves it), prefixed by group_name."""
    # The store is built directly: torch's tcp:// rendezvous turns rank 0 into a client as well inside a
    # torchrun worker (it expects torchrun's own agent store), and the group would never form.
    store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout=timeout)
    return group_on_store(store, rank, world_size, group_name=group_name, backend=backend, timeout=timeout)


def group_on_store(store, rank: int, world_size: int, *, group_name: str, backend: str,
                   timeout: datetime.timedelta = datetime.timedelta(minutes=30)):
    """A process group of `world_size` ranks outside the default world, rendezvousing on `store` under
    the prefix `group_name`. Its ranks are its own (0 .. world_size - 1): pass them as `src` / `dst`."""
    # torch's private process-group helpers move between releases: looked up when a group is made.
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )

    store = PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options (2.6); pass whichever this torch has.
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters \
        else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class DistributedWeightReceiver(Protocol):
    """An engine that takes weights over the group (SGLangEngine, or `SGLangServer` over HTTP)."""

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> None: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        version: int | None = None, group_name: str = DEFAULT_GROUP_NAME,
                                        flush_cache: bool = False) -> None: ...


@runtime_checkable
class WeightUpdateSession(Protocol):
    """A receiver with SGLang's session rules: begin / buckets / end, paused around them."""

    @property
    def paused_mode(self) -> str | None: ...

    def pause(self, mode: str) -> None: ...

    def resume(self) -> None: ...

    def begin_weight_update(self) -> None: ...

    def end_weight_update(self) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_tensor(tensor: torch.Tensor, backend: str) -> torch.Tensor:
    """gloo has no 1-byte float types: move fp8 as its bytes (NCCL sends float8 as it is)."""
    if backend == "gloo" and tensor.element_size() == 1 and tensor.is_floating_point():
        return tensor.view(torch.uint8)
    return tensor


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class BroadcastWeightSender:
    """Trainer rank 0's side: creates the group with every engine and broadcasts weights into them."""

    def __init__(self, engines: Sequence[DistributedWeightReceiver], engine_tp: Sequence[int], *,
                 master_address: str, master_port: int, group_name: str = DEFAULT_GROUP_NAME,
                 backend: str = "nccl", bucket_bytes: int = 1 << 30, device: torch.device | None = None):
        if len(engines) != len(engine_tp):
            raise ValueError("one TP size per engine")
        self.engines = list(engines)
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        world_size = 1 + sum(engine_tp)
        offsets = [1 + sum(engine_tp[:i]) for i in range(len(engines))]
        # The engines' init calls return only once the group exists, so they run beside our own join.
        calls = run_all([lambda e=e, o=o: e.init_weights_update_group(master_address, master_port, o, world_size,
                                                                         group_name, backend)
                          for e, o in zip(self.engines, offsets)])
        self.group = init_weight_update_group(master_address, master_port, 0, world_size, group_name=group_name,
                                              backend=backend)
        calls.join()

    def push(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> dict[str, float]:
        """Broadcast every tensor to every engine, bucket by bucket, as one weight version (see the module
        docstring); returns bytes and bucket counts."""
        sessions = [e for e in self.engines if isinstance(e, WeightUpdateSession)]
        paused_here = [e for e in sessions if e.paused_mode is None]
        flush = {id(e): e.paused_mode in ("retract", "abort") for e in sessions}
        run_all([lambda e=e: e.pause("in_place") for e in paused_here]).join()
        opened: list[Any] = []
        try:
            for engine in sessions:
                engine.begin_weight_update()
                opened.append(engine)
            stats = self._broadcast(named, version, flush)
            ended, opened = opened, []
            run_all([lambda e=e: e.end_weight_update() for e in ended]).join()
        finally:
            if opened:  # a failed sync: close the sessions so the next one can begin (best effort)
                run_all([lambda e=e: e.end_weight_update() for e in opened])
            run_all([lambda e=e: e.resume() for e in paused_here]).join()
        # Receivers that stage buckets (generator ranks) apply them all at once here; SGLang has
        # applied each bucket as it arrived.
        run_all([lambda e=e: e.finish_weights_update(version) for e in self.engines
                  if hasattr(e, "finish_weights_update")]).join()
        return stats

    def _broadcast(self, named, version, flush: dict[int, bool]) -> dict[str, float]:
        total = count = 0
        for bucket, last in _with_last(buckets(named, self.bucket_bytes)):
            names = [n for n, _ in bucket]
            dtypes = [dtype_name(t.dtype) for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            calls = run_all([lambda e=e: e.update_weights_from_distributed(
                names, dtypes, shapes, version if last else None, self.group_name,
                flush_cache=last and flush.get(id(e), False)) for e in self.engines])
            for _, tensor in bucket:
                payload = wire_tensor(tensor.detach().to(self.device).contiguous(), self.backend)
                dist.broadcast(payload, src=0, group=self.group)
                total += payload.numel() * payload.element_size()
            calls.join()
            count += 1
        return {"weight_sync/bytes": float(total), "weight_sync/buckets": float(count)}

    def close(self) -> None:
        dist.destroy_process_group(self.group)


def receive_broadcast(group, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *,
                      backend: str = "nccl", device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The engine side, as SGLang's model runner does it: allocate each tensor, take it from rank 0."""
    out = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(wire_tensor(tensor, backend), src=0, group=group)
        out[name] = tensor
    return out


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last (one item of lookahead)."""
    iterator = iter(items)
    try:
        previous = next(iterator)
    except StopIteration:
        return
    for item in iterator:
        yield previous, False
        previous = item
    yield previous, True


class _Calls:
    """Calls running in threads (`run_all`); `errors`: what those that failed raised, so far."""

    def __init__(self, threads: list[threading.Thread], errors: list[BaseException]):
        self.threads, self.errors = threads, errors

    def join(self) -> None:
        for thread in self.threads:
            thread.join()
        if self.errors:
            raise self.errors[0]


def run_all(functions: list[Callable[[], Any]]) -> _Calls:
    """Each function in a thread of its own (calls that return only once the caller has broadcast what they
    wait for); `join()` waits for all of them and raises the first error."""
    errors: list[BaseException] = []

    def guard(fn):
        try:
            fn()
        except BaseException as exc:  # surfaced by join()
            errors.append(exc)

    threads = [threading.Thread(target=guard, args=(fn,), daemon=True) for fn in functions]
    for thread in threads:
        thread.start()
    return _Calls(threads, errors)
