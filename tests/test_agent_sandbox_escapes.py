"""Hostile tool code against the agent sandbox (issue: each escape a policy could learn): metadata writes,
hard links, the parent's cleanup following a symlink, unix-domain sockets, forged control messages, limits
that are per process instead of per call, and reads of the host's files. Code that must get past the audit
hook runs in a fresh interpreter started inside the sandbox (which has no hook), so only the kernel layers
stand in its way. `test_escapes_as_an_unprivileged_user` reruns this file as uid 65534 where the machine
lets root drop to it."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits, _host_paths, _remove_tree

LIMITS = SandboxLimits(wall_time_s=20.0, memory_mb=256, output_chars=4000)


def _raw(code: str) -> str:
    """Tool code that runs `code` in a fresh interpreter (no audit hook) and prints what it printed."""
    return (f"import subprocess, sys\ndone = subprocess.run([sys.executable, '-I', '-c', {textwrap.dedent(code)!r}],"
            " capture_output=True, text=True)\nprint(done.stdout, end='')\nprint(done.stderr, end='', file=sys.stderr)")


def _layers() -> set[str]:
    return set(Sandbox.containment())


@pytest.fixture(params=["native", "bubblewrap"])
def box(request):
    """A sandbox with every kernel layer, built by this package and by Debian's bwrap (where installed)."""
    if request.param == "bubblewrap" and shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (apt-get install bubblewrap)")
    with Sandbox(dataclasses.replace(LIMITS, backend=request.param)) as sandbox:
        yield sandbox


@pytest.fixture
def outside(tmp_path):
    """A file and a directory outside the scratch directory that this user may change: only the sandbox
    stands in the way."""
    target = tmp_path / "outside.txt"
    target.write_text("original")
    os.chmod(target, 0o644)
    os.utime(target, (1_000_000, 1_000_000))
    return target


def _state(path) -> tuple:
    st = os.lstat(path)
    try:
        attrs = sorted(os.listxattr(path))
    except OSError:
        attrs = []
    return st.st_mode, st.st_mtime_ns, st.st_nlink, attrs, open(path, "rb").read()


def test_metadata_writes_outside_scratch_are_refused(box, outside):
    before = _state(outside)
    code = f"""
        import os
        for name, change in [("chmod", lambda: os.chmod({str(outside)!r}, 0o777)),
                             ("utime", lambda: os.utime({str(outside)!r}, (5, 5))),
                             ("xattr", lambda: os.setxattr({str(outside)!r}, "user.mrl", b"1"))]:
            try:
                change()
                print(name, "changed")
            except OSError as err:
                print(name, "refused", err.errno)
        """
    result = box.run_python(_raw(code))
    assert result.ok, result.error
    assert "changed" not in result.stdout, result.stdout
    assert _state(outside) == before


def test_metadata_writes_are_refused_in_fallback_mode(outside):
    before = _state(outside)
    with Sandbox(LIMITS, kernel_isolation=False) as box:
        for code in (f"import os\nos.chmod({str(outside)!r}, 0o777)", f"import os\nos.utime({str(outside)!r}, (5, 5))",
                     f"import os\nos.setxattr({str(outside)!r}, 'user.mrl', b'1')"):
            result = box.run_python(code)
            assert result.error == f"write outside the scratch directory refused: {outside}", code
    assert _state(outside) == before


@pytest.mark.parametrize("kernel_isolation", [True, False], ids=["kernel", "fallback"])
def test_a_hard_link_into_scratch_does_not_write_outside(kernel_isolation, outside):
    before = _state(outside)
    code = f"import os\nos.link({str(outside)!r}, 'door')\nopen('door', 'w').write('escaped')"
    with Sandbox(LIMITS, kernel_isolation=kernel_isolation) as box:
        result = box.run_python(_raw(code) if kernel_isolation else code)
        assert not result.ok or "Error" in result.stderr, (result.error, result.stderr)
        assert _state(outside) == before


def test_cleanup_never_follows_a_symlink_left_in_scratch(tmp_path):
    """What a tool can leave behind: a read-only directory holding a symlink to a file and to a directory
    outside. The parent's clean-up removes the scratch directory without touching their targets."""
    root = tmp_path / "root"
    (root / "scratch" / "locked").mkdir(parents=True)
    target_dir = tmp_path / "precious"
    target_dir.mkdir()
    (target_dir / "keep").write_text("kept")
    target = tmp_path / "precious.txt"
    target.write_text("kept")
    os.chmod(target, 0o400)
    os.chmod(target_dir, 0o500)
    os.symlink(target, root / "scratch" / "locked" / "file")
    os.symlink(target_dir, root / "scratch" / "locked" / "dir")
    os.symlink(target_dir, root / "scratch" / "top")
    os.chmod(root / "scratch" / "locked", 0o500)
    before = (os.stat(target).st_mode, os.stat(target_dir).st_mode)
    _remove_tree(str(root))
    assert (os.stat(target).st_mode, os.stat(target_dir).st_mode) == before
    assert (target_dir / "keep").read_text() == "kept" and target.read_text() == "kept"
    if os.geteuid() != 0:  # root removes a read-only directory without help; others need its mode changed
        assert not root.exists()


