"""What a hostile user found (issue 23): paths that deleted what they did not write, numbers that
turned weights into inf, duplicate keys, and errors that were tracebacks. Each test runs the real
entry point (`megatron_rl.cli.main`, in-process) or the function it guards."""
from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch

import megatron_rl.cli.config as config_command
import megatron_rl.cli.train as train_command
from megatron_rl.algorithms.losses import K3_MAX, kl_penalty
from megatron_rl.checkpoint import manager as checkpoint_manager
from megatron_rl.checkpoints_tools.convert import convert
from megatron_rl.cli import main
from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import build_controller
from megatron_rl.observability.run_log import LOCK_FILE, PREVIOUS_RUNS, RunDirLock, prepare_run_dir
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.weight_sync.shared_memory import SharedBuckets, reclaim_stale
from tests.test_reliability import _config, _overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "examples", "configs", "quickstart.yaml")


def _run(capsys, *argv):
    """`megatron-rl ARGV` in-process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(code, err, *fragments):
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- config: numbers, duplicate keys, encodings, cross-section constraints ----------------------------------

@pytest.mark.parametrize("override, bound", [
    ("trainer.lr=inf", "must be a finite number"),
    ("trainer.lr=.nan", "must be a finite number"),
    ("trainer.lr=2", "[0, 1]"),
    ("trainer.min_lr=1e-3", "[0, lr="),
    ("trainer.adam_eps=0", "(0, 1)"),
    ("trainer.clip_grad=-1", ">= 0"),
    ("rollout.temperature=inf", "must be a finite number"),
    ("rollout.temperature=1e9", "[0, 100]"),
    ("rollout.top_p=1.5", "(0, 1]"),
    ("rollout.top_p=.nan", "must be a finite number"),
    ("algorithm.loss.kl_coef=-1", "[0, 1000]"),
    ("algorithm.loss.kl_coef=1e6", "[0, 1000]"),
    ("algorithm.loss.clip_eps_low=1", "[0, 1)"),
    ("algorithm.loss.clip_eps_high=1e9", "[0, 1000]"),
    ("algorithm.loss.dual_clip_c=-inf", "must be a finite number"),
    ("algorithm.loss.entropy_coef=-0.1", "[0, 1000]"),
    ("algorithm.loss.log_ratio_clamp=1000", "(0, 88]"),
    ("algorithm.advantage.eps=-1", "[0, 1]"),
])
def test_nonfinite_and_absurd_numbers_are_refused_with_the_bound(capsys, override, bound):
    field = override.split("=")[0]
    _one_line_error(*_run(capsys, "config", QUICKSTART, override)[::2], f"'{field}'", bound)


def test_direct_construction_refuses_nonfinite_too():
    for bad in (math.inf, math.nan, -1e-3):
        with pytest.raises(ConfigError, match="field 'lr': must be a finite number in \\[0, 1\\]"):
            TrainerConfig(lr=bad)
        with pytest.raises(ConfigError, match="field 'temperature'"):
            RolloutConfig(temperature=bad)


def test_duplicate_yaml_keys_are_refused_with_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text("trainer:\n  lr: 1.0e-6\n  micro_batch_size: 4\n  lr: 1.0e-3\nsteps: 2\n")
    _one_line_error(*_run(capsys, "config", str(recipe))[::2],
                    f"{recipe}:4: duplicate key 'trainer.lr' (first set at line 2)")
    recipe.write_text("trainer:\n  lr: 1.0e-6\nsteps: 2\ntrainer:\n  micro_batch_size: 4\n")
    _one_line_error(*_run(capsys, "config", str(recipe))[::2], f"{recipe}:4: duplicate key 'trainer'")
    # The same key in two sections is not a duplicate.
    recipe.write_text("trainer:\n  lr: 1.0e-6\nmodel:\n  path: x\nsteps: 2\n")
    assert _run(capsys, "config", str(recipe))[0] == 0


def test_non_utf8_and_bom_yaml(tmp_path, capsys):
    recipe = tmp_path / "latin1.yaml"
    text = "steps: 2  # caf\u00e9\n"
    recipe.write_bytes(text.encode("latin-1"))
    _one_line_error(*_run(capsys, "config", str(recipe))[::2],
                    f"{recipe}: config file is not UTF-8 text (byte {text.index(chr(0xe9))}")
    recipe.write_bytes(b"\xef\xbb\xbfsteps: 3\n")  # a byte-order mark is UTF-8: read, not refused
    code, out, _ = _run(capsys, "config", str(recipe))
    assert code == 0 and "steps: 3" in out
    _one_line_error(*_run(capsys, "config", str(tmp_path))[::2], "config file not found")


@pytest.mark.parametrize("estimator, extra, refused", [
    ("grpo", [], True), ("rloo", [], True),
    ("reinforce_pp", ["algorithm.advantage.group_baseline=true"], True),
    ("reinforce_pp", [], False),
])
def test_group_relative_estimator_with_one_sample_per_prompt(capsys, estimator, extra, refused):
    code, _, err = _run(capsys, "config", QUICKSTART, "rollout.samples_per_prompt=1",
                        f"algorithm.advantage.estimator={estimator}", *extra)
    if refused:
        _one_line_error(code, err, "'rollout.samples_per_prompt'", "must be >= 2", estimator)
    else:
        assert code == 0, err
    # The SFT objective trains on references: one sample per prompt is its normal setting.
    assert _run(capsys, "config", QUICKSTART, "rollout.samples_per_prompt=1", "algorithm.objective=sft")[0] == 0


# --- the k3 KL estimator is bounded ---------------------------------------------------------------------------

def test_k3_is_bounded_and_matches_the_exact_kl_where_unclamped():
    # Brute force: KL(pi || ref) of small categorical distributions by enumeration, against the
    # expectation of k3 under pi (also by enumeration, no sampling): equal where no token is clamped.
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        pi = torch.softmax(torch.randn(7, generator=gen, dtype=torch.float64) * 0.5, 0)
        ref = torch.softmax(torch.randn(7, generator=gen, dtype=torch.float64) * 0.5, 0)
        exact = sum(p * math.log(p / r) for p, r in zip(pi.tolist(), ref.tolist()))
        k3 = kl_penalty(pi.log(), ref.log(), "k3")
        assert k3.max() < K3_MAX
        assert float((pi * k3).sum()) == pytest.approx(exact, rel=1e-9, abs=1e-12)
    # A token 100 nats less likely under pi than under the reference: finite loss, finite gradient,
    # equal to the documented bound; every value equals min(K3_MAX, k3 of the clamped log-ratio).
    delta = torch.tensor([-100.0, -30.0, -2.0, 0.0, 3.0, 15.0, 100.0], dtype=torch.float64, requires_grad=True)
    values = kl_penalty(delta, torch.zeros_like(delta), "k3")
    values.sum().backward()
    assert torch.isfinite(values).all() and torch.isfinite(delta.grad).all()
    for d, v in zip(delta.tolist(), values.tolist()):
        c = min(max(d, -20.0), 20.0)
        assert v == pytest.approx(min(K3_MAX, math.exp(-c) + c - 1.0), rel=1e-12)
    assert values[0].item() == K3_MAX
    for estimator in ("k1", "k2"):  # finite for finite inputs, unchanged
        assert torch.isfinite(kl_penalty(delta.detach(), torch.zeros_like(delta), estimator)).all()


# --- run directories: lock, reuse, resume ----------------------------------------------------------------------

def _train_args(run_dir, *extra):
    return ["train", QUICKSTART, f"run_dir={run_dir}", "logging.wandb=disabled", *extra]


def _previous_run(run_dir):
    """A finished run's records: checkpoints at steps 5 and 6, metrics and ledger of 6 steps."""
    os.makedirs(run_dir)
    for step in (5, 6):
        step_dir = os.path.join(run_dir, "checkpoints", f"step_{step:08d}")
        os.makedirs(step_dir)
        open(os.path.join(step_dir, "COMPLETE"), "w").write("ok\n")
    open(os.path.join(run_dir, "checkpoints", "latest"), "w").write("step_00000006\n")
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "train/loss": 0.5}) + "\n" for s in range(1, 7))
    with open(os.path.join(run_dir, "prompts.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "prompts": [f"p{s}"], "skipped": []}) + "\n" for s in range(1, 7))
    return _snapshot(run_dir)


def _snapshot(root):
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name != LOCK_FILE:
                path = os.path.join(folder, name)
                out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


def test_a_second_run_in_a_locked_run_dir_exits_2_naming_the_holder(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    with RunDirLock(run_dir):
        line = _one_line_error(*_run(capsys, *_train_args(run_dir))[::2], "is in use by another run")
        assert f"pid {os.getpid()}" in line
    with RunDirLock(run_dir):  # released: taken again
        pass


def test_a_fresh_run_in_a_used_run_dir_refuses_and_touches_nothing(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    before = _previous_run(run_dir)
    _one_line_error(*_run(capsys, *_train_args(run_dir))[::2], "holds a previous run", "checkpoints",
                    "metrics.jsonl", "--resume", "--fresh")
    assert _snapshot(run_dir) == before


def test_resume_without_a_checkpoint_refuses_to_cut_the_history(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    before = _previous_run(run_dir)
    shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    before = {k: v for k, v in before.items() if not k.startswith("checkpoints")}
    _one_line_error(*_run(capsys, *_train_args(run_dir), "--resume")[::2], "--resume: no checkpoint",
                    "metrics.jsonl", "prompts.jsonl", "--fresh")
    assert _snapshot(run_dir) == before
    _one_line_error(*_run(capsys, *_train_args(run_dir), "--resume", "--fresh")[::2], "exclude each other")
    # An empty (or new) run directory: --resume starts from scratch, nothing to lose.
    prepare_run_dir(str(tmp_path / "new"), resume=True, fresh=False, checkpoint=None)


def test_run_dir_that_is_a_file(tmp_path, capsys):
    path = tmp_path / "run"
    path.write_text("not a directory")
    _one_line_error(*_run(capsys, *_train_args(path))[::2], f"run_dir {path} is a file")
    assert path.read_text() == "not a directory"


def test_fresh_moves_the_previous_run_aside_and_trains(tmp_path, tiny_chat_model, capsys):
    run_dir = str(tmp_path / "run")
    before = _previous_run(run_dir)
    code, out, err = _run(capsys, "train", QUICKSTART, *_overrides(tiny_chat_model, run_dir, "steps=1"), "--fresh")
    assert code == 0, err
    moved = os.listdir(os.path.join(run_dir, PREVIOUS_RUNS))
    assert len(moved) == 1 and f"moved the previous run's" in err
    assert _snapshot(os.path.join(run_dir, PREVIOUS_RUNS, moved[0])) == before  # every file, byte for byte
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == [1]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["latest", "step_00000001"]


# --- convert never deletes what it did not write ---------------------------------------------------------------

def test_convert_refuses_to_overwrite_what_it_did_not_write(tmp_path, tiny_chat_model, capsys):
    source = str(tmp_path / "src")
    shutil.copytree(tiny_chat_model, source)
    source_files = _snapshot(source)
    unrelated = tmp_path / "precious"
    unrelated.mkdir()
    (unrelated / "thesis.tex").write_text("years of work")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    for output, extra, message in [
        (unrelated, [], "exists; choose another OUTPUT, or add --overwrite"),
        (unrelated, ["--overwrite"], "is not a directory megatron-rl convert wrote"),
        (a_file, ["--overwrite"], "is not a directory megatron-rl convert wrote"),
        (source, ["--overwrite"], "is the SOURCE"),
        (os.path.join(source, "inner"), [], "overlaps the SOURCE"),
    ]:
        _one_line_error(*_run(capsys, "convert", source, str(output), "--to", "hf", *extra)[::2], message)
    assert (unrelated / "thesis.tex").read_text() == "years of work" and a_file.read_text() == "keep me"
    assert _snapshot(source) == source_files
    # An earlier conversion is replaced only with --overwrite.
    out = str(tmp_path / "out")
    assert _run(capsys, "convert", source, out, "--to", "megatron")[0] == 0
    _one_line_error(*_run(capsys, "convert", source, out, "--to", "hf")[::2], "--overwrite")
    assert _run(capsys, "convert", source, out, "--to", "hf", "--overwrite")[0] == 0
    assert os.path.isfile(os.path.join(out, "model.safetensors")) and not any(
        n.startswith("mp_rank_") for n in os.listdir(out))
    # A file the user added to that conversion is never deleted by --overwrite, nor is a directory of theirs
    # named like the writer's old backup name.
    notes = os.path.join(out, "MY_NOTES.txt")
    with open(notes, "w") as f:
        f.write("mine")
    backup_like = tmp_path / "out.old"
    backup_like.mkdir()
    (backup_like / "kept.txt").write_text("also mine")
    _one_line_error(*_run(capsys, "convert", source, out, "--to", "hf", "--overwrite")[::2],
                    "holds files convert did not write there (MY_NOTES.txt)")
    assert open(notes).read() == "mine"
    os.rename(notes, tmp_path / "MY_NOTES.txt")
    assert _run(capsys, "convert", source, out, "--to", "hf", "--overwrite")[0] == 0
    assert (backup_like / "kept.txt").read_text() == "also mine"
    assert not [n for n in os.listdir(tmp_path) if n.startswith((".old-", ".tmp-"))]
    # The writer refuses too (a program calling it directly): the output is not replaced.
    with pytest.raises(ConfigError, match="is not a directory megatron-rl convert wrote"):
        convert(source, str(unrelated), to="hf")
    assert os.listdir(unrelated) == ["thesis.tex"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


# --- one error path for the CLI ----------------------------------------------------------------------------

@pytest.mark.parametrize("raised, expected", [
    (OSError(errno.ENOSPC, "No space left on device", "/ckpt/step_00000004.tmp/model"),
     "/ckpt/step_00000004.tmp/model: No space left on device (the disk is full"),
    (PermissionError(errno.EACCES, "Permission denied", "/runs/ro/.lock"), "/runs/ro/.lock: Permission denied"),
    (IsADirectoryError(errno.EISDIR, "Is a directory", "/data/train.jsonl"), "/data/train.jsonl: Is a directory"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.jsonl"), "/data/x.jsonl: No such file"),
    # what safetensors raises when the disk fills during `convert` (its own error types, ENOSPC in the text)
    (type("SafetensorError", (Exception,), {})("Error while serializing: I/O error: No space left on device "
                                                "(os error 28)"), "SafetensorError: no space left on device"),
    (Exception("No space left on device"), "Exception: no space left on device (the disk is full"),
])
def test_user_caused_os_errors_are_one_line(monkeypatch, capsys, raised, expected):
    def fail(args):
        raise raised

    monkeypatch.setattr(config_command, "run", fail)
    _one_line_error(*_run(capsys, "config", QUICKSTART)[::2], expected)


def test_undecodable_user_file_is_named(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "tokenizer_config.json"
    content = b'{"a": "\xff\xfe"}'
    bad.write_bytes(content)

    def read(args):
        with open(bad, encoding="utf-8") as f:
            return json.load(f)

    monkeypatch.setattr(config_command, "run", read)
    _one_line_error(*_run(capsys, "config", QUICKSTART)[::2], f"{bad}: not utf-8 text (byte {content.index(0xff)}")


def test_ctrl_c_and_sigterm_are_one_line_and_a_bug_keeps_its_traceback(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "run", interrupted)
    code, _, err = _run(capsys, "train", QUICKSTART)
    assert code == 130 and err.strip() == ("megatron-rl train: interrupted; the run directory keeps its last "
                                           "checkpoint: continue with --resume")

    def preempted(args):  # a scheduler's SIGTERM unwinds the run like Ctrl-C (finally-blocks free memory)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(train_command, "run", preempted)
    handler = signal.getsignal(signal.SIGTERM)
    code, _, err = _run(capsys, "train", QUICKSTART)
    assert code == 143 and err.strip() == ("megatron-rl train: terminated (SIGTERM); the run directory keeps its "
                                           "last checkpoint: continue with --resume")
    assert signal.getsignal(signal.SIGTERM) is handler  # restored for whoever called main in-process

    def bug(args):
        raise KeyError("internal")

    monkeypatch.setattr(train_command, "run", bug)
    with pytest.raises(KeyError):
        main(["train", QUICKSTART])
    def ours(args):
        raise FileNotFoundError("no errno and no path: raised by our code")

    monkeypatch.setattr(train_command, "run", ours)
    with pytest.raises(FileNotFoundError):  # an OSError without a user's path is a bug of ours
        main(["train", QUICKSTART])


def test_eval_refuses_bad_sampling_flags(capsys):
    _one_line_error(*_run(capsys, "eval", QUICKSTART, "--temperature", "inf")[::2], "--temperature", "[0, 100]")
    _one_line_error(*_run(capsys, "eval", QUICKSTART, "--samples", "0")[::2], "--samples must be >= 1")


# --- shared memory and semaphores: released, and reclaimed from dead runs --------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_shared_memory_of_dead_runs_is_reclaimed_by_owner_pid(tmp_path, caplog):
    dead, alive = _dead_pid(), os.getppid()
    names = {f"megatron_rl_weights_{dead}_abc_0": 4096, f"sem.mp-megatron_rl-{dead}-x1y2z3": 32,
             f"megatron_rl_weights_{alive}_abc_0": 4096, f"sem.mp-megatron_rl-{alive}-q": 32,
             "sem.mp-someoneelse": 32, "unrelated_file": 8}
    for name, size in names.items():
        (tmp_path / name).write_bytes(b"\0" * size)
    removed = reclaim_stale(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(n for n in names if str(dead) in n)
    assert sorted(os.listdir(tmp_path)) == sorted(n for n in names if str(dead) not in n)
    err = caplog.text  # a warning: on stderr under the CLI (observability/logs.py)
    assert f"reclaimed 2 shared-memory files (0.0 MiB) in {tmp_path} left by dead runs (pids {dead})" in err
    # Creating buckets reclaims too, and unlink frees what it created.
    (tmp_path / f"megatron_rl_weights_{dead}_def_0").write_bytes(b"\0" * 64)
    buckets = SharedBuckets.create([("w", (4, 4), torch.float32)], directory=str(tmp_path))
    assert not (tmp_path / f"megatron_rl_weights_{dead}_def_0").exists()
    assert all(os.path.isfile(p) and f"_{os.getpid()}_" in p for p in buckets.descriptor.paths)
    buckets.unlink()
    assert not any(os.path.exists(p) for p in buckets.descriptor.paths)


def test_generator_restart_is_logged_and_counted(tmp_path, tiny_chat_model, caplog):
    config = _config(tiny_chat_model, str(tmp_path / "run"), "rollout.max_staleness=1",
                     "rollout.placement=disaggregated")
    controller = build_controller(config)
    try:
        first = controller.train_step()
        assert first["rollout/generator_restarts"] == 0.0
        pid = controller.engine.pid
        controller.engine.kill()
        metrics = [controller.train_step() for _ in range(2)]
        assert metrics[-1]["rollout/generator_restarts"] == 1.0
    finally:
        controller.close()
    assert f"generator process {pid} died (exit code -9); restarting it from the latest weights (restart 1)" \
        in caplog.text


def _owner(name: str) -> int | None:
    match = re.match(r"^(?:megatron_rl_weights_|sem\.mp-megatron_rl-)(\d+)[_-]", name)
    return int(match.group(1)) if match else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _shm_leaks(before: set[str]) -> list[str]:
    """Entries of /dev/shm created since `before` by a megatron_rl process that is gone (weight arenas
    and semaphores carry the owner's pid: megatron_rl_weights_PID_*, sem.mp-megatron_rl-PID-*). Live
    runs of other tests, and other programs' semaphores on a shared machine, are not judged."""
    return sorted(n for n in set(os.listdir("/dev/shm")) - before if _owner(n) is not None and not _alive(_owner(n)))


def _async_train(run_dir, model, *extra, **popen):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", QUICKSTART,
                             *_overrides(model, run_dir, "steps=6", "rollout.max_staleness=2",
                                         "rollout.placement=disaggregated", *extra), "--resume"],
                            cwd=REPO, env=env, start_new_session=True, **popen)


def _wait_for(condition, proc, timeout=240.0):
    deadline = time.monotonic() + timeout
    while not condition() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition(), "the run ended or stalled before the point to interrupt it"


def _has_arenas(pid: int) -> bool:
    return any(n.startswith(f"megatron_rl_weights_{pid}_") for n in os.listdir("/dev/shm"))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_group_sigkills_leak_no_shared_memory_or_semaphores(tmp_path, tiny_chat_model):
    """10 SIGKILLs of an asynchronous run's whole process group (controller, generator process,
    multiprocessing's resource tracker: nobody left to clean up), each once its weight arenas and queue
    semaphores exist, then one run to the end: /dev/shm holds exactly what it held before (of ours;
    see _shm_leaks). Each restart reclaims the previous run's files, so they never pile up."""
    before = set(os.listdir("/dev/shm"))
    run_dir = str(tmp_path / "run")
    rng = random.Random(23)
    kills, left = 0, []
    for attempt in range(10):
        with open(tmp_path / f"attempt{attempt}.log", "w") as log:
            proc = _async_train(run_dir, tiny_chat_model, stdout=log, stderr=subprocess.STDOUT)
            _wait_for(lambda: _has_arenas(proc.pid), proc)
            time.sleep(rng.uniform(0.0, 2.0))  # before or after its queues, its first steps
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            kills += 1
            leaks = _shm_leaks(before)
            left.append(len(leaks))
            # only the run just killed has files there: its start reclaimed those of the one before
            assert {_owner(name) for name in leaks} <= {proc.pid}, leaks
    assert left[-1] > 0, "the kills should have left files behind for the restart to reclaim"
    with open(tmp_path / "final.log", "w") as log:
        proc = _async_train(run_dir, tiny_chat_model, stdout=log, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=600) == 0, open(tmp_path / "final.log").read()[-3000:]
    final = open(tmp_path / "final.log").read()
    assert "reclaimed" in final and "left by dead runs" in final
    print(f"{kills} group SIGKILLs, files left after each: {left}; final run: "
          f"{final[final.index('reclaimed'):].splitlines()[0]}")
    assert _shm_leaks(before) == []


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_and_the_run_resumes(tmp_path, tiny_chat_model):
    """SIGINT to the whole process group (as Ctrl-C does) mid-run: exit 130, one line on stderr (no
    traceback from the controller or its generator process), no shared memory left, and --resume
    continues to the end with every step's metrics once."""
    before = set(os.listdir("/dev/shm"))
    run_dir = str(tmp_path / "run")
    proc = _async_train(run_dir, tiny_chat_model, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: os.path.isfile(os.path.join(run_dir, "checkpoints", "latest")), proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == ("megatron-rl train: interrupted; the run directory keeps its last "
                                            "checkpoint: continue with --resume")
    assert _shm_leaks(before) == []
    resumed = _async_train(run_dir, tiny_chat_model, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0 and "resumed from" in out, out[-3000:]
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(1, 7))


def test_a_full_disk_during_a_checkpoint_write_is_named(monkeypatch, tmp_path):
    """torch.save and safetensors do not raise OSError on a full disk; the checkpoint writer names it
    (and the CLI prints that as one line). An unrelated failure with space left stays what it was."""
    manager = checkpoint_manager
    torch_full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    monkeypatch.setattr(manager.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=4096))
    named = manager._as_disk_full(torch_full, str(tmp_path))
    assert isinstance(named, OSError) and named.errno == errno.ENOSPC and named.filename == str(tmp_path)
    assert named.__cause__ is torch_full
    safetensors_full = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(manager.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=10 << 30))
    assert manager._as_disk_full(safetensors_full, str(tmp_path)).errno == errno.ENOSPC
    unrelated = RuntimeError("a bug")
    assert manager._as_disk_full(unrelated, str(tmp_path)) is unrelated


def test_generate_with_a_prompt_longer_than_the_context_is_one_line(tmp_path, tiny_chat_model, capsys):
    code, out, err = _run(capsys, "generate", "--model", tiny_chat_model, "--max-seq-len", "32",
                          "--max-new-tokens", "2", "word " * 100)
    _one_line_error(code, err, "field 'prompt_ids': has")
    assert "raise --max-seq-len" in err


def test_a_refused_train_leaves_the_run_directory_as_it_found_it(tmp_path, capsys):
    """A bad model config is refused after the run took its lock and wrote config.json: both go again, and
    a directory the run made goes with them; a directory of the user's keeps exactly its own files."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    fresh = tmp_path / "new_run"
    _one_line_error(*_run(capsys, "train", QUICKSTART, f"model.path={model}", f"run_dir={fresh}", "steps=1")[::2],
                    "field 'vocab_size': missing")
    assert not fresh.exists()
    mine = tmp_path / "my_dir"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    before = _snapshot(str(mine))
    _one_line_error(*_run(capsys, "train", QUICKSTART, f"model.path={model}", f"run_dir={mine}", "steps=1")[::2],
                    "field 'vocab_size': missing")
    assert _snapshot(str(mine)) == before
