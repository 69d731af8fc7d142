"""The sandbox's processes (stdlib only, run by path: `python -I -B sandbox_child.py FD PATH_JSON [MODULE...]`).

A fork server: it never runs tool code itself; for each call it forks process A (a new session), which
reads the JSON request from the call's socket, enters user, network and PID namespaces where the kernel
grants them to an unprivileged user, and forks process B. B limits its resources, enters a Landlock domain,
drops its capabilities, installs the audit hook, runs the tool's code and sends one JSON result. A reports
its pid, B's pid and B's exit status on the same socket (newline-delimited JSON). Forking a warm interpreter
saves the interpreter start-up of every call; each call still starts from the server's clean state.
sandbox.py's docstring says what this containment is and is not.
"""
import ctypes
import importlib
import json
import linecache
import math
import os
import platform
import resource
import signal
import socket
import sys
import traceback
from typing import ClassVar

EXIT_MEMORY = 3  # sandbox.py reads this exit code as "memory limit exceeded"
MAX_PROCESSES = 64  # per sandbox, enforced inside its own user namespace

CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(platform.machine())
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_WRITE_FILE, FS_TRUNCATE = 1 << 1, 1 << 14
# every right that changes the file system: remove/make dir, file, char, sock, fifo, block, symlink
FS_CHANGE = FS_WRITE_FILE | sum(1 << bit for bit in range(4, 13))
FS_REFER = 1 << 13
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def limit_resources(limits: dict) -> None:
    memory = limits["memory_mb"] << 20
    cpu = math.ceil(limits["wall_time_s"]) + 1
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises EFBIG instead of killing


