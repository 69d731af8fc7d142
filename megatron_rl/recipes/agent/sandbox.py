"""Run a tool's code in a separate, contained process: the agent recipe's sandbox (docs/agents.md).

Each call runs in fresh processes forked from a per-process fork server (`sandbox_child.py`, stdlib only,
never runs tool code itself; forking a warm interpreter instead of starting one per call saves the
interpreter's start-up, 40+ ms of CPU a call). The layers, each where the kernel grants it (to an
unprivileged user too); `Sandbox.containment()` names those active here:
- a new session; rlimits (address space, CPU seconds, file size, no core dumps) on every process;
- per-call cgroups (sandbox_cgroups.py): memory, process count and CPU bind the call's whole process tree;
  where this process may not make cgroups the rlimits are all there is, and the report says so;
- a wall-time limit: on expiry the tool's process and its process group are SIGKILLed; inside a PID
  namespace the tool's process is PID 1, so the kernel kills everything it started when it ends;
- user + network + PID + mount namespaces: a private root that holds only what the tool needs, read-only
  (the system's programs and libraries, the interpreter and its packages, this package, `read_only`), the
  writable scratch directory (cwd, HOME, TMPDIR), a minimal /dev and its own /proc; nothing else of the
  host (the user's home, the run's checkpoints, other sockets) exists for the tool;
- Landlock: file-system changes only below the scratch directory, reads only of what is visible, no TCP
  connect/bind, no signals or abstract unix sockets out of the sandbox, no mounts; capabilities dropped;
- always: an audit hook (`sys.addaudithook`) that refuses, with a clear message, socket use and writes
  outside the scratch directory; without the kernel layers it also refuses process creation, signals to
  other processes and ctypes.

The parent trusts no byte the tool can write: pids and exit statuses come from process A over a channel the
tool never holds, the tool's own channel yields one result at most, and the parent only ever signals the
call's own processes (B by a pidfd taken before the tool starts, A's group while A is alive, the call's
cgroup). Clean-up never follows a link the tool left.

What this is not: the audit hook alone is no security boundary (native code, ctypes or a C extension
bypasses it), so without the namespaces and Landlock the sandbox only contains honest mistakes of a
model's code. Disk use is bounded per file (`memory_mb`), not in total; GPU devices are not passed in.

A tool failure, timeout or limit becomes `SandboxResult.error` (one line); nothing here raises for what
the sandboxed code does.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import os
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from megatron_rl.config import ConfigError, require
from megatron_rl.recipes.agent.sandbox_cgroups import CallCgroup

logger = logging.getLogger(__name__)

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
EXIT_MEMORY = 3  # the tool process's exit code when it ran out of memory before it could send a result
_READ_CHUNK = 1 << 16
_MAX_MESSAGE_BYTES = 16 << 20  # a `call`'s return value travels as one JSON line of at most this size
_KILL_WAIT_S = 5.0  # at most this long for a killed tool process to be gone
_SERVER_START_S = 60.0
# imported once by the fork server, before any tool code runs, so that `call`s into them skip the import
PRELOAD_MODULES = ("megatron_rl.recipes.agent.arithmetic",)
# what a tool sees of the host, read-only, besides the interpreter, its packages and `read_only`
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives",
             "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/ssl", "/etc/ca-certificates",
             "/etc/mime.types")
# `agent.sandbox.require`: a group is there when all of its layers are active
BACKENDS = ("native", "bubblewrap")
LAYER_GROUPS = {"namespaces": ("userns", "pidns", "mountns"), "landlock": ("landlock-fs", "landlock-read"),
                "cgroups": ("cgroup-memory", "cgroup-pids")}


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed call (memory, processes and CPU bind the whole call where cgroups can be
    made, each process otherwise), and what of the host it may read."""

    wall_time_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 4000
    network: bool = False
    processes: int = 64
    cpus: float = 1.0
    read_only: tuple[str, ...] = ()
    """Host paths visible (read-only) besides the system's programs and libraries, the interpreter, its
    packages and this package."""
    backend: str = "native"
    """Who builds the namespaces and the private root: native (this package, through the kernel's calls)
    or bubblewrap (Debian's `bwrap`, where the kernel lets only allow-listed programs make namespaces)."""

    def __post_init__(self):
        if not self.wall_time_s > 0:
            raise ConfigError(f"sandbox limits: wall_time_s must be > 0, got {self.wall_time_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ConfigError(f"sandbox limits: memory_mb must be an integer >= 64, got {self.memory_mb!r}")
        if not (isinstance(self.output_chars, int) and self.output_chars > 0):
            raise ConfigError(f"sandbox limits: output_chars must be a positive integer, got {self.output_chars!r}")
        if not (isinstance(self.processes, int) and self.processes >= 1):
            raise ConfigError(f"sandbox limits: processes must be a positive integer, got {self.processes!r}")
        if not self.cpus > 0:
            raise ConfigError(f"sandbox limits: cpus must be > 0, got {self.cpus!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"sandbox limits: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        for path in self.read_only:
            if not os.path.isabs(path):
                raise ConfigError(f"sandbox limits: read_only paths must be absolute, got {path!r}")


@dataclasses.dataclass(kw_only=True)
class SandboxConfig:
    """`agent.sandbox`: how tool calls are contained beyond their time and memory limits."""

    require: list[str] = dataclasses.field(default_factory=list)
    """Layer groups that must be active, or the run refuses to start: namespaces (user, PID and mount: the
    host's files out of sight), landlock (file-system writes and reads refused by the kernel), cgroups
    (memory and process limits per call, not per process). Groups missing and not required are a warning."""
    read_only: list[str] = dataclasses.field(default_factory=list)
    """Host paths the tools may read (e.g. a data directory), besides the interpreter and its packages."""
    processes: int = 64
    """Processes (and threads) one call may run at once."""
    cpus: float = 1.0
    """CPU cores one call may use (a cgroup quota; where cgroups are missing, CPU seconds bound each process)."""
    backend: str = "native"
    """native: the namespaces and the private root made by this package; bubblewrap: made by Debian's
    `bwrap` (apt-get install bubblewrap), for kernels that allow namespaces only to allow-listed programs.
    Both add the cgroups, Landlock and the audit hook."""

    def __post_init__(self) -> None:
        require(self.backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}")
        for group in self.require:
            require(group in LAYER_GROUPS, "require", f"unknown layer group {group!r}; known: {', '.join(LAYER_GROUPS)}")
        self.read_only = [os.path.abspath(os.path.expanduser(path)) for path in self.read_only]
        require(self.processes >= 1, "processes", "must be >= 1")
        require(self.cpus > 0, "cpus", "must be > 0")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one sandboxed call produced. `error` is one line (None when ok); `value` is `call`'s return
    value (JSON types). `containment` names the layers that were active for the call."""

    stdout: str
    stderr: str
    ok: bool
    error: str | None = None
    value: Any = None
    containment: tuple[str, ...] = ()
    wall_s: float = 0.0


class Sandbox:
    """A private scratch directory and the calls run against it; use as a context manager (or call
    `close()`), which removes the directory. Files written by one call are seen by the next. Thread-safe:
    concurrent calls run in separate processes. `kernel_isolation=False` skips the namespaces and Landlock
    (the fallback of kernels without them: rlimits, cgroups and the strict audit hook), `private_root=False`
    the mount namespace alone (kernels that grant Landlock but no namespaces), to test those paths."""

    def __init__(self, limits: SandboxLimits | None = None, *, parent_dir: str | None = None,
                 kernel_isolation: bool = True, private_root: bool = True):
        self.limits = limits or SandboxLimits()
        self.kernel_isolation = kernel_isolation
        self.private_root = private_root
        parent_dir = parent_dir or tempfile.gettempdir()
        _sweep_dead_sandboxes(parent_dir)
        # named by this process: a later sandbox removes it if this process dies without closing it (SIGKILL)
        self._root = os.path.realpath(tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-", dir=parent_dir))
        self.scratch = os.path.join(self._root, "scratch")
        os.mkdir(self.scratch, 0o700)
        self._mount_point = os.path.join(self._root, "mnt")  # each call's private root is built on it
        os.mkdir(self._mount_point, 0o700)
        self._remove = weakref.finalize(self, _remove_tree, self._root)  # also if never closed

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._remove()

    @staticmethod
    def containment(backend: str = "native") -> tuple[str, ...]:
        """The containment layers the kernel grants here (probed once per process by an empty call)."""
        return _probe_containment(backend)

    def run_python(self, code: str) -> SandboxResult:
        """Run `code` as a `__main__` script in the sandbox; stdout/stderr are captured and truncated."""
        return self._run({"kind": "python", "code": code})

    def call(self, function: str, kwargs: dict) -> SandboxResult:
        """Import `module:function` in the sandbox and return `function(**kwargs)` as `value` (JSON types:
        kwargs and the value travel as JSON)."""
        if not isinstance(function, str) or function.count(":") != 1:
            return _failure(f"sandbox call: expected 'module:function', got {function!r}")
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError) as err:
            return _failure(f"sandbox call {function}: arguments are not JSON: {err}")
        return self._run({"kind": "call", "target": function, "kwargs": kwargs},
                         _module_paths(function.split(":")[0].split(".")[0]))

    # --- one call ------------------------------------------------------------------------------------
    def _run(self, request: dict, also_readable: tuple[str, ...] = ()) -> SandboxResult:
        if not self._remove.alive:
            raise RuntimeError("the sandbox is closed")
        limits = self.limits
        cgroup = CallCgroup.create(limits.memory_mb, limits.processes, limits.cpus)
        io_dir = tempfile.mkdtemp(prefix="io-", dir=self._root)
        request = {**request, "scratch": self.scratch, "env": self._environment(),
                   "kernel_isolation": self.kernel_isolation, "private_root": self.private_root,
                   "backend": limits.backend, "path": _import_path(), "limits": dataclasses.asdict(limits),
                   "readable": [*_host_paths(), *limits.read_only, *also_readable], "mount_point": self._mount_point,
                   "cgroup_procs": cgroup.procs_files if cgroup else [],
                   "cgroup_layers": list(cgroup.layers) if cgroup else []}
        try:
            try:
                server = _ForkServer.get()  # the first call waits here for the server to start, not on its clock
                with open(os.path.join(io_dir, "stdout"), "wb") as out, \
                        open(os.path.join(io_dir, "stderr"), "wb") as err:
                    try:
                        channels = server.start(out.fileno(), err.fileno())
                    except OSError:  # the server died since it was last checked: start a new one, once
                        channels = _ForkServer.get(restart=True).start(out.fileno(), err.fileno())
            except OSError as exc:
                return _failure(f"could not start the sandbox process: {exc}")
            started = time.monotonic()
            with _Call(*channels) as call:
                call.exchange(request, started + limits.wall_time_s)
            wall_s = time.monotonic() - started
            out_of_memory = cgroup is not None and cgroup.oom_killed()
            stdout = _read_text(os.path.join(io_dir, "stdout"), limits.output_chars)
            stderr = _read_text(os.path.join(io_dir, "stderr"), limits.output_chars)
        finally:
            if cgroup is not None:
                cgroup.remove()
            _remove_tree(io_dir)
        containment = tuple(call.contained or ())
        reply = call.result()
        if call.timed_out:
            error = f"timed out after {limits.wall_time_s:g} s"
        elif call.oversized:
            error = f"the result is larger than {_MAX_MESSAGE_BYTES >> 20} MiB"
        elif call.forged:
            error = "the tool wrote to the sandbox's result channel"
        elif out_of_memory and not (reply and reply.get("ok")):
            error = f"memory limit {limits.memory_mb} MiB exceeded"
        elif reply is not None:
            ok = bool(reply.get("ok"))
            return SandboxResult(stdout, stderr, ok, None if ok else str(reply.get("error") or "failed"),
                                 reply.get("value"), containment, wall_s)
        elif call.exit is not None:
            error = _exit_error(call.exit, limits, stderr)
        else:
            error = "the sandbox process ended without a result"
        return SandboxResult(stdout, stderr, False, error, None, containment, wall_s)

    def _environment(self) -> dict[str, str]:
        return {**_BASE_ENV, "HOME": self.scratch, "TMPDIR": self.scratch}


_BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class _Call:
    """One call's two channels, read until process A reports the tool's exit (or the deadline). From A's
    control channel: A's pid, B's pid, B's exit status. From B's result channel: the containment report
    (sent before the tool's code ran), then exactly one result; anything else there is the tool writing to
    it (`forged`). Closing the call kills what is left of it: B by its pidfd (on timeout), A's process group
    while A is alive (A waits for this, so the group's id is still the call's)."""

    def __init__(self, control: socket.socket, result: socket.socket):
        self.control, self.channel = control, result
        self.group: int | None = None
        self.group_fd: int | None = None
        self.child: int | None = None
        self.child_fd: int | None = None
        self.init_fd: int | None = None
        self.exit: int | None = None
        self.contained: list[str] | None = None
        self.results: list[dict] = []
        self.forged = self.timed_out = self.oversized = False
        self._pending = {control: bytearray(), result: bytearray()}

    def __enter__(self) -> _Call:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.child_fd is not None and (self.timed_out or self.oversized or self.exit is None):
                self._take_waiting(self.control)  # the namespace's PID 1 may have been reported meanwhile
                _kill_and_wait(self.child_fd)
                if self.init_fd is not None:  # bwrap's namespace ends with its PID 1, not with bwrap
                    _kill_and_wait(self.init_fd)
            if self.group_fd is not None and _alive(self.group_fd):
                os.killpg(self.group, signal.SIGKILL)
        except OSError:
            pass
        finally:
            for fd in (self.child_fd, self.init_fd, self.group_fd):
                if fd is not None:
                    os.close(fd)
            self.control.close()
            self.channel.close()

    def _take_waiting(self, channel: socket.socket) -> None:
        channel.setblocking(False)
        while channel in self._pending and self._receive(channel):
            pass

    def result(self) -> dict | None:
        """The tool's result: exactly one, from a tool process that then ended normally."""
        if len(self.results) == 1 and self.exit == 0 and isinstance(self.results[0], dict):
            return self.results[0]
        return None

    def exchange(self, request: dict, deadline: float) -> None:
        try:
            while self.group is None:  # A waits for the request until the parent holds its pid
                if not self._read(deadline):
                    return
            self.control.sendall(json.dumps(request).encode("utf-8") + b"\n")
            while self.exit is None:
                if not self._read(deadline):
                    return
            self._take_waiting(self.channel)  # the tool has ended: what it sent is all there
        except OSError:  # A died before it could report (its exit code is then unknown)
            pass

    def _read(self, deadline: float) -> bool:
        """Wait for an open channel and take what it has; False at the deadline or when A is gone."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.timed_out = True
            return False
        ready, _, _ = select.select(list(self._pending), [], [], remaining)
        if not ready:
            self.timed_out = True
            return False
        for channel in ready:
            if not self._receive(channel) and channel is self.control:
                return False
            if self.oversized:
                return False
        return True

    def _receive(self, channel: socket.socket) -> bool:
        try:
            chunk = channel.recv(_READ_CHUNK)
        except BlockingIOError:
            return False
        if not chunk:  # closed: not waited on again
            self._pending.pop(channel, None)
            return False
        pending = self._pending[channel]
        pending += chunk
        if b"\n" not in chunk:  # most chunks of a long result: no split, no copy
            if len(pending) > _MAX_MESSAGE_BYTES:
                self.oversized = True
            return True
        *lines, rest = pending.split(b"\n")
        self._pending[channel] = bytearray(rest)
        for line in lines:
            try:
                message = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError):
                message = None
            if channel is self.control:
                self._from_a(message)
            else:
                self._from_tool(message)
        return True

    def _from_a(self, message) -> None:
        if not isinstance(message, dict):
            return
        if isinstance(message.get("pid"), int) and self.group is None:
            self.group_fd = os.pidfd_open(message["pid"])  # A is alive: it waits for the request
            self.group = message["pid"]
        elif isinstance(message.get("child"), int) and self.child_fd is None:
            self.child_fd = os.pidfd_open(message["child"])  # B is alive: it waits for our go
            self.child = message["child"]
            self.control.sendall(b"g")
        elif isinstance(message.get("init"), int) and self.child_fd is not None and self.init_fd is None:
            self.init_fd = _pidfd_of_child(message["init"], self.child, self.child_fd)
        elif isinstance(message.get("exit"), int):
            self.exit = message["exit"]

    def _from_tool(self, message) -> None:
        if self.contained is None and isinstance(message, dict) and set(message) == {"contained"}:
            self.contained = [str(layer) for layer in message["contained"]]
        elif isinstance(message, dict) and set(message) == {"result"} and self.contained is not None:
            self.results.append(message["result"])
            self.forged = self.forged or len(self.results) > 1
        else:
            self.forged = True


def _alive(pidfd: int) -> bool:
    """A pidfd becomes readable when its process has ended."""
    return not select.select([pidfd], [], [], 0)[0]


def _pidfd_of_child(pid: int, parent: int, parent_fd: int) -> int | None:
    """A pidfd of `pid` if it is still the child of the live process `parent` (so not a reused pid)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent_now = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        parent_now = None
    if parent_now == parent and _alive(parent_fd):
        return pidfd
    os.close(pidfd)
    return None


def _kill_and_wait(pidfd: int) -> None:
    """SIGKILL the process and wait until it is gone: as PID 1 of its namespace it ends only after the
    kernel has killed everything it started."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        return
    select.select([pidfd], [], [], _KILL_WAIT_S)


class _ForkServer:
    """This process's fork server (sandbox_child.py): started once, restarted if it died or after a fork of
    this process; it exits when this process closes the control socket (or dies)."""

    _lock = threading.Lock()
    _instance: _ForkServer | None = None

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-B", CHILD_SCRIPT, str(theirs.fileno()), json.dumps(_import_path()),
                 *PRELOAD_MODULES],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env=_BASE_ENV,
                cwd="/")
        self.control = ours
        self.owner = os.getpid()
        atexit.register(self.stop)
        ours.settimeout(_SERVER_START_S)
        try:
            ready = ours.recv(1)
        except TimeoutError:
            ready = b""
        ours.settimeout(None)
        if ready != b"r":
            self.stop()
            raise OSError(f"the sandbox fork server did not start within {_SERVER_START_S:g} s")

    @classmethod
    def get(cls, restart: bool = False) -> _ForkServer:
        with cls._lock:
            server = cls._instance
            if restart or server is None or server.owner != os.getpid() or server.process.poll() is not None:
                cls._instance = server = cls()
            return server

    def start(self, out_fd: int, err_fd: int) -> tuple[socket.socket, socket.socket]:
        """Sockets to one new call (control: its process A; result: the tool's process B), which writes to
        these stdout / stderr files."""
        control, control_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        result, result_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with control_theirs, result_theirs:
            socket.send_fds(self.control, [b"c"], [out_fd, err_fd, control_theirs.fileno(), result_theirs.fileno()])
        return control, result

    def stop(self) -> None:
        self.control.close()
        if self.owner != os.getpid():  # a forked copy of this process: the server is its parent's
            return
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _import_path() -> list[str]:
    """This process's import path without the current directory (a tool's cwd is its scratch directory)."""
    return [os.path.abspath(entry) for entry in sys.path if entry]


@functools.lru_cache(maxsize=1)
def _host_paths() -> tuple[str, ...]:
    """What every call may read: the system's programs and libraries, a few files of /etc, this
    interpreter's installation and packages (the import path's site directories), this package."""
    paths = [*SYSTEM_PATHS, *ETC_PATHS, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(sys.executable), os.path.dirname(os.path.realpath(sys.executable))]
    paths += [entry for entry in _import_path() if os.path.basename(entry) in ("site-packages", "dist-packages")]
    for module in ("megatron_rl", *PRELOAD_MODULES):
        paths += _module_paths(module.split(".")[0])
    return tuple(dict.fromkeys(os.path.abspath(path) for path in paths))


@functools.lru_cache(maxsize=256)
def _module_paths(top_level: str) -> tuple[str, ...]:
    """Where a top-level module lives (its package directories, or its file), found without importing it."""
    try:
        spec = importlib.util.find_spec(top_level)
    except (ImportError, ValueError):
        return ()
    if spec is None:
        return ()
    if spec.submodule_search_locations:
        return tuple(os.path.abspath(path) for path in spec.submodule_search_locations)
    return (os.path.abspath(spec.origin),) if spec.origin and os.path.isabs(spec.origin) else ()


def _exit_error(returncode: int, limits: SandboxLimits, stderr: str) -> str:
    if returncode == EXIT_MEMORY:
        return f"memory limit {limits.memory_mb} MiB exceeded"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return f"timed out after {limits.wall_time_s:g} s (CPU time limit)"
    if returncode < 0:
        return f"sandbox process killed by {signal.Signals(-returncode).name}"
    last = stderr.strip().splitlines()[-1:] or [""]
    return f"sandbox process exited with code {returncode} without a result" + (f": {last[0]}" if last[0] else "")


def _read_text(path: str, limit: int) -> str:
    """The file's text cut to `limit` characters, with a note of how much was cut."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or size > len(data):
        return text[:limit] + f"\n[output truncated: {size} bytes in all]"
    return text


_ROOT_PREFIX = "mrl-sandbox-"
_swept_dirs: set[str] = set()


def _sweep_dead_sandboxes(parent_dir: str) -> None:
    """Remove (once per directory and process) the sandbox directories of processes that no longer exist:
    a run SIGKILLed mid-episode cannot remove its own."""
    if parent_dir in _swept_dirs:
        return
    _swept_dirs.add(parent_dir)
    try:
        names = os.listdir(parent_dir)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(rf"{_ROOT_PREFIX}(\d+)-[a-z0-9_]{{8}}", name)
        if match and int(match.group(1)) != os.getpid() and not os.path.exists(f"/proc/{match.group(1)}"):
            with contextlib.suppress(OSError):
                _remove_tree(os.path.join(parent_dir, name))


def _remove_tree(path: str) -> None:
    """Remove a directory tree a tool may have left in any state, without following a link out of it or
    changing the mode of anything outside it: every directory is opened by a file descriptor that refuses
    links (O_NOFOLLOW), entries are removed relative to it, and a directory the tool made read-only gets
    its mode changed through that descriptor only."""
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:  # a link, or not a directory: remove the name only
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        _empty_directory(top)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass


def _empty_directory(fd: int) -> None:
    for attempt in range(2):
        failed = False
        with os.scandir(fd) as entries:
            names = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for name, is_dir in names:
            try:
                if is_dir:
                    child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                    try:
                        _empty_directory(child)
                    finally:
                        os.close(child)
                    os.rmdir(name, dir_fd=fd)
                else:
                    os.unlink(name, dir_fd=fd)
            except PermissionError:
                failed = True
            except OSError:
                pass
        if not failed or attempt:
            return
        try:  # the tool made this directory read-only (or unreadable): give ourselves the rights back
            os.fchmod(fd, stat.S_IRWXU)
        except OSError:
            return


def _failure(error: str) -> SandboxResult:
    return SandboxResult("", "", False, error)


@functools.lru_cache(maxsize=None)
def _probe_containment(backend: str = "native") -> tuple[str, ...]:
    with Sandbox(SandboxLimits(wall_time_s=30.0, backend=backend)) as sandbox:
        return sandbox.run_python("").containment


_reported = threading.Lock()


def check_containment(config: SandboxConfig) -> tuple[str, ...]:
    """The layers active here, probed once: refuse (ConfigError, naming the group and its missing layers)
    when a group in `config.require` is missing; report the others once per process."""
    if config.backend == "bubblewrap" and shutil.which("bwrap") is None:
        raise ConfigError("agent.sandbox.backend: bubblewrap needs the `bwrap` program on PATH "
                          "(Debian/Ubuntu: apt-get install bubblewrap)")
    layers = set(Sandbox.containment(config.backend))
    missing = {group: [layer for layer in members if layer not in layers] for group, members in LAYER_GROUPS.items()}
    for group in config.require:
        if missing[group]:
            raise ConfigError(f"agent.sandbox.require: {group} is not available on this machine "
                              f"(missing: {', '.join(missing[group])}); remove it from the list to run with "
                              "the fallback")
    if _reported.acquire(blocking=False):
        logger.info("agent sandbox: active layers: %s", ", ".join(sorted(layers)))
        absent = [f"{group} ({', '.join(layers_)})" for group, layers_ in missing.items() if layers_]
        if absent:
            logger.warning("agent sandbox: not available here, falling back (rlimits per process, the audit "
                           "hook): %s; `agent.sandbox.require` refuses to run without them", "; ".join(absent))
    return tuple(sorted(layers))
