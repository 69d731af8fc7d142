"""scripts/gpu_check.sh rehearsed without a GPU, so that the first lease is not the script's first run:
the plan fits the lease, every section stubbed to fail, hang or crash still leaves a complete JSON and
the right exit status, a deadline leaves later sections unstarted, the set-up refuses what it cannot
serve in one line, and every real section runs at tiny shapes on CPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_rl.cli import gpu_check, gpu_sections

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = [section.name for section in gpu_check.SECTIONS]
SCALE = 0.02  # budgets of 0.9 to 3 s


def _script_budget() -> int:
    text = open(os.path.join(REPO, "scripts/gpu_check.sh")).read()
    return int(re.search(r"GPU_CHECK_BUDGET_S:-(\d+)", text).group(1))


def test_the_plan_fits_one_ten_minute_command():
    planned = gpu_check.plan(_script_budget())
    assert [s["name"] for s in planned["sections"]][:3] == ["env", "decode", "train_bf16"]  # by value
    assert all(s["budget_s"] > 0 for s in planned["sections"])
    assert planned["planned_s"] <= _script_budget() <= 600 - 30  # 30 s for the interpreter, the copy-back
    printed = subprocess.run([sys.executable, "-m", "megatron_rl.cli.gpu_check", "--plan"], capture_output=True,
                             text=True, timeout=60, cwd=REPO)
    assert json.loads(printed.stdout.splitlines()[-1])["planned_s"] == planned["planned_s"]


def _rehearse(tmp_path, mode: str, deadline_s: float = 60.0) -> tuple[int, dict, list[dict]]:
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "-m", "megatron_rl.cli.gpu_check", "--rehearse", mode, "--budget-scale",
                           str(SCALE), "--deadline-s", str(deadline_s), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    result = json.loads(out.read_text())
    assert json.loads(done.stdout.strip().splitlines()[-1]) == result  # the last line is the file's JSON
    return done.returncode, result, [result["sections"][name] for name in NAMES]


def test_every_section_passing_exits_zero(tmp_path):
    code, result, sections = _rehearse(tmp_path, "ok")
    assert code == 0 and result["failed_sections"] == []
    assert all(s["status"] == "ok" for s in sections) and all(result[name] == {"stub": True} for name in NAMES)


@pytest.mark.parametrize("mode", ["fail", "timeout", "crash", "mixed"])
def test_failing_sections_leave_a_complete_json_and_a_failed_exit(tmp_path, mode):
    code, result, sections = _rehearse(tmp_path, mode)
    stubs = [("ok", "fail", "timeout", "crash")[i % 4] if mode == "mixed" else mode for i in range(len(NAMES))]
    statuses = [{"ok": "ok", "fail": "failed", "timeout": "timed_out", "crash": "failed"}[stub] for stub in stubs]
    assert [s["status"] for s in sections] == statuses
    assert code == 1 and result["failed_sections"] == [n for n, s in zip(NAMES, statuses) if s != "ok"]
    for name, section, stub in zip(NAMES, sections, stubs):
        if stub == "timeout":
            assert result[name]["error"].startswith("timed out after") and "hanging" in result[name]["error"]
            assert section["wall_s"] < section["budget_s"] + 6  # SIGTERM of the group, then SIGKILL
        elif stub == "fail":
            assert result[name]["error"].startswith("exit code 1") and "stubbed section failure" in result[name]["error"]
        elif stub == "crash":
            assert result[name]["error"].startswith("killed by SIGSEGV")


def test_a_deadline_leaves_the_later_sections_unstarted(tmp_path):
    code, result, sections = _rehearse(tmp_path, "timeout", deadline_s=3.0)
    assert code == 1 and sections[0]["status"] == "timed_out"
    assert sections[-1]["status"] == "not_started" and result["failed_sections"] == NAMES


def _fake_python(tmp_path, version: str) -> str:
    script = tmp_path / "python3"
    major, minor = (int(x) for x in version.split(".")[:2])
    script.write_text(f'#!/bin/sh\nif [ "$1" = -V ]; then echo "Python {version}"; exit 0; fi\n'
                      f'if [ "$1" = -c ]; then exec "{sys.executable}" -c "import sys; sys.version_info = ({major}, {minor}); '
                      f'exec(sys.argv[1])" "$2"; fi\nexit 1\n')
    script.chmod(0o755)
    return str(script)


def test_setup_refuses_an_old_python_and_a_missing_driver_in_one_line(tmp_path):
    env = dict(os.environ, PYTHON=_fake_python(tmp_path, "3.10.12"), PATH="/usr/bin:/bin")
    old = subprocess.run(["bash", "scripts/setup_gpu.sh", str(tmp_path / "venv")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert old.returncode == 2 and old.stderr.strip().splitlines() == [old.stderr.strip()]
    assert "Python 3.11 or newer" in old.stderr and "3.10.12" in old.stderr
    if any(os.access(os.path.join(d, "nvidia-smi"), os.X_OK) for d in os.environ["PATH"].split(os.pathsep)):
        pytest.skip("this machine has an NVIDIA driver")
    env["PYTHON"] = sys.executable
    no_driver = subprocess.run(["bash", "scripts/setup_gpu.sh", str(tmp_path / "venv")], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=60)
    assert no_driver.returncode == 2 and "no NVIDIA driver" in no_driver.stderr
    assert len(no_driver.stderr.strip().splitlines()) == 1 and not (tmp_path / "venv").exists()


def test_gpu_check_sh_reports_a_failed_setup_as_json(tmp_path):
    """Without a driver the set-up stops at once, and the script still leaves its JSON behind."""
    if os.path.exists(os.path.join(REPO, ".venv-gpu", ".gpu-setup-done")):
        pytest.skip("this checkout has a GPU environment set up")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(OUT=str(tmp_path / "out"), PATH="/usr/bin:/bin")
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    if "nvidia-smi" not in done.stdout + done.stderr and done.returncode == 0:
        pytest.skip("this machine has an NVIDIA driver")
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert done.returncode == 1 and result["failed_sections"] == ["setup"]
    assert "no NVIDIA driver" in result["setup"]["error"]


def test_every_section_runs_at_tiny_shapes(tmp_path):
    """The sections themselves, in this process (the rehearsal above covers the process around them)."""
    facts = tmp_path / "env.json"
    results = {}
    for name in NAMES:
        out = tmp_path / f"{name}.json"
        assert gpu_sections.main([name, "--smoke", "--facts", str(facts), "--out", str(out)]) == 0
        results[name] = json.loads(out.read_text())
        if name == "env":
            facts.write_text(out.read_text())
    env = results["env"]
    assert env["copy_GBps"] > 0 and env["matmul_bf16_TFLOPs"] > 0 and env["torch"]
    assert results["decode"]["tokens_per_s"] > 0 and results["decode"]["hf_tokens_per_s"] > 0
    assert results["decode"]["weight_bytes"] == results["weight_sync"]["bytes"]
    assert results["train_bf16"]["tokens_per_s"] > 0 and 0 < results["train_bf16"]["mfu"] < 1.5
    assert results["packing"]["max_logprob_diff"] <= 1e-5 * max(1.0, results["packing"]["max_abs_logprob"])
    for name in ("logprob", "sglang", "te_fp8"):  # GPU-only here
        assert "skipped" in results[name]


@pytest.mark.slow
def test_gpu_check_sh_smoke_runs_every_section(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:]
    assert result["failed_sections"] == [] and set(result["sections"]) == set(NAMES)


def test_a_broken_transformer_engine_is_not_picked_by_auto(monkeypatch, caplog):
    """An installed TE whose torch extension does not import, or whose one-layer self-test fails, is
    reported with its reason and `layer_spec: auto` takes the local layers."""
    import types

    import torch

    from megatron_rl.trainer import model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)  # import fails
    model.transformer_engine_problem.cache_clear()
    assert model.transformer_engine_problem().startswith("import transformer_engine.pytorch failed: ModuleNotFoundError")

    def broken_linear(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")
    te = types.SimpleNamespace(Linear=broken_linear, fp8_autocast=None)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    sys.modules["transformer_engine"].pytorch = te
    model.transformer_engine_problem.cache_clear()
    assert "FP8 self-test of one TE linear layer failed: RuntimeError: no kernel image" in model.transformer_engine_problem()
    with caplog.at_level("WARNING"):
        assert model.resolve_layer_spec("auto") == "local"
    assert "Transformer Engine is not usable" in caplog.text
    model.transformer_engine_problem.cache_clear()