def enter_namespaces(network: bool) -> list[str]:
    """Unshare user (+ network unless allowed) + PID namespaces, mapping our own uid/gid into them. Raises
    OSError when the kernel refuses: call it in a process that can be thrown away (see namespaces_work)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWPID | (0 if network else CLONE_NEWNET)
    if libc.unshare(flags) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    # without a mapping, files created in the scratch directory would fail with EOVERFLOW; a kernel that
    # lets us unshare but not map (e.g. AppArmor's restrict_unprivileged_userns) fails here
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
    return ["userns", "pidns"] + ([] if network else ["netns"])


def namespaces_work() -> bool:
    """Whether this kernel lets us enter (and map) the namespaces, tried once in a throwaway process."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces(network=False)
            os._exit(0)
        except BaseException:  # any failure means no namespaces; the parent only reads the exit code
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def landlock(scratch: str, network: bool) -> list[str]:
    """Allow file-system changes only below `scratch` (and writes to /dev/null); without `network` no TCP
    connect or bind; no signals or abstract unix sockets out of the sandbox (ABI 6)."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return []
    fs = FS_CHANGE | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 and not network else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return []
    try:
        for path, allowed in ((scratch, fs), ("/dev/null", FS_WRITE_FILE | (fs & FS_TRUNCATE))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = PathBeneathAttr(allowed, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    return []
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return []
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return []
    finally:
        os.close(ruleset)
    return ["landlock-fs"] + (["landlock-net"] if net else []) + (["landlock-scope"] if scoped else [])


def drop_capabilities() -> bool:
    """Drop the capabilities unshare gave us inside our user namespace (no mounts, no raw sockets...)."""
    if SYS_CAPSET is None:
        return False
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()
    return libc.syscall(SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)) == 0


class Guard:
    """The audit hook: refuses socket use (unless network is allowed) and file-system changes outside the
    scratch directory, recording each refusal; `strict` (no kernel sandbox) also refuses new processes,
    signals to other processes and ctypes, which would escape the hook."""

    # event -> (index of a path it changes, index of that path's dir_fd or None) pairs
    PATH_EVENTS: ClassVar[dict] = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
                   "os.rename": ((0, 2), (1, 3)), "os.link": ((1, 3),), "os.symlink": ((1, 2),),
                   "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.truncate": ((0, None),),
                   "os.utime": ((0, 3),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
                   "os.setxattr": ((0, None),), "os.removexattr": ((0, None),)}
    NETWORK_EVENTS: ClassVar[set] = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                                     "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
                                     "socket.getnameinfo"}
    PROCESS_EVENTS: ClassVar[set] = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                     "os.fork", "os.forkpty", "pty.spawn"}

    def __init__(self, scratch: str, network: bool, strict: bool):
        self.scratch = os.path.realpath(scratch)
        self.network = network
        self.strict = strict
        self.violations: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        message = self.check(event, args)
        if message is not None:
            self.violations.append(message)
            raise PermissionError(message)

    def check(self, event: str, args: tuple) -> str | None:
        if event == "open":
            path, mode, flags = args
            writes = (any(c in mode for c in "wax+") if isinstance(mode, str)
                      else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND)))
            return self.outside(path) if writes and not isinstance(path, int) else None
        if event in self.PATH_EVENTS:
            for path_index, dir_fd_index in self.PATH_EVENTS[event]:
                dir_fd = None if dir_fd_index is None or dir_fd_index >= len(args) else args[dir_fd_index]
                message = self.outside(args[path_index], dir_fd)
                if message:
                    return message
            return None
        if event in self.NETWORK_EVENTS and not self.network:
            if event in ("socket.connect", "socket.bind") and args[0].family == socket.AF_UNIX \
                    and isinstance(args[1], (str, bytes)) and args[1][:1] not in ("", "\0", b"", b"\0") \
                    and self.outside(args[1]) is None:
                return None  # a pathname unix socket inside the scratch directory stays inside
            return "network access is disabled"
        if self.strict:
            if event in self.PROCESS_EVENTS:
                return "process creation is disabled (no kernel sandbox on this machine)"
            if event.startswith("ctypes."):
                return "ctypes is disabled (no kernel sandbox on this machine)"
            if event in ("os.kill", "os.killpg") and args[0] not in (0, os.getpid()):
                return "signals to other processes are disabled"
        return None

    def outside(self, path, dir_fd=None) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        path = os.fsdecode(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        resolved = os.path.realpath(path)
        if resolved == self.scratch or resolved.startswith(self.scratch + os.sep) or resolved == "/dev/null":
            return None
        return f"write outside the scratch directory refused: {resolved}"


def run(request: dict) -> object:
    if request["kind"] == "python":
        source = request["code"]
        linecache.cache["<tool>"] = (len(source), None, source.splitlines(keepends=True), "<tool>")
        code = compile(source, "<tool>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        return None
    module_name, function_name = request["target"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return function(**request["kwargs"])


def print_tool_traceback(exc: BaseException) -> None:
    """The traceback without this file's frames (the model needs its own code's lines only)."""
    report = traceback.TracebackException.from_exception(exc)
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != __file__])
    lines = list(report.format())
    if not report.stack and lines[:1] == ["Traceback (most recent call last):\n"]:
        lines = lines[1:]
    sys.stderr.write("".join(lines))


def error_line(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"SyntaxError: {exc.msg} (line {exc.lineno})"
    return " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())


def send(call: socket.socket, message: dict) -> None:
    call.sendall(json.dumps(message).encode("utf-8") + b"\n")


def serve(control_fd: int, path: list[str], preload: list[str]) -> None:
    """The fork server: for each message (the call's stdout, stderr and socket as file descriptors) fork a
    process that runs the call; end when the controlling process closes its end. `path`: the controlling
    process's import path (so `call` finds what it finds); `preload`: modules to import once, before any tool
    code runs (an import error is left to the call that needs the module)."""
    sys.path[:] = path
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    use_namespaces = namespaces_work()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # call processes are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the controller is the controller's to handle
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    control = socket.socket(fileno=control_fd)
    control.send(b"r")  # ready: the controlling process starts its calls' clocks from here
    while True:
        message, fds, _, _ = socket.recv_fds(control, 16, 3)
        if not message:
            os._exit(0)
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            control.close()
            try:
                serve_call(*fds, use_namespaces=use_namespaces)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)


def serve_call(out_fd: int, err_fd: int, call_fd: int, use_namespaces: bool) -> None:
    """Process A of one call: a new session; reads the request, enters the namespaces, forks the tool's
    process B (PID 1 of the new PID namespace when there is one), waits for it and reports its exit."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    call = socket.socket(fileno=call_fd)
    send(call, {"pid": os.getpid()})
    request = json.loads(call.makefile("rb").readline())
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["scratch"])
    network = request["limits"]["network"]
    namespaces = enter_namespaces(network) if request["kernel_isolation"] and use_namespaces else []
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # A is SIGKILLed on timeout: follow it
        os.close(go_w)
        os.read(go_r, 1)  # A has reported this process's pid: the result may follow on the socket
        os.close(go_r)
        try:
            run_tool(request, call, namespaces)
        except MemoryError:
            os._exit(EXIT_MEMORY)
        os._exit(0)
    os.close(go_r)
    send(call, {"child": child})
    os.write(go_w, b"g")
    os.close(go_w)
    _, status = os.waitpid(child, 0)
    send(call, {"exit": os.waitstatus_to_exitcode(status)})
    os._exit(0)


def run_tool(request: dict, call: socket.socket, namespaces: list[str]) -> None:
    """Process B: limit and contain itself, run the tool's code, send the result."""
    limits, scratch = request["limits"], request["scratch"]
    limit_resources(limits)
    layers = ["rlimits", "session", *namespaces]
    if request["kernel_isolation"]:
        layers += landlock(scratch, limits["network"])
    if namespaces and drop_capabilities():
        layers.append("no-capabilities")
    guard = Guard(scratch, limits["network"], strict=not ("landlock-fs" in layers and "pidns" in layers))
    sys.addaudithook(guard)
    layers.append("audit-hook" + ("-strict" if guard.strict else ""))

    reply = {"ok": True, "error": None, "value": None, "containment": layers}
    try:
        reply["value"] = run(request)
    except MemoryError:
        reply.update(ok=False, error=f"memory limit {limits['memory_mb']} MiB exceeded")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            reply.update(ok=False, error=f"exited with code {exc.code}")
    except BaseException as exc:  # the tool's failure is the model's error message
        print_tool_traceback(exc)
        reply.update(ok=False, error=error_line(exc))
    if guard.violations:
        reply.update(ok=False, error=guard.violations[0])
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a full file (RLIMIT_FSIZE) keeps what was written
            pass
    try:
        send(call, {"result": reply})
    except (TypeError, ValueError) as exc:
        reply.update(ok=False, value=None, error=f"the return value is not JSON: {exc}")
        send(call, {"result": reply})


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:])