@pytest.fixture
def unix_server(tmp_path):
    path = str(tmp_path / "server.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract.bind(f"\0mrl-test-{os.getpid()}")
    abstract.listen(4)
    abstract.setblocking(False)
    yield path, server, abstract
    server.close()
    abstract.close()


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_unix_domain_sockets_outside_are_unreachable(box, unix_server):
    path, server, abstract = unix_server
    code = f"""
        import socket
        for address in ({path!r}, "\\0mrl-test-{os.getpid()}"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(address)
                print("connected")
            except OSError as err:
                print("refused", err.errno)
        """
    result = box.run_python(_raw(code))
    assert result.ok, result.error
    assert "connected" not in result.stdout, result.stdout
    assert not _accepted(server) and not _accepted(abstract)


@pytest.fixture
def victim():
    """A process of this user in its own session: the sandbox must never signal it."""
    process = subprocess.Popen(["sleep", "120"], start_new_session=True)
    yield process
    process.kill()
    process.wait()


def _forge(messages: list[dict], then: str = "") -> str:
    lines = "".join(json.dumps(m) + "\n" for m in messages).encode()
    return (f"import os, stat\nfor fd in range(3, 256):\n    try:\n        if stat.S_ISSOCK(os.fstat(fd).st_mode):\n"
            f"            os.write(fd, {lines!r})\n    except OSError:\n        pass\n{then}")


@pytest.mark.parametrize("kernel_isolation", [True, False], ids=["kernel", "fallback"])
def test_forged_control_messages_kill_nothing_outside(kernel_isolation, victim):
    with Sandbox(LIMITS, kernel_isolation=kernel_isolation) as box:
        # a result, then the protocol's own messages naming another process group
        box.run_python(_forge([{"pid": victim.pid}, {"exit": 0}]))
        time.sleep(0.2)
        assert victim.poll() is None
    with Sandbox(SandboxLimits(wall_time_s=1.0), kernel_isolation=kernel_isolation) as box:
        result = box.run_python(_forge([{"child": victim.pid}, {"pid": victim.pid}], "while True:\n    pass"))
        assert result.error.startswith("timed out")
        time.sleep(0.2)
        assert victim.poll() is None


def test_a_forged_result_is_not_taken_for_the_calls_result(box):
    """A second result is refused; a tool that forges its only result chooses its own output (as it could
    by printing it) but not the containment the parent reports."""
    forged = _forge([{"result": {"ok": True, "value": "forged", "containment": []}}], "raise SystemExit(9)")
    result = box.run_python(forged)
    assert result.value != "forged" and not result.ok
    claimed = _forge([{"contained": ["claimed"]}, {"result": {"ok": True, "containment": ["claimed"]}}],
                     "import os\nos._exit(0)")
    result = box.run_python(claimed)
    assert result.containment == Sandbox.containment(box.limits.backend)


def _needs_cgroups():
    from megatron_rl.recipes.agent.sandbox_cgroups import hierarchies
    if not {"memory", "pids"} <= {name for hierarchy in hierarchies() for name in hierarchy.controllers}:
        pytest.skip("this user may not make cgroups with memory and pids limits here")


def test_memory_limit_is_per_call_across_forked_children():
    """Six children of 90 MiB each: every one fits the per-process address-space limit of 256 MiB, all six
    together (540 MiB) do not fit the call's."""
    _needs_cgroups()
    code = """
        import os, time
        children = []
        for _ in range(6):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                quiet = os.open("/dev/null", os.O_WRONLY)  # the caller waits for its output pipes to close
                os.dup2(quiet, 1)
                os.dup2(quiet, 2)
                try:
                    blob = bytearray(90 << 20)
                    blob[::4096] = b"x" * len(blob[::4096])  # touch every page
                    os.write(w, b"1")
                except MemoryError:
                    pass
                time.sleep(30)
                os._exit(0)
            os.close(w)
            if os.read(r, 1):  # it holds its 90 MiB (or the kernel killed it, or an earlier one, for it)
                children.append(pid)
        time.sleep(0.5)
        print(sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in children))  # holding 90 MiB at once
        """
    with Sandbox(SandboxLimits(wall_time_s=20.0, memory_mb=256)) as box:
        result = box.run_python(_raw(code))
    assert result.ok, (result.error, result.stderr[-300:])
    held = int(result.stdout.strip())
    assert 1 <= held and held * 90 <= 256, held


def test_process_limit_is_per_call_also_for_root():
    _needs_cgroups()
    code = """
        import os, time
        started = 0
        for _ in range(300):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                quiet = os.open("/dev/null", os.O_WRONLY)  # the caller waits for its output pipes to close
                os.dup2(quiet, 1)
                os.dup2(quiet, 2)
                time.sleep(30)
                os._exit(0)
            started += 1
        print(started)
        """
    with Sandbox(SandboxLimits(wall_time_s=20.0, memory_mb=512)) as box:
        result = box.run_python(_raw(code))
    assert result.ok, result.error
    assert int(result.stdout) < 64, result.stdout


def _leading_entries(directory: str, box: Sandbox) -> set[str]:
    """The names in `directory` that lead to something every call may see (the interpreter, its packages,
    this package, the scratch directory): all a private root shows of it."""
    directory = os.path.realpath(directory)
    return {os.path.relpath(os.path.realpath(path), directory).split(os.sep)[0] for path in [*_host_paths(), box.scratch]
            if os.path.realpath(path).startswith(directory + os.sep)}


def test_host_files_are_out_of_sight(box, outside):
    """Of the host the tool sees the system, the interpreter and the package, read-only: not a file next to
    the run, not /etc/shadow, and of the user's home and the working directory (the repository, its runs)
    only the names on the way to the interpreter and the package."""
    if "mountns" not in _layers():
        pytest.skip("no mount namespace for this user here (Landlock's read rules are tested below)")
    home, cwd = os.path.expanduser("~"), os.getcwd()
    code = f"""
        import json, os
        seen = {{}}
        for path in ({str(outside)!r}, "/etc/shadow"):
            try:
                open(path).read(1)
                seen[path] = "read"
            except OSError as err:
                seen[path] = err.errno
        for path in ({home!r}, {cwd!r}):
            try:
                seen[path] = sorted(os.listdir(path))
            except OSError as err:
                seen[path] = []
        print(json.dumps(seen))
        """
    result = box.run_python(_raw(code))
    assert result.ok, result.error
    seen = json.loads(result.stdout)
    assert seen[str(outside)] != "read" and seen["/etc/shadow"] != "read", seen
    for directory in (home, cwd):
        assert set(seen[directory]) <= _leading_entries(directory, box), (directory, seen[directory])
    hidden = set(os.listdir(cwd)) - _leading_entries(cwd, box)
    assert hidden and not hidden & set(seen[cwd])  # the repository's other files (tests, runs) are there to hide


def test_landlock_alone_refuses_reads_outside(outside):
    """Where a kernel has Landlock but no mount namespace for this user, its read rules hide the host's
    files: a sandbox without the private root (the audit hook does not check reads)."""
    if "landlock-read" not in _layers():
        pytest.skip("no Landlock read rules here")
    code = f"""
        try:
            open({str(outside)!r}).read()
            print("read")
        except OSError as err:
            print("refused", err.errno)
        """
    with Sandbox(LIMITS, private_root=False) as box:
        result = box.run_python(textwrap.dedent(code))
    assert result.ok, result.error
    assert "mountns" not in result.containment and "landlock-read" in result.containment
    assert result.stdout.startswith("refused 13"), result.stdout  # EACCES: there, but refused


@pytest.mark.slow
def test_escapes_as_an_unprivileged_user():
    """This file again, as uid/gid 65534 (root only; `setpriv` drops the privileges)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run as another user")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    if subprocess.run([*as_nobody, sys.executable, "-c", "import megatron_rl"], capture_output=True).returncode:
        pytest.skip("uid 65534 cannot run this interpreter (or import the package) here")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    basetemp = tempfile.mkdtemp(prefix="mrl-nobody-")
    try:
        os.chown(basetemp, 65534, 65534)
        done = subprocess.run(
            [*as_nobody, sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
             f"--basetemp={basetemp}/t", "-k", "not unprivileged", os.path.abspath(__file__)],
            cwd=repo, capture_output=True, text=True, env={**os.environ, "HOME": basetemp}, timeout=600)
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    summary = done.stdout.strip().splitlines()[-1:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "passed" in summary[0], summary


def test_calls_leave_no_cgroup_and_dead_owners_cgroups_are_swept():
    """Each call's cgroup is removed after it, also after a timeout; one left by a process that no longer
    exists (a killed trainer) is removed by the sweep that runs before a process's first call."""
    _needs_cgroups()
    from megatron_rl.recipes.agent import sandbox_cgroups

    found = sandbox_cgroups.hierarchies()

    def ours() -> list[str]:
        return [name for h in found for name in os.listdir(h.base)
                if name.startswith(f"{sandbox_cgroups.PREFIX}{os.getpid()}-")]
    with Sandbox(SandboxLimits(wall_time_s=1.0)) as box:
        assert box.run_python("print(1)").ok
        assert box.run_python("while True:\n    pass").error.startswith("timed out")
    deadline = time.monotonic() + 10  # removed off the call's path, once the killed processes are gone
    while ours() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ours() == []
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [os.path.join(h.base, f"{sandbox_cgroups.PREFIX}{dead.pid}-7") for h in found]
    for path in left:
        os.mkdir(path)
    sandbox_cgroups._sweep_dead_owners(found)
    assert not any(os.path.exists(path) for path in left)
