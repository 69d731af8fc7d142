"""A generator executor in its own process: the native engine behind the `RolloutEngine` interface.

LlamaRL's disaggregated layout on one host: the trainer keeps its cores, the generator process keeps
its own, and the two run concurrently. The controller talks to it through two channels:

- requests / completions: typed records over a pair of multiprocessing queues (the loop sees only
  `submit() -> futures`, exactly like an in-process engine);
- weights: a shared-memory weight channel (`weight_sync.shared_memory`), double-buffered. The engine
  computes straight from a weight arena in named shared memory (`rollout.native.weights.weight_arena_layout`:
  HF-named tensors, each one contiguous region, fused matrices adjacent). An update writes the new
  tensors into the *other* arena (`stage_weights`, or each trainer rank writes its own shard through
  the reshard plan: `staging_index`), then `commit_weights` tells the generator to adopt that arena
  as the new version between two decode steps: no copy on the engine side. With a checksum mode,
  both sides hash every tensor and a mismatch fails loudly.

A generator that dies is detected by the receiver thread: the process is restarted from the active
arena (the latest committed version), and every request it had not finished is submitted again, so
no prompt is lost.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing.process
import os
import queue
import signal
import threading
import time
import traceback
import zlib
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

import torch
import torch.multiprocessing as mp

from megatron_rl.models.arch import ModelArch
from megatron_rl.placement.core_share import CoreShare
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.engine import (
    GenerateRequest,
    RequestLike,
    as_requests,
    wait_all,
)
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.rollout.native.weights import weight_arena_layout
from megatron_rl.types import Completion
from megatron_rl.weight_sync.shared_memory import (
    SharedBuckets,
    SharedBucketsDescriptor,
    WeightMismatchError,
    reclaim_stale,
)

log = logging.getLogger(__name__)


def tensor_checksum(tensor: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (verification mode of the weight channel)."""
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data))


def _worker(arch: ModelArch, arenas: tuple[SharedBucketsDescriptor, ...], active: int, version: int,
            config: NativeEngineConfig, tokenizer, requests: mp.Queue, results: mp.Queue, threads: int,
            core_share=None) -> None:
    # Ctrl-C reaches the whole process group: the controller stops this process (and frees its shared
    # memory) on its way out; a KeyboardInterrupt here would only print a second traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    multiprocessing.process.current_process()._config["semprefix"] = f"/mp-megatron_rl-{os.getpid()}"
    torch.set_num_threads(threads)
    _exit_with_parent(arenas)

    try:
        buffers = [SharedBuckets.attach(descriptor).buckets[0].buffer for descriptor in arenas]
        engine = NativeEngine(arch, None, weight_arena=buffers[active], tokenizer=tokenizer, version=version,
                              config=dataclasses.replace(config, num_threads=threads), core_share=core_share)
    except BaseException:
        results.put(("fatal", traceback.format_exc()))
        return
    results.put(("ready", os.getpid()))
    # The engine computes on this process's main thread (run_forever); a second thread only moves
    # messages, so torch keeps one OpenMP pool and steps never wait for a hand-off.
    server = threading.Thread(target=_serve_messages, args=(engine, buffers, requests, results), daemon=True)
    server.start()
    engine.run_forever()
    server.join(timeout=10)  # it has sent its last reply
    results.close()
    results.join_thread()
    # Skip interpreter finalization: torch's C++ destructors abort ("terminate called without an active
    # exception") on the thread pools the engine's steps left behind.
    os._exit(0)


def name_semaphores_by_owner() -> None:
    """Name this process's multiprocessing semaphores (queue locks, tqdm's lock: /dev/shm/sem.mp-...)
    for its pid, and reclaim those of dead runs (weight_sync.shared_memory.reclaim_stale): when a whole
    process group is SIGKILLed, multiprocessing's resource tracker dies with it and nobody unlinks them.
    multiprocessing takes the prefix from the process's private `_config` (there is no public setting)."""
    multiprocessing.process.current_process()._config["semprefix"] = f"/mp-megatron_rl-{os.getpid()}"
    reclaim_stale()


