"""Run a tool's code in a separate, contained process: the agent recipe's sandbox (docs/agents.md).

Each call runs in fresh processes forked from a per-process fork server (`sandbox_child.py`, stdlib only,
never runs tool code itself; forking a warm interpreter instead of starting one per call saves the
interpreter's start-up, 40+ ms of CPU a call):
- a new session; resource limits: address space (`memory_mb`), CPU seconds, file size, no core dumps, and
  inside a user namespace at most 64 processes;
- a wall-time limit: on expiry the tool's process and its process group are SIGKILLed; inside a PID
  namespace the tool's process is PID 1, so the kernel kills everything it started when it ends (normal end
  or kill): nothing outlives a call;
- cwd, HOME and TMPDIR = the sandbox's private scratch directory (removed when the sandbox closes), a minimal
  environment, stdin /dev/null, no other inherited file descriptors than its stdout/stderr files and the
  call's socket;
- when the kernel allows them to an unprivileged user: user + network + PID namespaces (the network
  namespace has only a down loopback), a Landlock domain (file-system changes only below the scratch
  directory and to /dev/null, no TCP connect/bind, no signals or abstract unix sockets to processes outside
  the sandbox, no mounts), capabilities dropped;
- always: an audit hook (`sys.addaudithook`) that refuses, with a clear message, socket use and writes
  outside the scratch directory; without the kernel layers it also refuses process creation, signals to
  other processes and ctypes.

What this is not: the audit hook alone is no security boundary (native code, ctypes or a C extension
bypasses it), so without user namespaces and Landlock the sandbox only contains honest mistakes of a
model's code. Reads are not restricted (the tool can read any file the user can), a pathname unix socket
is not blocked by the kernel layers, and disk use is bounded per file (`memory_mb`), not in total.
`Sandbox.containment()` names the layers that are active on this machine.

A tool failure, timeout or limit becomes `SandboxResult.error` (one line); nothing here raises for what
the sandboxed code does.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
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

from megatron_rl.config import ConfigError

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
EXIT_MEMORY = 3  # the tool process's exit code when it ran out of memory before it could send a result
_READ_CHUNK = 1 << 16
_MAX_MESSAGE_BYTES = 16 << 20  # a `call`'s return value travels as one JSON line of at most this size
_KILL_WAIT_S = 5.0
_SERVER_START_S = 60.0  # at most this long for a killed tool process to be gone
# imported once by the fork server, before any tool code runs, so that `call`s into them skip the import
PRELOAD_MODULES = ("megatron_rl.recipes.agent.arithmetic",)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed call."""

    wall_time_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 4000
    network: bool = False

    def __post_init__(self):
        if not self.wall_time_s > 0:
            raise ConfigError(f"sandbox limits: wall_time_s must be > 0, got {self.wall_time_s!r}")
        if not (isinstance(self.memory_mb, int) and self.memory_mb >= 64):
            raise ConfigError(f"sandbox limits: memory_mb must be an integer >= 64, got {self.memory_mb!r}")
        if not (isinstance(self.output_chars, int) and self.output_chars > 0):
            raise ConfigError(f"sandbox limits: output_chars must be a positive integer, got {self.output_chars!r}")


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
    (the fallback of kernels without them: rlimits and the strict audit hook), to test that path."""

    def __init__(self, limits: SandboxLimits | None = None, *, parent_dir: str | None = None,
                 kernel_isolation: bool = True):
        self.limits = limits or SandboxLimits()
        self.kernel_isolation = kernel_isolation
        self._root = tempfile.mkdtemp(prefix="mrl-sandbox-", dir=parent_dir)
        self.scratch = os.path.join(self._root, "scratch")
        os.mkdir(self.scratch, 0o700)
        self._remove = weakref.finalize(self, _remove_tree, self._root)  # also if never closed

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._remove()

    @staticmethod
    def containment() -> tuple[str, ...]:
        """The containment layers the kernel grants here (probed once per process by an empty call)."""
        return _probe_containment()

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
        return self._run({"kind": "call", "target": function, "kwargs": kwargs})

    # --- one call ------------------------------------------------------------------------------------
    def _run(self, request: dict) -> SandboxResult:
        if not self._remove.alive:
            raise RuntimeError("the sandbox is closed")
        limits = self.limits
        io_dir = tempfile.mkdtemp(prefix="io-", dir=self._root)
        request = {**request, "scratch": self.scratch, "env": self._environment(),
                   "kernel_isolation": self.kernel_isolation, "limits": dataclasses.asdict(limits)}
        try:
            server = _ForkServer.get()  # the first call waits here for the server to start, not on its clock
            with open(os.path.join(io_dir, "stdout"), "wb") as out, open(os.path.join(io_dir, "stderr"), "wb") as err:
                try:
                    call = server.start(out.fileno(), err.fileno())
                except OSError:  # the server died since it was last checked: start a new one, once
                    call = _ForkServer.get(restart=True).start(out.fileno(), err.fileno())
        except OSError as exc:
            _remove_tree(io_dir)
            return _failure(f"could not start the sandbox process: {exc}")
        started = time.monotonic()
        deadline = started + limits.wall_time_s
        with call:
            messages, timed_out = _exchange(call, request, deadline)
        _kill(messages, timed_out)
        wall_s = time.monotonic() - started
        stdout = _read_text(os.path.join(io_dir, "stdout"), limits.output_chars)
        stderr = _read_text(os.path.join(io_dir, "stderr"), limits.output_chars)
        _remove_tree(io_dir)
        reply = messages.get("result")
        if timed_out:
            error = f"timed out after {limits.wall_time_s:g} s"
        elif isinstance(reply, dict) and "ok" in reply:
            ok = bool(reply["ok"])
            return SandboxResult(stdout, stderr, ok, None if ok else str(reply.get("error") or "failed"),
                                 reply.get("value"), tuple(reply.get("containment", ())), wall_s)
        elif messages.get("oversized"):
            error = f"the result is larger than {_MAX_MESSAGE_BYTES >> 20} MiB"
        elif "exit" in messages:
            error = _exit_error(messages["exit"], limits, stderr)
        else:
            error = "the sandbox process ended without a result"
        return SandboxResult(stdout, stderr, False, error, None, (), wall_s)

    def _environment(self) -> dict[str, str]:
        return {**_BASE_ENV, "HOME": self.scratch, "TMPDIR": self.scratch}


_BASE_ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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

    def start(self, out_fd: int, err_fd: int) -> socket.socket:
        """A socket to one new call process, which writes to these stdout / stderr files."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            socket.send_fds(self.control, [b"c"], [out_fd, err_fd, theirs.fileno()])
        return ours

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


