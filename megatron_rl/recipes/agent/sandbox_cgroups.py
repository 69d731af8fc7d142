"""Per-call cgroups of the agent sandbox: limits that bind a call's whole process tree, not each process.

rlimits are per process (six children of 90 MiB each pass a 128 MiB address-space limit) and RLIMIT_NPROC
binds neither root nor a user's other processes fairly; a cgroup made for one call and removed after it
counts every process the call starts. Used where this process may make child cgroups of its own: cgroup v2
with the controllers delegated to our cgroup's subtree, or cgroup v1 hierarchies we can write (root in most
containers). Elsewhere `CallCgroup.create` returns None and the sandbox reports the rlimits as the fallback.

A call's cgroup is named `mrl-sandbox-<pid of the owning process>-<n>`; those of a process that no longer
exists (a killed trainer) are emptied and removed the next time any process sets up its first call.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import os
import queue
import re
import select
import signal
import threading
import time

logger = logging.getLogger(__name__)

CONTROLLERS = ("memory", "pids", "cpu")
PREFIX = "mrl-sandbox-"
CPU_PERIOD_US = 100_000
_counter = itertools.count()
_swept = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """A cgroup hierarchy where this process may make child cgroups: its version, the controllers it serves
    to us, and our own cgroup's directory (the parent of the calls' cgroups)."""

    version: int
    controllers: tuple[str, ...]
    base: str


def _own_cgroups() -> dict[str, str]:
    """Controller name ('' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    return own


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, type, super options) of every cgroup / cgroup2 mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            separator = fields.index("-")
            fstype, options = fields[separator + 1], fields[separator + 3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4].replace("\\040", " "), fstype, set(options.split(","))))
    return found


