"""The terminal of a `megatron-rl` command: a one-line error is one line (no import warnings before it),
progress logs on stdout and problems on stderr, stamped; other ranks only warn; the bench's last line
stays its JSON."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest

from megatron_rl.cli import bench, main
from megatron_rl.observability.logs import PACKAGES, configure_logging

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "examples", "configs", "quickstart.yaml")
STAMP = r"\d\d:\d\d:\d\d "


@pytest.fixture
def restore_logging():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers)) for name in PACKAGES}
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


def test_a_bad_override_is_exactly_one_line_in_a_fresh_process():
    """A fresh interpreter, as a user runs it: megatron-core's import-time warnings (no Transformer
    Engine / Apex) would come before the error."""
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_RL_DEBUG", "PYTHONWARNINGS")}
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", QUICKSTART, "trainer.lr=inf"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                          timeout=300)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 2, proc.stdout
    assert len(lines) == 1, proc.stdout
    assert lines[0].startswith("megatron-rl train: error: ") and "must be a finite number" in lines[0]


def test_progress_on_stdout_and_problems_on_stderr_time_stamped(restore_logging, capsys):
    configure_logging(rank=0)
    configure_logging(rank=0)  # idempotent: still one line per record
    log = logging.getLogger("megatron_rl.some.module")
    log.info("loading the model")
    log.debug("not shown")
    log.warning("checkpoint X is unusable")
    out, err = capsys.readouterr()
    assert re.fullmatch(STAMP + r"loading the model\n", out), out
    assert re.fullmatch(STAMP + r"checkpoint X is unusable\n", err), err


def test_other_ranks_log_warnings_only_and_name_their_rank(restore_logging, capsys):
    configure_logging(rank=3)
    log = logging.getLogger("megatron_rl.controller.loop")
    log.info("ready in 1.0s")
    log.warning("step 2: checkpoint write failed")
    out, err = capsys.readouterr()
    assert out == ""
    assert re.fullmatch(STAMP + r"\[rank 3\] step 2: checkpoint write failed\n", err), err


def test_the_rank_comes_from_the_launch_environment(restore_logging, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    configure_logging()
    logging.getLogger("megatron_rl").info("hidden")
    assert capsys.readouterr().out == ""


def test_bench_lines_are_logged_and_the_last_line_is_the_json(restore_logging, monkeypatch, capsys):
    def run(options: dict) -> dict:
        logging.getLogger("megatron_rl.fake_bench").info("measuring")
        return {"ratio": 2.0}

    module = types.ModuleType("fake_logging_bench")
    module.run = run
    monkeypatch.setitem(sys.modules, "fake_logging_bench", module)
    monkeypatch.setitem(bench.BENCHMARKS, "fake", "fake_logging_bench:run")
    assert main(["bench", "fake"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(STAMP + "measuring", lines[0]), lines
    assert json.loads(lines[-1]) == {"bench": "fake", "ratio": 2.0}


def test_reporter_of_a_non_driver_rank_writes_nothing(tmp_path):
    from megatron_rl.controller.reporter import DriverReporter, RunReporter

    config = types.SimpleNamespace(run_dir=str(tmp_path), steps=3)
    report = RunReporter(config, checkpoints=None)
    assert not isinstance(report, DriverReporter)
    report.say("hello")
    report.write_config()
    report.open(0, resume=False, step_metrics=None)
    assert list(report.steps(1)) == [1, 2]
    report.log(1, {"train/pg_loss": 0.0})
    report.close()
    report.finish(None)
    assert os.listdir(tmp_path) == []
