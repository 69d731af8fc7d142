"""The agent sandbox (megatron_rl/recipes/agent/sandbox.py): an infinite loop, a memory bomb, a network call
and a write outside the scratch directory each end as one error line while this process goes on; the
scratch directory is removed; no process outlives a call. Every containment test runs twice: with the
kernel layers this machine grants (namespaces, Landlock) and with the fallback (rlimits + audit hook)."""
from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import types
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits, _ForkServer

# generous wall time: the machine running the tests may be busy; only the loop test waits for it
LIMITS = SandboxLimits(wall_time_s=10.0, memory_mb=256, output_chars=1000)


@pytest.fixture(params=[True, False], ids=["kernel", "fallback"])
def sandbox(request):
    with Sandbox(LIMITS, kernel_isolation=request.param) as box:
        yield box


def _kernel_layers(sandbox: Sandbox) -> set[str]:
    return set(Sandbox.containment()) if sandbox.kernel_isolation else set()


@pytest.fixture
def kernel_sandbox():
    with Sandbox(LIMITS) as box:
        yield box


def _processes_with(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def test_runs_code_in_its_scratch_directory(sandbox):
    first = sandbox.run_python("import os\nopen('notes.txt', 'w').write('kept')\n"
                               "print(os.getcwd(), os.environ['HOME'], os.environ['TMPDIR'])")
    assert first.ok and first.error is None
    assert first.stdout.split() == [sandbox.scratch] * 3
    second = sandbox.run_python("print(open('notes.txt').read())")
    assert second.ok and second.stdout == "kept\n"
    assert open(os.path.join(sandbox.scratch, "notes.txt")).read() == "kept"
    assert "rlimits" in second.containment and any(layer.startswith("audit-hook") for layer in second.containment)


@pytest.mark.parametrize("kernel_isolation", [True, False], ids=["kernel", "fallback"])
def test_infinite_loop_times_out_and_the_next_call_works(kernel_isolation):
    with Sandbox(SandboxLimits(wall_time_s=1.5), kernel_isolation=kernel_isolation) as box:
        result = box.run_python("print('started', flush=True)\nwhile True:\n    pass")
        assert not result.ok
        assert result.error.startswith("timed out after 1.5 s")
        assert result.stdout == "started\n"
        box.limits = LIMITS  # the next call gets the generous limit: a busy machine must not fail it
        assert box.run_python("print(6 * 7)").stdout == "42\n"


def test_memory_bomb_is_a_memory_error(sandbox):
    result = sandbox.run_python("blob = bytearray(8 * 1024 ** 3)")
    assert not result.ok and result.error == "memory limit 256 MiB exceeded"
    growing = sandbox.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(32 * 1024 ** 2))")
    assert not growing.ok and growing.error == "memory limit 256 MiB exceeded"
    assert sandbox.run_python("print('alive')").stdout == "alive\n"