def _exit_with_parent(arenas: tuple[SharedBucketsDescriptor, ...]) -> None:
    """If the controller dies without closing us (SIGKILL, OOM kill), exit too instead of lingering
    as an orphan, and remove the shared-memory weight files it can no longer unlink."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        for path in (p for arena in arenas for p in arena.paths):
            try:
                os.unlink(path)
            except OSError:
                pass
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def _serve_messages(engine, arenas: list[torch.Tensor], requests, results, handlers=None) -> None:
    """The generator's side of a `RemoteEngine`: requests in, completions and replies out (queues with
    get() / put()). `handlers`: further message kinds -> functions of the message (generator ranks)."""
    handlers = handlers or {}

    def forward(sample_id: str, future: Future) -> None:
        try:
            results.put(("done", sample_id, future.result()))
        except BaseException as exc:  # a per-request error (bad prompt): report it, keep serving
            results.put(("failed", sample_id, f"{type(exc).__name__}: {exc}"))

    while True:
        message = requests.get()
        kind = message[0]
        if kind == "submit":
            try:
                futures = engine.submit(message[1])
            except BaseException as exc:
                for request in message[1]:
                    for sample_id in request.sample_ids():
                        results.put(("failed", sample_id, f"{type(exc).__name__}: {exc}"))
                continue
            ids = [sid for request in message[1] for sid in request.sample_ids()]
            for sample_id, future in zip(ids, futures):
                future.add_done_callback(lambda f, sid=sample_id: forward(sid, f))
        elif kind == "update":
            _, new_version, arena, verify = message
            try:
                engine.adopt_weight_arena(arenas[arena], new_version)
                sums = {n: tensor_checksum(t) for n, t in engine.named_weights().items()} if verify else None
                results.put(("updated", new_version, sums))
            except BaseException:
                results.put(("fatal", traceback.format_exc()))
                engine.close()
                return
        elif kind == "control":
            _, name, args = message
            try:
                results.put(("control", name, getattr(engine, name)(*args)))
            except BaseException as exc:
                results.put(("control", name, exc))
        elif kind in handlers:
            try:
                handlers[kind](message)
            except BaseException:
                results.put(("fatal", traceback.format_exc()))
                engine.close()
                return
        elif kind == "stop":
            engine.close()
            results.put(("stopped",))
            return


@dataclasses.dataclass
class _Pending:
    request: GenerateRequest
    futures: dict[str, Future]


class RemoteEngine:
    """`RolloutEngine` plumbing for a native engine served by `_serve_messages` at the other end of a
    request queue and a result queue: futures per sample, replies, control calls. Subclasses say where
    the engine lives and how weights reach it (a child process with shared memory: GeneratorProcess; a
    generator rank of the launch over torch.distributed: generator_ranks.RankGenerator)."""

    _requests: Any
    _results: Any

    def __init__(self) -> None:
        self._version = 0
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}  # request id -> request and its per-sample futures
        self._replies: queue.Queue = queue.Queue()
        self._closed = False

    def _start_receiver(self) -> None:
        self._receiver = threading.Thread(target=self._receive, name="generator-receiver", daemon=True)
        self._receiver.start()

    def _on_silence(self) -> None:
        """Called when no message arrived for a while (a subclass checks its generator is alive)."""

    def _on_broken_channel(self) -> bool:
        """The result channel failed; True to keep receiving (after a restart)."""
        return False

    def _on_fatal(self, error: RuntimeError) -> None:
        """The generator failed; whoever waits for a reply gets the error (a restarted process then
        finishes the pending requests)."""
        self._replies.put(error)

    def _receive(self) -> None:
        while not self._closed:
            try:
                message = self._results.get(timeout=0.5)
            except queue.Empty:
                if not self._closed:
                    self._on_silence()
                continue
            except (EOFError, OSError):
                if self._closed or not self._on_broken_channel():
                    return
                continue
            kind = message[0]
            if kind in ("done", "failed"):
                self._resolve(kind, message[1], message[2])
            elif kind == "fatal":
                self._on_fatal(RuntimeError(f"generator failed:\n{message[1]}"))
            else:
                self._replies.put(message)
                if kind == "stopped":
                    return

    def _resolve(self, kind: str, sample_id: str, value: Any) -> None:
        # The future is completed outside the lock: its callbacks may submit (multi-turn episodes).
        with self._lock:
            for request_id, pending in list(self._pending.items()):
                future = pending.futures.get(sample_id)
                if future is None:
                    continue
                if all(f.done() or f is future for f in pending.futures.values()):
                    del self._pending[request_id]
                break
            else:
                return
        if not future.done():
            if kind == "done":
                future.set_result(value)
            else:
                future.set_exception(ValueError(value))

    def _reply(self, expected: str, resend=None, timeout: float = 600.0):
        """Wait for the generator's answer; if it was restarted meanwhile, ask the new one again."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._replies.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"generator did not answer '{expected}' in {timeout:.0f}s")
                continue
            if isinstance(message, BaseException):
                raise message
            if message[0] == "restarted" and resend is not None:
                resend()
            elif message[0] == expected:
                return message

    # --- RolloutEngine ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[RequestLike] | GenerateRequest) -> list[Future]:
        prepared = as_requests(requests)
        futures: list[Future] = []
        with self._lock:
            for request in prepared:
                per_sample = {sid: Future() for sid in request.sample_ids()}
                self._pending[request.request_id] = _Pending(request, per_sample)
                futures.extend(per_sample.values())
            self._requests.put(("submit", prepared))
        return futures

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        return wait_all(futures, timeout)

    def generate(self, requests: Sequence[RequestLike] | GenerateRequest, timeout: float | None = None) -> list[Completion]:
        return self.wait(self.submit(requests), timeout)

    def _control(self, name: str, *args):
        send = lambda: self._requests.put(("control", name, args))  # noqa: E731
        send()
        _, _, value = self._reply("control", resend=send)
        if isinstance(value, BaseException):
            raise value
        return value

    def pause(self) -> None:
        self._control("pause")

    def resume(self) -> None:
        self._control("resume")

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        self._control("abort", None if request_ids is None else list(request_ids))

    def flush_cache(self) -> bool:
        return self._control("flush_cache")

    def health(self) -> dict[str, Any]:
        return self._control("health")

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError


