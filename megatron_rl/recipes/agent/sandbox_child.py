"""The sandbox's processes (stdlib only, run by path: `python -I -B sandbox_child.py FD PATH_JSON [MODULE...]`).

A fork server: it never runs tool code itself; for each call it forks process A (a new session), which
reads the JSON request from the call's control socket, joins the call's cgroups, enters user, network and
PID namespaces where the kernel grants them to an unprivileged user, and forks process B. B builds a
private root (a mount namespace that shows only what the tool needs, read-only, and the writable scratch
directory), limits its resources, enters a Landlock domain, drops its capabilities, installs the audit hook,
reports its containment and only then runs the tool's code and sends one JSON result.

Two channels per call, so that nothing the tool writes can pass for the sandbox's own word: the control
socket is A's alone (B closes its copy before any tool code runs; inside a PID namespace A is not even
addressable), and carries A's pid, B's pid and B's exit status; the result socket is B's, and the parent
takes from it only the containment report sent before the tool ran and exactly one result. Forking a warm
interpreter saves the interpreter start-up of every call; each call still starts from the server's clean
state. sandbox.py's docstring says what this containment is and is not.
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
import stat
import subprocess
import sys
import traceback
from typing import ClassVar

EXIT_MEMORY = 3  # sandbox.py reads this exit code as "memory limit exceeded"

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH, AT_FDCWD, AT_RECURSIVE = 2, -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 1, 2, 4
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (the generic table)
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(platform.machine())
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR, FS_TRUNCATE = 1, 1 << 1, 1 << 2, 1 << 3, 1 << 14
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE  # the rights a rule on a file may grant
# every right that changes the file system: remove/make dir, file, char, sock, fifo, block, symlink
FS_CHANGE = FS_WRITE_FILE | sum(1 << bit for bit in range(4, 13))
FS_REFER = 1 << 13
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def check(returned: int, what: str) -> None:
    if returned != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def limit_resources(limits: dict) -> None:
    memory = limits["memory_mb"] << 20
    cpu = math.ceil(limits["wall_time_s"]) + 1
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises EFBIG instead of killing


def enter_namespaces(network: bool, processes: int) -> list[str]:
    """Unshare user (+ network unless allowed) + PID namespaces, mapping our own uid/gid into them. Raises
    OSError when the kernel refuses: call it in a process that can be thrown away (see namespaces_work)."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWPID | (0 if network else CLONE_NEWNET)
    check(libc.unshare(flags), "unshare")
    # without a mapping, files created in the scratch directory would fail with EOVERFLOW; a kernel that
    # lets us unshare but not map (e.g. AppArmor's restrict_unprivileged_userns) fails here
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    # binds only a user other than root, and counts all of the user's processes: the cgroup is the real limit
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    return ["userns", "pidns"] + ([] if network else ["netns"])


def namespaces_work() -> bool:
    """Whether this kernel lets us enter (and map) the namespaces, tried once in a throwaway process."""
    pid = os.fork()
    if pid == 0:
        try:
            enter_namespaces(network=False, processes=64)
            os._exit(0)
        except BaseException:  # any failure means no namespaces; the parent only reads the exit code
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def join_cgroups(procs_files: list[str]) -> None:
    """Move this process (and so everything it starts) into the call's cgroups (before the user namespace:
    the cgroup files belong to the host's user)."""
    for path in procs_files:
        with open(path, "w") as f:
            f.write(str(os.getpid()))


# --- the private root --------------------------------------------------------------------------------------
def mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda text: None if text is None else os.fsencode(text)  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {target}")


def make_read_only(target: str, recursive: bool) -> None:
    """Read-only (and nosuid, nodev) through mount_setattr, which keeps the flags a user namespace may not
    clear; on kernels before 5.12 a remount of the one mount, with the flags it has."""
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, 0, 0, 0)
    done = libc.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(AT_FDCWD), os.fsencode(target),
                        ctypes.c_uint(AT_RECURSIVE if recursive else 0), ctypes.byref(attr),
                        ctypes.c_size_t(ctypes.sizeof(attr)))
    if done == 0:
        return
    flags = os.statvfs(target).f_flag
    kept = sum(ms for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                                 (os.ST_RELATIME, MS_RELATIME)) if flags & st)
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def bind(source: str, target: str, read_only: bool) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        make_read_only(target, recursive=True)


