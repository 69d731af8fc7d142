"""What a run reports about itself: a timeline whose tracks hold only nested spans and which is on
disk while the run lives; one W&B run across resumes."""
import glob
import json
import os

from megatron_rl.observability.metrics import LoggingConfig, MetricsLogger
from megatron_rl.observability.timeline import Timeline


def overlapping_unnested(trace: dict) -> list[tuple[str, str]]:
    """Pairs of spans on one track that overlap without one containing the other (trace viewers
    draw those wrongly)."""
    by_track: dict[tuple, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    bad = []
    for spans in by_track.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        for i, a in enumerate(spans):
            for b in spans[i + 1:]:
                if b["ts"] >= a["ts"] + a["dur"]:
                    break
                if b["ts"] + b["dur"] > a["ts"] + a["dur"]:
                    bad.append((a["name"], b["name"]))
    return bad


def test_overlapping_generations_get_their_own_tracks_and_nested_phases_share_one(tmp_path):
    path = str(tmp_path / "timeline.json")
    timeline = Timeline(path)
    t0 = timeline._origin
    # three prompt groups in flight at once, added when each finishes (out of start order)
    timeline.add("generate b", t0 + 2, t0 + 5, lane="generate")
    timeline.add("generate a", t0 + 1, t0 + 3, lane="generate")
    timeline.add("generate c", t0 + 4, t0 + 6, lane="generate")
    timeline.add("generate d", t0 + 5, t0 + 7, lane="generate")
    timeline.add("train", t0 + 1, t0 + 4)
    timeline.add("weight_sync", t0 + 2, t0 + 3)
    timeline.write()
    trace = json.load(open(path))
    assert overlapping_unnested(trace) == []
    spans = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans["generate a"]["tid"] != spans["generate b"]["tid"]
    assert spans["generate c"]["tid"] == spans["generate a"]["tid"]  # a ended before c began: lane reused
    assert spans["train"]["tid"] == spans["weight_sync"]["tid"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[spans["generate a"]["tid"]] == "generate 1"  # b, added first, took lane 0

    # the old single-track layout is what the checker exists to catch
    for e in trace["traceEvents"]:
        e["tid"] = 0
    assert overlapping_unnested(trace)


def test_the_trace_is_written_while_the_run_goes_on(tmp_path):
    path = str(tmp_path / "timeline.json")
    timeline = Timeline(path, flush_every_s=0.0)
    with timeline.span("train"):
        pass
    # no explicit write(): a run killed now still leaves a valid trace with the span in it
    assert os.path.isfile(path)
    assert [e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"] == ["train"]


def test_a_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = str(tmp_path)
    ids = []
    for start in range(4):  # a fresh start, then three resumes
        logger = MetricsLogger(run_dir, LoggingConfig(wandb="offline"), {"seed": 1}, resume=start > 0)
        logger.log(start, {"rollout/reward_mean": 0.5})
        ids.append(logger._wandb.id)
        logger.close()
    assert len(set(ids)) == 1
    assert len(glob.glob(os.path.join(run_dir, "wandb", f"offline-run-*-{ids[0]}*"))) == 4
    # a fresh run in another directory is another W&B run
    other = MetricsLogger(str(tmp_path / "other"), LoggingConfig(wandb="offline"), {}, resume=False)
    assert other._wandb.id != ids[0]
    other.close()