class GeneratorProcess(RemoteEngine):
    """`RolloutEngine` whose engine runs in a child process (see module docstring)."""

    def __init__(self, arch: ModelArch, state: dict[str, torch.Tensor], *, tokenizer=None,
                 config: NativeEngineConfig | None = None, threads: int = 1, verify_weights: bool = False,
                 start_timeout: float = 300.0, core_share: CoreShare | None = None):
        """`core_share`: lend cores between this generator and the trainer process that owns it
        (placement/core_share.py); the trainer takes its side with `trainer_cores`."""
        self.arch = arch
        self.core_share = core_share
        self.config = config or NativeEngineConfig()
        self.tokenizer = tokenizer
        self.threads = threads
        self.verify_weights = verify_weights
        self.start_timeout = start_timeout
        self._ctx = mp.get_context("spawn")
        name_semaphores_by_owner()
        layout = weight_arena_layout(arch, torch.bfloat16 if self.config.dtype == "bf16" else torch.float32)
        self._arenas = []
        try:
            self._arenas = [SharedBuckets.create(layouts=[layout]) for _ in range(2)]
            self._active = 0  # the arena the engine computes from; the other one receives the next version
            self._views = [arena.views() for arena in self._arenas]
            self._stage(state)
            self._active = 1
            super().__init__()
            self.restarts = 0
            self._start()
        except BaseException:
            for arena in self._arenas:
                arena.unlink()
            raise
        self._start_receiver()

    # --- process management ---------------------------------------------------------------------
    def _start(self) -> None:
        self._requests = self._ctx.Queue()
        self._results = self._ctx.Queue()
        self._process = self._ctx.Process(
            target=_worker, args=(self.arch, self.shared_weights, self._active, self._version, self.config,
                                  self.tokenizer, self._requests, self._results, self.threads,
                                  self.core_share.for_role("generator") if self.core_share else None), daemon=True)
        self._process.start()
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                message = self._results.get(timeout=1.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"generator process exited with code {self._process.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError("generator process did not start in time")
                continue
            if message[0] == "ready":
                self.pid = message[1]
                return
            raise RuntimeError(f"generator process failed to start:\n{message[1]}")

    def _restart(self) -> None:
        """Replace a dead generator and resubmit every unfinished request."""
        self.restarts += 1
        log.warning(f"generator process {getattr(self, 'pid', '?')} died (exit code {self._process.exitcode}); "
                    f"restarting it from the latest weights (restart {self.restarts})")
        try:
            self._process.join(timeout=1.0)
        except Exception:
            pass
        with self._lock:
            self._start()
            unfinished = [p.request for p in self._pending.values()
                          if any(not f.done() for f in p.futures.values())]
            if unfinished:
                self._requests.put(("submit", unfinished))
        self._replies.put(("restarted",))

    @property
    def trainer_cores(self) -> CoreShare | None:
        """The trainer's side of the core share (None: fixed split)."""
        return self.core_share.for_role("trainer") if self.core_share else None

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def _on_silence(self) -> None:
        if not self._process.is_alive():
            self._restart()

    def _on_broken_channel(self) -> bool:
        self._restart()
        return True

    @property
    def shared_weights(self) -> tuple[SharedBucketsDescriptor, ...]:
        """The two weight arenas (shared memory): trainer ranks attach them and write their shards
        straight into the one at `staging_index`."""
        return tuple(arena.descriptor for arena in self._arenas)

    @property
    def staging_index(self) -> int:
        """The arena the next version is written to (the engine computes from the other one)."""
        return 1 - self._active

    def _stage(self, named_tensors: dict[str, torch.Tensor]) -> None:
        views = self._views[self.staging_index]
        named_tensors = {n: t for n, t in named_tensors.items()  # what the engine derives or ignores
                         if not n.endswith("rotary_emb.inv_freq") and not (n == "lm_head.weight" and self.arch.tie_word_embeddings)}
        unknown = sorted(set(named_tensors) - set(views))
        if unknown:
            raise ValueError(f"update_weights: unknown tensor names {unknown[:3]}")
        if set(named_tensors) != set(views):  # a partial update starts from the current weights
            torch._foreach_copy_(list(views.values()), list(self._views[self._active].values()))
        torch._foreach_copy_([views[n] for n in named_tensors], [t.detach() for t in named_tensors.values()])

    def stage_weights(self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the staging arena (the generator keeps computing from the other)."""
        items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        self._stage(items)
        return len(items)

    def commit_weights(self, version: int | None = None,
                       expected: dict[str, torch.Tensor] | None = None) -> int:
        """Have the generator adopt the staging arena as `version` (between two decode steps: in-flight
        sequences continue under the new version, recorded per token). With verification on, the
        generator's checksums are compared with `expected` (default: the staging arena's contents)."""
        new_version = self._version + 1 if version is None else int(version)
        staged = self.staging_index
        send = lambda: self._requests.put(("update", new_version, staged, self.verify_weights))  # noqa: E731
        send()
        _, applied, sums = self._reply("updated", resend=send)
        self._version, self._active = applied, staged
        if sums is not None:
            reference = expected if expected is not None else self._views[staged]
            bad = [n for n, t in reference.items() if sums.get(n) != tensor_checksum(t)]
            if bad:
                raise WeightMismatchError(f"weight sync to version {applied}: checksum mismatch on {len(bad)} "
                                          f"tensors, e.g. {bad[:3]}")
        return applied

    def update_weights(self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None) -> int:
        items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        count = self.stage_weights(items)
        self.commit_weights(version, expected=items)
        return count

    def health(self) -> dict[str, Any]:
        status = super().health()
        return {**status, "process_alive": self.alive, "restarts": self.restarts, "pid": self.pid}

    def kill(self) -> None:
        """Fault injection for tests: SIGKILL the generator process."""
        self._process.kill()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._process.is_alive():
                self._requests.put(("stop",))
                self._process.join(timeout=10)
        finally:
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            for arena in self._arenas:
                arena.unlink()
        self._receiver.join(timeout=2)