@pytest.fixture
def listener():
    """A TCP server of this test process on loopback: reachable from any process of this machine."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


def _was_contacted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_network_call_is_refused(sandbox, listener):
    port = listener.getsockname()[1]
    result = sandbox.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
    assert not result.ok and result.error == "network access is disabled"
    lookup = sandbox.run_python("import socket\nsocket.getaddrinfo('pypi.org', 443)")
    assert lookup.error == "network access is disabled"
    assert not _was_contacted(listener)


def test_network_is_refused_by_the_kernel_below_the_audit_hook(kernel_sandbox, listener):
    """A fresh interpreter started inside the sandbox has no audit hook: the namespace / Landlock stop it."""
    layers = set(Sandbox.containment())
    if not layers & {"netns", "landlock-net"}:
        pytest.skip("no kernel network isolation for unprivileged users here")
    port = listener.getsockname()[1]
    code = (f"import subprocess, sys\nprobe = 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)'\n"
            "done = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True)\n"
            "print(done.returncode)\nprint(done.stderr.strip().splitlines()[-1])")
    result = kernel_sandbox.run_python(code)
    assert result.ok, result.error
    returncode, error = result.stdout.splitlines()
    assert returncode != "0" and ("Permission denied" in error or "unreachable" in error), error
    assert not _was_contacted(listener)


def test_write_outside_the_scratch_directory_is_refused(sandbox, tmp_path):
    target = tmp_path / "outside.txt"  # writable by this user: only the sandbox stands in the way
    result = sandbox.run_python(f"open({str(target)!r}, 'w').write('escaped')")
    assert not result.ok
    assert result.error == f"write outside the scratch directory refused: {target}"
    link = sandbox.run_python(f"import os\nos.symlink({str(tmp_path)!r}, 'door')\nopen('door/outside.txt', 'w')")
    assert link.error == f"write outside the scratch directory refused: {target}"
    moved = sandbox.run_python(f"import os\nopen('a', 'w').close()\nos.rename('a', {str(target)!r})")
    assert moved.error == f"write outside the scratch directory refused: {target}"
    assert not target.exists()


def test_writes_are_refused_by_the_kernel_below_the_audit_hook(kernel_sandbox, tmp_path):
    if "landlock-fs" not in set(Sandbox.containment()):
        pytest.skip("no Landlock for unprivileged users here")
    target = tmp_path / "outside.txt"
    result = kernel_sandbox.run_python(f"import os\nprint(os.system('echo escaped > {target}'))")
    assert result.ok and result.stdout.strip() != "0"
    # refused by Landlock, or (in a private root) the directory does not exist for the tool
    assert "Permission denied" in result.stderr or "nonexistent" in result.stderr, result.stderr
    assert not target.exists()


def test_process_creation_without_kernel_isolation_is_refused():
    with Sandbox(LIMITS, kernel_isolation=False) as box:
        result = box.run_python("import os\nos.system('true')")
    assert result.error == "process creation is disabled (no kernel sandbox on this machine)"


def test_no_process_outlives_a_call(sandbox):
    """Background processes (one in its own session, one double-forked daemon) die with the call, also when
    the call times out."""
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997 + 1}"
    spawn = (f"import os, subprocess, sys\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
             f"if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '{marker}'])\n")
    if "pidns" not in _kernel_layers(sandbox):
        refused = sandbox.run_python(spawn)
        assert refused.error == "process creation is disabled (no kernel sandbox on this machine)"
    else:
        assert sandbox.run_python(spawn).ok
        assert _processes_with(marker) == []
        with Sandbox(SandboxLimits(wall_time_s=1.5)) as short:
            looping = short.run_python(spawn + "while True:\n    pass")
        assert looping.error.startswith("timed out")
    assert _processes_with(marker) == []
    assert _processes_with(sandbox.scratch) == []


def test_tool_crashes_are_error_results(sandbox):
    raised = sandbox.run_python("def f():\n    raise ValueError('boom')\nf()")
    assert not raised.ok and raised.error == "ValueError: boom"
    assert 'File "<tool>", line 2, in f' in raised.stderr and "raise ValueError('boom')" in raised.stderr
    assert "sandbox_child" not in raised.stderr
    syntax = sandbox.run_python("def f(:\n")
    assert syntax.error.startswith("SyntaxError:") and "(line 1)" in syntax.error
    exited = sandbox.run_python("import os\nos._exit(7)")
    assert exited.error == "sandbox process exited with code 7 without a result"
    crashed = sandbox.run_python("import ctypes\nctypes.string_at(0)")  # a real segmentation fault
    assert crashed.error == ("sandbox process killed by SIGSEGV" if sandbox.kernel_isolation
                             else "ctypes is disabled (no kernel sandbox on this machine)")
    assert sandbox.run_python("import sys\nsys.exit(0)").ok
    assert sandbox.run_python("import sys\nsys.exit(4)").error == "exited with code 4"


def test_call_returns_json_values_and_errors(sandbox):
    result = sandbox.call("megatron_rl.recipes.agent.arithmetic:calculate", {"expression": "12345*6789"})
    assert result.ok and result.value == {"result": str(12345 * 6789)}
    assert sandbox.call("json:loads", {"s": "[1, 2]"}).value == [1, 2]
    missing = sandbox.call("no_such_module_here:f", {})
    assert missing.error == "ModuleNotFoundError: No module named 'no_such_module_here'"
    not_json = sandbox.call("builtins:set", {})
    assert not not_json.ok and not_json.error.startswith("the return value is not JSON")
    assert sandbox.call("not a target", {}).error.startswith("sandbox call: expected 'module:function'")
    assert sandbox.call("json:dumps", {"obj": object()}).error.startswith("sandbox call json:dumps: arguments")


def test_an_oversized_return_value_is_an_error(sandbox):
    result = sandbox.call("textwrap:indent", {"text": "x\n" * 1000, "prefix": "y" * 20_000})
    assert not result.ok and result.error == "the result is larger than 16 MiB"
    assert sandbox.call("textwrap:indent", {"text": "a\nb", "prefix": "> "}).value == "> a\n> b"


def test_output_is_truncated(sandbox):
    result = sandbox.run_python("print('x' * 100_000)\nimport sys\nprint('y' * 5000, file=sys.stderr)")
    assert result.ok
    assert result.stdout.startswith("x" * 1000) and "[output truncated: 100001 bytes in all]" in result.stdout
    assert len(result.stdout) < 1100 and len(result.stderr) < 1100


def test_scratch_directory_is_removed_even_when_read_only():
    box = Sandbox(LIMITS)
    scratch = box.scratch
    assert box.run_python("import os\nos.makedirs('locked/inner')\nopen('locked/inner/f', 'w').close()\n"
                          "os.chmod('locked/inner', 0o500)\nos.chmod('locked', 0o500)").ok
    box.close()
    assert not os.path.exists(scratch) and not os.path.exists(os.path.dirname(scratch))
    with pytest.raises(RuntimeError, match="closed"):
        box.run_python("pass")


def test_network_can_be_allowed(listener):
    """`network=True` lifts the network layers (the write rules stay)."""
    port = listener.getsockname()[1]
    with Sandbox(SandboxLimits(wall_time_s=5.0, network=True)) as box:
        result = box.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).close()")
        assert result.ok, result.error
        assert not {"netns", "landlock-net"} & set(result.containment)
    assert _was_contacted(listener)


@pytest.mark.parametrize("field, value", [("wall_time_s", 0), ("memory_mb", 10), ("output_chars", -1)])
def test_bad_limits_are_config_errors(field, value):
    with pytest.raises(ConfigError, match=field):
        SandboxLimits(**{field: value})


def test_the_sandbox_runs_this_interpreter():
    with Sandbox(LIMITS) as box:
        assert box.run_python("import sys\nprint(sys.executable)").stdout.strip() == sys.executable


def test_concurrent_calls_keep_their_own_output():
    with Sandbox(LIMITS) as box, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: box.run_python(f"print({i} * {i})"), range(12)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(12)]


def test_a_dead_fork_server_is_replaced():
    with Sandbox(LIMITS) as box:
        assert box.run_python("print(1)").ok
        server = _ForkServer.get()
        server.process.kill()
        server.process.wait()
        assert box.run_python("print(2)").stdout == "2\n"
        assert _ForkServer.get() is not server


def _without_cgroups(monkeypatch):
    from megatron_rl.recipes.agent import sandbox as sandbox_module
    present = tuple(layer for layer in Sandbox.containment() if not layer.startswith("cgroup-"))
    monkeypatch.setattr(sandbox_module, "_probe_containment", lambda backend="native": present)
    monkeypatch.setattr(sandbox_module, "_reported", threading.Lock())


def test_a_required_layer_group_that_is_missing_refuses_the_run(monkeypatch, caplog):
    """`agent.sandbox.require` refuses a machine without the group (one line naming it and its missing
    layers); without it the run goes on and says once what it falls back to."""
    from megatron_rl.recipes.agent.config import AgentConfig
    from megatron_rl.recipes.agent.recipe import tool_environment_factory
    from megatron_rl.recipes.agent.sandbox import SandboxConfig

    _without_cgroups(monkeypatch)
    agent = AgentConfig(sandbox=SandboxConfig(require=["cgroups"]), few_shot=0)
    with pytest.raises(ConfigError, match=r"agent.sandbox.require: cgroups .*missing: cgroup-memory, cgroup-pids"):
        tool_environment_factory(agent, types.SimpleNamespace(chat_template=None))
    with caplog.at_level("INFO"):
        make = tool_environment_factory(AgentConfig(few_shot=0), types.SimpleNamespace(chat_template=None))
        tool_environment_factory(AgentConfig(few_shot=0), types.SimpleNamespace(chat_template=None))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "cgroups (cgroup-memory, cgroup-pids)" in warnings[0], warnings
    assert callable(make)


def test_unknown_layer_groups_are_config_errors():
    from megatron_rl.recipes.agent.sandbox import SandboxConfig
    with pytest.raises(ConfigError, match="require"):
        SandboxConfig(require=["gvisor"])


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bwrap is not installed (apt-get install bubblewrap)")
def test_the_bubblewrap_backend_contains_and_times_out_like_the_native_one():
    """`backend: bubblewrap` builds the namespaces and the private root with bwrap; the rest of the layers
    and the parent's side are the same: a write outside fails, a loop times out and leaves no process."""
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997 + 1}"
    with Sandbox(SandboxLimits(wall_time_s=60.0, backend="bubblewrap")) as box:  # a fresh interpreter, busy machine
        first = box.run_python("import os\nopen('notes.txt', 'w').write('kept')\nprint(os.getcwd())")
        assert first.ok and first.stdout.strip() == box.scratch, first.error
        assert {"bubblewrap", "mountns", "pidns", "landlock-fs"} <= set(first.containment)
        assert box.run_python("print(open('notes.txt').read())").stdout == "kept\n"
    with Sandbox(SandboxLimits(wall_time_s=3.0, backend="bubblewrap")) as box:
        looping = box.run_python(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
                                 "while True:\n    pass")
        assert looping.error.startswith("timed out")
    assert _processes_with(marker) == []


def test_a_missing_bwrap_is_refused_by_name(monkeypatch):
    from megatron_rl.recipes.agent import sandbox as sandbox_module
    from megatron_rl.recipes.agent.sandbox import SandboxConfig, check_containment
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="agent.sandbox.backend: bubblewrap needs the `bwrap` program"):
        check_containment(SandboxConfig(backend="bubblewrap"))
