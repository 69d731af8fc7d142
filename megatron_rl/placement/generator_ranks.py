"""Generator executors as ranks of the launch itself: one torchrun / srun world split into trainer
ranks and generator ranks (LlamaRL's executor groups on one torch.distributed world, no Ray).

With `cluster.generator.launch_ranks: G`, the last G ranks of the launch serve rollouts instead of
training. `join_launch` splits the world on the launch's own rendezvous store:

- the trainer ranks (the first W - G) form the default process group, so Megatron's parallel state
  (TP x PP x DP) spans exactly them, as it would without generators;
- the generator ranks form a default group of their own;
- the driver (trainer rank 0) and each generator rank share a two-rank gloo group, the record link:
  requests and control calls go out, completions (tokens, behaviour log-probs, per-token weight
  versions) and replies come back, as typed records pickled over torch.distributed;
- weights travel on a broadcast group of the driver and every generator rank (NCCL between GPUs,
  gloo on CPU), joined on the first sync and fed bucket by bucket by the same `BroadcastWeightSender`
  that feeds SGLang servers. A generator rank stages the buckets and applies them at once between two
  decode steps (in-flight sequences continue under the new version, recorded per token).

Each generator rank runs a native engine on its device, loaded from `model.path`; the driver holds an
`EnginePool` of `RankGenerator` clients, which balances requests across them.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import threading
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.generator_process import RemoteEngine, _serve_messages
from megatron_rl.rollout.engine import iter_named_tensors
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.trainer.parallel import init_distributed, resolved_backend
from megatron_rl.weight_sync.distributed import (
    DEFAULT_GROUP_NAME,
    BroadcastWeightSender,
    group_on_store,
    init_weight_update_group,
    receive_broadcast,
)
from megatron_rl.weight_sync.delta import from_wire
from megatron_rl.weight_sync.fp8 import generator_weights


@dataclasses.dataclass
class LaunchRole:
    """What this rank of the launch is."""

    role: Literal["trainer", "generator"]
    """Trainer ranks run the RL loop; generator ranks serve rollouts."""
    generator_index: int = -1
    """0 .. G-1 on generator ranks."""
    record_links: list = dataclasses.field(default_factory=list)
    """Two-rank gloo groups to the other side: the driver holds one per generator rank, a generator
    rank holds its own; other trainer ranks hold none."""


_LAUNCH = LaunchRole("trainer")


def current_launch() -> LaunchRole:
    """This rank's role, as `join_launch` decided it."""
    return _LAUNCH


def trainer_world_size(generator_ranks: int) -> int:
    """Trainer ranks of this launch (WORLD_SIZE minus the generator ranks)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if generator_ranks and world - generator_ranks < 1:
        raise ConfigError(f"cluster.generator.launch_ranks={generator_ranks} leaves no trainer rank in a launch "
                          f"of {world} ranks (WORLD_SIZE); launch at least {generator_ranks + 1} ranks")
    return world - generator_ranks


def join_launch(parallel, generator_ranks: int) -> LaunchRole:
    """Join the launch's world as a trainer or a generator rank (see the module docstring)."""
    global _LAUNCH

    if generator_ranks == 0:
        init_distributed(parallel)
        _LAUNCH = LaunchRole("trainer")
        return _LAUNCH
    if "RANK" not in os.environ:
        raise ConfigError(f"cluster.generator.launch_ranks={generator_ranks} needs a launch of several ranks "
                          f"(torchrun / srun); this process was started alone")
    trainers = trainer_world_size(generator_ranks)
    timeout = datetime.timedelta(minutes=parallel.timeout_minutes)
    store, rank, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = resolved_backend(parallel)
    if rank < trainers:
        dist.init_process_group(backend, store=dist.PrefixStore("megatron_rl/trainers", store), rank=rank,
                                world_size=trainers, timeout=timeout)
        links = ([group_on_store(store, 0, 2, group_name=f"megatron_rl/records/{i}", backend="gloo", timeout=timeout)
                  for i in range(generator_ranks)] if rank == 0 else [])
        _LAUNCH = LaunchRole("trainer", record_links=links)
    else:
        index = rank - trainers
        dist.init_process_group(backend, store=dist.PrefixStore("megatron_rl/generators", store), rank=index,
                                world_size=generator_ranks, timeout=timeout)
        link = group_on_store(store, 1, 2, group_name=f"megatron_rl/records/{index}", backend="gloo", timeout=timeout)
        _LAUNCH = LaunchRole("generator", generator_index=index, record_links=[link])
    return _LAUNCH


class RecordLink:
    """A queue between two ranks over their two-rank group: `put` pickles a record to the peer; a
    receiver thread takes the peer's records into a local queue that `get` reads. The receiver ends
    after a record whose kind (first element) is in `last` (the peer's final message)."""

    def __init__(self, group, *, peer: int, last: Iterable[str]):
        self.group, self.peer = group, peer
        self._last = frozenset(last)
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._receiver = threading.Thread(target=self._receive, name="record-link", daemon=True)
        self._receiver.start()

    def put(self, record: tuple) -> None:
        with self._send_lock:
            dist.send_object_list([record], dst=self.peer, group=self.group)

    def get(self, timeout: float | None = None) -> tuple:
        return self._inbox.get(timeout=timeout)

    def _receive(self) -> None:
        while True:
            box: list[Any] = [None]
            try:
                dist.recv_object_list(box, src=self.peer, group=self.group)
            except Exception as exc:  # the peer is gone: surface it to the reader
                self._inbox.put(("fatal", f"record link to rank {self.peer} failed: {exc}"))
                return
            self._inbox.put(box[0])
            if box[0][0] in self._last:
                return