def root_plan(readable: list[str]) -> list[tuple[str, str, str]]:
    """The read-only part of a private root, in the order to build it: ("symlink", target, link) for every
    symlink on the way to a readable path, recreated as it is, and ("bind", path, path) for every real
    location (once: a path below one already bound is visible through it)."""
    plan: list[tuple[str, str, str]] = []
    bound: list[str] = []
    links: set[str] = set()

    def visible(path: str) -> bool:  # through a bind already planned
        return any(path == done or path.startswith(done.rstrip("/") + "/") for done in bound)
    for path in sorted({os.path.abspath(p) for p in readable}, key=lambda p: (len(os.path.realpath(p)), p)):
        if not os.path.lexists(path):
            continue
        here = "/"
        for part in path.strip("/").split("/"):
            step = os.path.join(here, part)
            if os.path.islink(step):
                if step not in links and not visible(step):
                    links.add(step)
                    plan.append(("symlink", os.readlink(step), step))
                here = os.path.realpath(step)
            else:
                here = step
        if os.path.exists(here) and not visible(here):
            plan.append(("bind", here, here))
            bound.append(here)
    return plan


def enter_private_root(mount_point: str, scratch: str, readable: list[str], shm_mb: int) -> list[str]:
    """A mount namespace whose root holds only `readable` (read-only, at the same paths), the scratch
    directory (writable), a minimal /dev, /dev/shm (a tmpfs of `shm_mb`) and this PID namespace's /proc;
    then pivot_root into it, so that nothing else of the host is reachable by any path. Needs the
    capabilities of the user namespace (process B, before it drops them). Returns the layers entered."""
    check(libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new_root = mount_point
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=4m")
    for kind, source, target in root_plan(readable):
        if kind == "symlink":
            os.makedirs(os.path.dirname(new_root + target), exist_ok=True)
            os.symlink(source, new_root + target)
        else:
            bind(source, new_root + target, read_only=True)
    bind(scratch, new_root + scratch, read_only=False)
    dev = new_root + "/dev"
    os.makedirs(dev, exist_ok=True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            bind(f"/dev/{name}", f"{dev}/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    mount("tmpfs", f"{dev}/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_mb}m")
    make_read_only(dev, recursive=False)
    layers = ["mountns"]
    os.mkdir(new_root + "/proc")
    try:  # refused where the host's /proc has masked paths (some containers): then there is no /proc at all
        mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        layers.append("own-proc")
    except OSError:
        pass
    make_read_only(new_root, recursive=False)
    os.chdir(new_root)
    if SYS_PIVOT_ROOT is None:
        raise OSError("pivot_root: unknown syscall number on this architecture")
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")  # the old root now lies under the new one
    check(libc.umount2(b".", MNT_DETACH), "umount the old root")
    os.chdir(scratch)
    return layers


def bubblewrap_command(request: dict, request_fd: int, result_fd: int, info_fd: int) -> list[str]:
    """The `bubblewrap` backend: the same private root and namespaces built by bwrap (Debian's
    `bubblewrap`; on kernels that allow user namespaces only to allow-listed programs, e.g. AppArmor's
    restrict_unprivileged_userns, bwrap is usually one), running this file's `--tool` entry, which adds
    the rlimits, Landlock and the audit hook as process B does."""
    scratch, limits = request["scratch"], request["limits"]
    command = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--info-fd", str(info_fd),
               *BWRAP_OPTIONS.get("--disable-userns", ())]
    if not limits["network"]:
        command.append("--unshare-net")
    for kind, source, target in root_plan(request["readable"]):
        command += ["--symlink", source, target] if kind == "symlink" else ["--ro-bind", source, target]
    shm_size = [*BWRAP_OPTIONS.get("--size", ()), str(limits["memory_mb"] << 20)] if "--size" in BWRAP_OPTIONS else []
    command += ["--bind", scratch, scratch, "--dev", "/dev", *shm_size, "--tmpfs", "/dev/shm", "--proc", "/proc",
                "--remount-ro", "/", "--chdir", scratch,
                "--", sys.executable, "-I", "-B", os.path.abspath(__file__), "--tool", str(request_fd), str(result_fd)]
    return command


def namespace_init(info_fd: int) -> int | None:
    """The pid (here) of PID 1 of bwrap's namespace, from bwrap's --info-fd: the process whose end means
    everything in the namespace has ended; None when bwrap failed before making it."""
    data, info = b"", None
    try:
        while info is None and len(data) < 65536:  # bwrap writes the object in pieces
            chunk = os.read(info_fd, 4096)
            if not chunk:
                break
            data += chunk
            if data.rstrip().endswith(b"}"):
                try:
                    info = json.loads(data)
                except ValueError:
                    pass
    except OSError:
        pass
    finally:
        os.close(info_fd)
    pid = info.get("child-pid") if isinstance(info, dict) else None
    return pid if isinstance(pid, int) and pid > 0 else None


BWRAP_OPTIONS: dict[str, tuple[str, ...]] = {}  # the optional flags this bwrap has (--disable-userns: 0.8)


def probe_bubblewrap() -> None:
    """Which optional flags the installed bwrap understands (read once, by the fork server)."""
    try:
        done = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return
    for flag in ("--disable-userns", "--size"):
        if flag in done.stdout + done.stderr:
            BWRAP_OPTIONS[flag] = (flag,)


def bubblewrap_layers(network: bool) -> list[str]:
    return ["bubblewrap", "userns", "pidns", *([] if network else ["netns"]), "mountns", "own-proc"]


# --- Landlock, capabilities ------------------------------------------------------------------------------
def landlock(scratch: str, network: bool, readable: list[str], private_root: bool) -> list[str]:
    """Allow file-system changes only below `scratch`, /dev/shm and to /dev/null; reads only of `readable`,
    /dev and /proc (ABI 1), and in a private root (which holds nothing else) listing any directory; without
    `network` no TCP connect or bind (ABI 4); no signals or abstract unix sockets out of the sandbox (ABI 6)."""
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 1:
        return []
    fs = FS_CHANGE | FS_READ | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 and not network else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return []
    rules = [(path, FS_READ) for path in readable] + [("/dev", FS_READ), ("/proc", FS_READ), (scratch, fs),
                                                      ("/dev/shm", fs), ("/dev/null", fs)]
    if private_root:
        rules.append(("/", FS_READ_DIR))
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:  # not on this machine (or not in the private root)
                continue
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= FS_FILE_RIGHTS
                rule = PathBeneathAttr(allowed & fs, fd)
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
    return ["landlock-fs", "landlock-read"] + (["landlock-net"] if net else []) + (["landlock-scope"] if scoped else [])


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

    # event -> (index of a path it changes, index of that path's dir_fd or None) pairs; a hard link's source
    # counts as changed (writing through the link writes the file outside)
    PATH_EVENTS: ClassVar[dict] = {"os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
                   "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
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


def send(channel: socket.socket, message: dict) -> None:
    channel.sendall(json.dumps(message).encode("utf-8") + b"\n")


def serve(control_fd: int, path: list[str], preload: list[str]) -> None:
    """The fork server: for each message (the call's stdout, stderr, control and result sockets as file
    descriptors) fork a process that runs the call; end when the controlling process closes its end (or
    dies). `path`: the controlling process's import path (so `call` finds what it finds); `preload`: modules
    to import once, before any tool code runs (an import error is left to the call that needs the module)."""
    sys.path[:] = path
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    use_namespaces = namespaces_work()
    probe_bubblewrap()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # call processes are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the controller is the controller's to handle
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    control = socket.socket(fileno=control_fd)
    control.send(b"r")  # ready: the controlling process starts its calls' clocks from here
    while True:
        message, fds, _, _ = socket.recv_fds(control, 16, 4)
        if not message:
            os._exit(0)
        if len(fds) != 4:
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


def serve_call(out_fd: int, err_fd: int, control_fd: int, result_fd: int, use_namespaces: bool) -> None:
    """Process A of one call: a new session (its process group is the one the parent kills); reads the
    request, joins the cgroups, enters the namespaces, forks the tool's process B (PID 1 of the new PID
    namespace when there is one) once the parent holds B's pid, reports B's exit, then waits for the
    parent to end it (so that its pid, the group's id, stays this call's until then)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the fork server ends with the controlling process: follow it
    os.setsid()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    control = socket.socket(fileno=control_fd)
    send(control, {"pid": os.getpid()})
    request = json.loads(control.makefile("rb").readline())
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["scratch"])
    limits = request["limits"]
    try:
        join_cgroups(request["cgroup_procs"])
        cgroup_layers = request["cgroup_layers"]
    except OSError:  # the limits fall back to the rlimits, and the report says so
        cgroup_layers = []
    isolated = request["kernel_isolation"]
    bubblewrap = isolated and request["backend"] == "bubblewrap"
    namespaces = (enter_namespaces(limits["network"], limits["processes"])
                  if isolated and use_namespaces and not bubblewrap else [])
    go_r, go_w = os.pipe()
    request_r, request_w = os.pipe() if bubblewrap else (-1, -1)
    info_r, info_w = os.pipe() if bubblewrap else (-1, -1)
    child = os.fork()
    if child == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # A is SIGKILLed at the call's end: follow it
        control.close()
        os.close(go_w)
        os.read(go_r, 1)  # the parent holds this process's pid (as a pidfd): the tool may start
        os.close(go_r)
        if bubblewrap:  # bwrap's sandboxed child dies with it (--die-with-parent), and so with this pid
            os.close(request_w)
            os.close(info_r)
            for fd in (request_r, result_fd, info_w):
                os.set_inheritable(fd, True)
            try:
                os.execvp("bwrap", bubblewrap_command(request, request_r, result_fd, info_w))
            except OSError as exc:
                os.write(2, f"bubblewrap: cannot run bwrap: {exc}\n".encode())
                os._exit(127)
        try:
            run_tool(request, socket.socket(fileno=result_fd), namespaces + cgroup_layers)
        except MemoryError:
            os._exit(EXIT_MEMORY)
        os._exit(0)
    os.close(result_fd)
    os.close(go_r)
    send(control, {"child": child})
    if control.recv(1) != b"g":  # the parent is gone or gave up on the call
        os.kill(child, signal.SIGKILL)
        os._exit(0)
    os.write(go_w, b"g")
    os.close(go_w)
    if bubblewrap:
        os.close(request_r)
        os.close(info_w)
        try:
            with open(request_w, "wb") as pipe:
                pipe.write(json.dumps({**request, "cgroup_layers": cgroup_layers}).encode("utf-8"))
        except OSError:  # bwrap failed before reading: its exit status says why
            pass
        init = namespace_init(info_r)
        if init is not None:
            send(control, {"init": init})
    _, status = os.waitpid(child, 0)
    send(control, {"exit": os.waitstatus_to_exitcode(status)})
    control.recv(1)  # until the parent kills this process group or closes the socket
    os._exit(0)


def run_tool(request: dict, result: socket.socket, layers: list[str]) -> None:
    """Process B: contain itself, report the containment, run the tool's code, send the result."""
    limits, scratch = request["limits"], request["scratch"]
    layers = ["rlimits", "session", *layers]
    if request["kernel_isolation"]:
        if "userns" in layers and "mountns" not in layers and request["private_root"]:
            try:
                layers += enter_private_root(request["mount_point"], scratch, request["readable"], limits["memory_mb"])
            except OSError:  # the kernel refused a step: the host stays visible, the layer is not claimed
                os.chdir(scratch)
        layers += landlock(scratch, limits["network"], request["readable"], private_root="mountns" in layers)
    if "userns" in layers and drop_capabilities():
        layers.append("no-capabilities")
    limit_resources(limits)
    guard = Guard(scratch, limits["network"], strict=not {"landlock-fs", "pidns", "mountns"} <= set(layers))
    sys.addaudithook(guard)
    layers.append("audit-hook" + ("-strict" if guard.strict else ""))
    send(result, {"contained": layers})  # before any tool code: the only containment report the parent takes

    reply = {"ok": True, "error": None, "value": None}
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
        send(result, {"result": reply})
    except (TypeError, ValueError) as exc:
        reply.update(ok=False, value=None, error=f"the return value is not JSON: {exc}")
        send(result, {"result": reply})


def tool_main(request_fd: int, result_fd: int) -> None:
    """Process B inside bwrap: the request from A's pipe, then as run_tool."""
    with open(request_fd, "rb") as pipe:
        request = json.loads(pipe.read())
    sys.path[:] = request["path"]
    result = socket.socket(fileno=result_fd)
    try:
        run_tool(request, result, bubblewrap_layers(request["limits"]["network"]) + request["cgroup_layers"])
    except MemoryError:
        os._exit(EXIT_MEMORY)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "--tool":
        tool_main(int(sys.argv[2]), int(sys.argv[3]))
    serve(int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3:])