def _writable(base: str) -> bool:
    probe = os.path.join(base, f"{PREFIX}probe-{os.getpid()}-{threading.get_ident()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        pass
    return True


def _v2_controllers(base: str) -> set[str]:
    """The wanted controllers our cgroup can hand to children: enabled in its subtree_control, enabling
    them where the kernel lets us (at the root of a cgroup namespace it does; elsewhere our own processes
    in the cgroup forbid it)."""
    def read(name: str) -> set[str]:
        with open(os.path.join(base, name)) as f:
            return set(f.read().split())
    try:
        available, enabled = read("cgroup.controllers"), read("cgroup.subtree_control")
    except OSError:
        return set()
    missing = [name for name in CONTROLLERS if name in available and name not in enabled]
    if missing:
        try:
            with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{name}" for name in missing))
        except OSError:
            pass
        enabled = read("cgroup.subtree_control")
    return {name for name in CONTROLLERS if name in enabled}


@functools.lru_cache(maxsize=1)
def hierarchies() -> tuple[Hierarchy, ...]:
    """Where calls' cgroups go: each wanted controller in one hierarchy (v2 preferred), if writable."""
    try:
        own, mounts = _own_cgroups(), _mounts()
    except (OSError, ValueError):
        return ()
    found: list[Hierarchy] = []
    covered: set[str] = set()

    def base_of(root: str, point: str, path: str) -> str | None:
        relative = os.path.relpath(path, root)
        return None if relative.startswith("..") else os.path.normpath(os.path.join(point, relative))

    for root, point, fstype, _ in mounts:
        if fstype == "cgroup2" and "" in own:
            base = base_of(root, point, own[""])
            if base and os.path.isdir(base):
                controllers = _v2_controllers(base)
                if controllers and _writable(base):
                    found.append(Hierarchy(2, tuple(sorted(controllers)), base))
                    covered |= controllers
            break
    for root, point, fstype, options in mounts:
        wanted = [name for name in CONTROLLERS if name in options and name not in covered]
        if fstype != "cgroup" or not wanted or wanted[0] not in own:
            continue
        base = base_of(root, point, own[wanted[0]])
        if base and os.path.isdir(base) and _writable(base):
            found.append(Hierarchy(1, tuple(wanted), base))
            covered |= set(wanted)
    return tuple(found)


def _members(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _kill_members(path: str) -> None:
    """SIGKILL every process in the cgroup: through cgroup.kill (v2, Linux 5.14+), else one by one, each
    through a pidfd taken while the process is listed as a member (so a reused pid is never signalled)."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
        return
    except OSError:
        pass
    for pid in _members(path):
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if pid in _members(path):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(pidfd)


def _remove(path: str, wait_s: float) -> bool:
    """Kill the cgroup's processes and remove it, waiting at most `wait_s` for them to be gone."""
    deadline = time.monotonic() + wait_s
    while True:
        _kill_members(path)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            select.select([], [], [], 0.005)


def _sweep_dead_owners(found: tuple[Hierarchy, ...]) -> None:
    """Remove the calls' cgroups left by processes that no longer exist."""
    for hierarchy in found:
        try:
            names = os.listdir(hierarchy.base)
        except OSError:
            continue
        for name in names:
            match = re.fullmatch(rf"{PREFIX}(\d+)-\d+", name)
            if match and not os.path.exists(f"/proc/{match.group(1)}"):
                _remove(os.path.join(hierarchy.base, name), wait_s=1.0)


class CallCgroup:
    """One call's cgroups (one per hierarchy): made with the call's limits, joined by the call's first
    process, killed and removed when the call ends."""

    def __init__(self, paths: list[tuple[Hierarchy, str]], layers: tuple[str, ...]):
        self.paths = paths
        self.layers = layers

    @classmethod
    def create(cls, memory_mb: int, processes: int, cpus: float) -> CallCgroup | None:
        found = hierarchies()
        if not found:
            return None
        if _swept.acquire(blocking=False):  # once per process; never released
            _sweep_dead_owners(found)
        name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        paths: list[tuple[Hierarchy, str]] = []
        try:
            for hierarchy in found:
                path = os.path.join(hierarchy.base, name)
                os.mkdir(path)
                paths.append((hierarchy, path))
                for controller in hierarchy.controllers:
                    _write_limit(hierarchy.version, path, controller, memory_mb, processes, cpus)
        except OSError as err:
            logger.warning("sandbox: could not set up a call's cgroup (%s); rlimits only", err)
            cls(paths, ()).remove()
            return None
        return cls(paths, tuple(f"cgroup-{c}" for h in found for c in h.controllers))

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(path, "cgroup.procs") for _, path in self.paths]

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the call for going over the memory limit."""
        for hierarchy, path in self.paths:
            if "memory" not in hierarchy.controllers:
                continue
            name = "memory.events" if hierarchy.version == 2 else "memory.oom_control"
            try:
                with open(os.path.join(path, name)) as f:
                    counts = dict(line.split() for line in f if len(line.split()) == 2)
            except OSError:
                continue
            if int(counts.get("oom_kill", 0)) > 0:
                return True
        return False

    def remove(self) -> None:
        """Kill what is left of the call now; the directories go once their processes are gone (a
        background thread waits for that, off the call's path)."""
        for _, path in self.paths:
            _kill_members(path)
        _Reaper.get().put([path for _, path in self.paths])


class _Reaper:
    """One thread per process that removes calls' cgroups once the killed processes have left them."""

    _lock = threading.Lock()
    _instance: _Reaper | None = None

    def __init__(self):
        self.queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.owner = os.getpid()
        threading.Thread(target=self._run, name="sandbox-cgroup-reaper", daemon=True).start()
        atexit.register(self.drain)

    @classmethod
    def get(cls) -> _Reaper:
        with cls._lock:
            if cls._instance is None or cls._instance.owner != os.getpid():
                cls._instance = cls()
            return cls._instance

    def put(self, paths: list[str]) -> None:
        self.queue.put(paths)

    def _run(self) -> None:
        while True:
            for path in self.queue.get():
                if not _remove(path, wait_s=5.0):
                    logger.warning("sandbox: the call's cgroup %s still has processes; removed by a later start",
                                   path)

    def drain(self) -> None:
        """At exit: remove what is still queued (the thread dies with the interpreter)."""
        while True:
            try:
                paths = self.queue.get_nowait()
            except queue.Empty:
                return
            for path in paths:
                _remove(path, wait_s=1.0)


def _write_limit(version: int, path: str, controller: str, memory_mb: int, processes: int, cpus: float) -> None:
    def write(name: str, value) -> None:
        with open(os.path.join(path, name), "w") as f:
            f.write(str(value))
    memory = memory_mb << 20
    if controller == "memory":
        if version == 2:
            write("memory.max", memory)
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                write("memory.swap.max", 0)
        else:
            write("memory.limit_in_bytes", memory)
            if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                write("memory.memsw.limit_in_bytes", memory)
    elif controller == "pids":
        write("pids.max", processes)
    elif controller == "cpu":
        quota = max(int(cpus * CPU_PERIOD_US), 1000)
        if version == 2:
            write("cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            write("cpu.cfs_period_us", CPU_PERIOD_US)
            write("cpu.cfs_quota_us", quota)
