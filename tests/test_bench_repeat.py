"""`megatron-rl bench NAME --repeat N`: every run printed, the last line the median with its spread."""
from __future__ import annotations

import json
import sys
import types

import pytest

from megatron_rl.cli import bench, main


@pytest.fixture
def fake_bench(monkeypatch):
    """A benchmark whose successive runs return the ratios 3, 1, 2 (and a run counter)."""
    calls = []

    def run(options: dict) -> dict:
        calls.append(dict(options))
        print(f"measuring run {len(calls)}")
        return {"ratio": [3.0, 1.0, 2.0, 5.0][len(calls) - 1], "index": len(calls), "steps": options["steps"]}

    module = types.ModuleType("fake_bench_module")
    module.run = run
    monkeypatch.setitem(sys.modules, "fake_bench_module", module)
    monkeypatch.setitem(bench.BENCHMARKS, "fake", "fake_bench_module:run")
    return calls


def test_repeat_reports_median_spread_and_every_run(fake_bench, capsys):
    assert main(["bench", "fake", "steps=4", "--repeat", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["bench"] == "fake" and last["ratio"] == 2.0
    assert (last["ratio_min"], last["ratio_max"]) == (1.0, 3.0)
    assert [run["ratio"] for run in last["runs"]] == [3.0, 1.0, 2.0]
    assert last["index"] == 3  # the other fields come from the median run
    assert len(fake_bench) == 3 and all(options == {"steps": 4} for options in fake_bench)
    assert sum(line.startswith("run ") for line in lines) == 3  # each run printed as it ends


def test_even_repeat_takes_the_mean_of_the_middle_two():
    summary = bench.summarize_runs([{"ratio": r} for r in (3.0, 1.0, 2.0, 5.0)])
    assert summary["ratio"] == 2.5 and summary["ratio_min"] == 1.0 and summary["ratio_max"] == 5.0


def test_single_run_keeps_the_plain_last_line(fake_bench, capsys):
    assert main(["bench", "fake", "steps=1"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == {"bench": "fake", "ratio": 3.0, "index": 1, "steps": 1}


def test_repeat_below_one_is_refused(fake_bench, capsys):
    assert main(["bench", "fake", "--repeat", "0"]) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err
    assert fake_bench == []