class RankGenerator(RemoteEngine):
    """The driver's client of one generator rank: a `RolloutEngine` over the record link, and a
    `DistributedWeightReceiver` (weight_sync/distributed.py) whose buckets the rank stages and then
    applies as one version in `finish_weights_update`."""

    def __init__(self, link_group, index: int):
        super().__init__()
        self.index = index
        self._requests = self._results = RecordLink(link_group, peer=1, last={"stopped", "fatal"})
        self._start_receiver()

    takes_weight_deltas = True  # its rank rebuilds them from the plain named tensors it receives

    def _on_fatal(self, error: RuntimeError) -> None:
        # A generator rank is not restarted (the launch owns it): every waiting request fails now.
        super()._on_fatal(error)
        with self._lock:
            pending, self._pending = self._pending, {}
        for request in pending.values():
            for future in request.futures.values():
                if not future.done():
                    future.set_exception(error)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP_NAME, backend: str = "nccl") -> None:
        self._requests.put(("join_weights", master_address, master_port, rank_offset, world_size, group_name, backend))
        self._reply("joined")

    def update_weights_from_distributed(self, names, dtypes, shapes, version=None, group_name=DEFAULT_GROUP_NAME,
                                        flush_cache=True) -> None:
        self._requests.put(("receive_weights", list(names), list(dtypes), [list(s) for s in shapes]))
        self._reply("received")

    def finish_weights_update(self, version: int | None) -> None:
        self._requests.put(("commit_weights", version))
        self._version = self._reply("updated")[1]

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        """Without a broadcast group: the tensors travel pickled over the record link (small models)."""
        self._requests.put(("weights", version, {n: t.detach().cpu() for n, t in iter_named_tensors(named_tensors)}))
        self._version = self._reply("updated")[1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._requests.put(("stop",))
            self._reply("stopped", timeout=120)
        finally:
            self._closed = True


class _StagedWeights:
    """A generator rank's side of the weight broadcast group."""

    def __init__(self, engine, link: RecordLink):
        self.engine, self.link = engine, link
        self.group = None
        self.backend = "gloo"
        self.staged: dict[str, torch.Tensor] = {}

    def handlers(self) -> dict:
        return {"join_weights": self.join, "receive_weights": self.receive, "commit_weights": self.commit,
                "weights": self.replace}

    def join(self, message: tuple) -> None:
        _, master_address, master_port, rank_offset, world_size, group_name, backend = message
        self.backend = backend
        self.group = init_weight_update_group(master_address, master_port, rank_offset, world_size,
                                              group_name=group_name, backend=backend)
        self.link.put(("joined",))

    def receive(self, message: tuple) -> None:
        _, names, dtypes, shapes = message
        self.staged.update(receive_broadcast(self.group, names, dtypes, shapes, backend=self.backend,
                                             device=self.engine.device))
        self.link.put(("received",))

    def commit(self, message: tuple) -> None:
        version = message[1]
        staged, self.staged = self.staged, {}
        self.engine.update_weights(from_wire(staged), version)
        self.link.put(("updated", self.engine.version, None))

    def replace(self, message: tuple) -> None:
        _, version, named = message
        self.engine.update_weights(from_wire(named), version)
        self.link.put(("updated", self.engine.version, None))


def serve_generator_rank(config, role: LaunchRole) -> None:
    """A generator rank's whole life: load the model, serve the driver until it says stop."""
    model = load_pretrained(config.model.path)
    engine = NativeEngine(model.arch, generator_weights(model.state, config.cluster.generator), tokenizer=model.tokenizer,
                          config=rollout_engine_config(config))
    del model
    link = RecordLink(role.record_links[0], peer=0, last={"stop"})
    weights = _StagedWeights(engine, link)
    # The engine computes on this rank's main thread; the message thread only moves records.
    server = threading.Thread(target=_serve_messages, args=(engine, [], link, link, weights.handlers()),
                              name="generator-rank-messages", daemon=True)
    server.start()
    engine.run_forever()
    server.join(timeout=30)


def generator_rank_pool(config):
    """The driver's engine: an EnginePool over the launch's generator ranks, weights by broadcast."""
    if not _LAUNCH.record_links:
        raise RuntimeError("generator_rank_pool() on a rank without record links (not the driver of a launch "
                           "with cluster.generator.launch_ranks)")
    engines = [RankGenerator(group, i) for i, group in enumerate(_LAUNCH.record_links)]
    backend = resolved_backend(config.trainer.parallel)

    def sender() -> BroadcastWeightSender:
        return BroadcastWeightSender(engines, [1] * len(engines), master_address=os.environ["MASTER_ADDR"],
                                     master_port=config.cluster.generator.weight_update_group_port, backend=backend,
                                     group_name="megatron_rl/generator_weights")

    return EnginePool(engines, weight_sender_factory=sender)


def rollout_engine_config(config):
    """The run's native-engine config, recording MoE routing when the run does (`RunConfig.records_routing`)."""
    return dataclasses.replace(config.engine, record_routing=config.records_routing)