def _exchange(call: socket.socket, request: dict, deadline: float) -> tuple[dict, bool]:
    """Send the request, then collect the call's messages (pid, child, result, exit) until it reports its
    exit, closes the socket, or the deadline passes. Returns (messages by kind, timed out)."""
    messages: dict[str, Any] = {}
    pending = bytearray()
    try:
        call.settimeout(max(deadline - time.monotonic(), 0.001))
        call.sendall(json.dumps(request).encode("utf-8") + b"\n")
        while "exit" not in messages:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return messages, True
            call.settimeout(remaining)
            chunk = call.recv(_READ_CHUNK)
            if not chunk:
                break
            pending += chunk
            if b"\n" not in chunk:  # most chunks of a long result: no split, no copy
                if len(pending) > _MAX_MESSAGE_BYTES:
                    messages["oversized"] = True
                    return messages, False
                continue
            *lines, rest = pending.split(b"\n")
            pending = bytearray(rest)
            for line in lines:
                try:
                    messages.update(json.loads(line))
                except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError):
                    messages.setdefault("malformed", line[:200])
    except TimeoutError:
        return messages, True
    except OSError:  # the call process died before reading the request: its exit says why, if it came
        pass
    return messages, False


def _kill(messages: dict, timed_out: bool) -> None:
    """SIGKILL the call's process group (A leads it). On timeout first the tool's process B, waiting until
    it is gone: as PID 1 of its namespace it exits only after the kernel has killed everything it started."""
    child = messages.get("child")
    if (timed_out or messages.get("oversized")) and isinstance(child, int):
        try:
            pidfd = os.pidfd_open(child)
        except OSError:  # already gone
            pidfd = None
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                select.select([pidfd], [], [], _KILL_WAIT_S)
            finally:
                os.close(pidfd)
    group = messages.get("pid")
    if isinstance(group, int) and group > 1:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


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


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _exc_info):
        # the sandboxed code may have left read-only directories behind
        try:
            os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)
            os.chmod(failed_path, stat.S_IRWXU)
            function(failed_path)
        except OSError:
            pass
    shutil.rmtree(path, onerror=make_writable_and_retry)


def _failure(error: str) -> SandboxResult:
    return SandboxResult("", "", False, error)


@functools.lru_cache(maxsize=1)
def _probe_containment() -> tuple[str, ...]:
    with Sandbox(SandboxLimits(wall_time_s=30.0)) as sandbox:
        return sandbox.run_python("").containment
