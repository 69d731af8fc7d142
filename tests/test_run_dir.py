"""The run directory's start decision (observability/run_log.py: prepare_run_dir), decided from what is on disk:
another experiment is refused naming the first differing field with every byte unchanged, the same one
resumes (or starts over where it died before its first checkpoint, with or without --resume), a finished
run keeps its summary, and the run never overwrites or moves what it did not write."""
from __future__ import annotations

import json
import os

import pytest

from megatron_rl.cli import main
from megatron_rl.config import ConfigError, to_dict
from megatron_rl.controller.loop import train
from megatron_rl.observability.run_log import PREVIOUS_RUNS, RUN_MANIFEST, config_difference, prepare_run_dir
from megatron_rl.run_config import load_run_config
from tests.test_bad_input_more import _one_line_error, _snapshot
from tests.test_loop import QUICKSTART, _config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def finished_run(tiny_chat_model, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("finished") / "run")
    summary = train(_config(tiny_chat_model, run_dir, "steps=2"))
    assert summary.steps == 2 and summary.final_metrics
    return run_dir


def test_another_experiment_is_refused_naming_the_field_and_nothing_changes(finished_run, tiny_chat_model):
    before = _snapshot(finished_run)
    with pytest.raises(ConfigError, match=r"holds another run: its config differs at trainer\.lr \(0\.001 there, "
                                          r"0\.002 now\); add --resume .* or --fresh"):
        train(_config(tiny_chat_model, finished_run, "steps=2", "trainer.lr=2e-3"))
    assert _snapshot(finished_run) == before


def test_a_finished_run_relaunched_keeps_its_summary_whole(finished_run, tiny_chat_model):
    before = _snapshot(finished_run)
    with open(os.path.join(finished_run, "summary.json"), encoding="utf-8") as f:
        written = json.load(f)
    summary = train(_config(tiny_chat_model, finished_run, "steps=2", "logging.console_every=0"))  # a resumable change
    assert summary.final_metrics == written["final_metrics"] and summary.steps == 2
    assert _snapshot(finished_run) == before


def test_the_fields_a_resume_may_change_are_not_a_difference(tiny_chat_model, tmp_path):
    base = to_dict(_config(tiny_chat_model, tmp_path / "a", "steps=2"))
    same = to_dict(_config(tiny_chat_model, tmp_path / "b", "steps=5", "checkpoint.keep_last=4",
                           "logging.plots=true", "trainer.parallel.tensor_parallel=1"))
    assert config_difference(base, same) is None
    other = to_dict(_config(tiny_chat_model, tmp_path / "a", "steps=2", "rollout.max_new_tokens=9"))
    assert config_difference(base, other) == "rollout.max_new_tokens (8 there, 9 now)"


def _died_before_its_first_checkpoint(run_dir, config):
    """What a kill during the first checkpoint write leaves: the config, a step's records, a half checkpoint."""
    os.makedirs(os.path.join(run_dir, "checkpoints", "step_00000001.tmp"))
    with open(os.path.join(run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    for name in ("metrics.jsonl", "prompts.jsonl"):
        with open(os.path.join(run_dir, name), "w", encoding="utf-8") as f:
            f.write(json.dumps({"step": 1, "prompts": ["p1"]}) + "\n")


@pytest.mark.parametrize("flag", ["relaunch", "--resume"])
def test_a_kill_before_the_first_checkpoint_starts_over_with_or_without_resume(tiny_chat_model, tmp_path, flag):
    run_dir = str(tmp_path / "run")
    config = to_dict(_config(tiny_chat_model, run_dir))
    _died_before_its_first_checkpoint(run_dir, config)
    prepare_run_dir(run_dir, resume=flag == "--resume", fresh=False, checkpoint=None, config=config)
    (moved,) = os.listdir(os.path.join(run_dir, PREVIOUS_RUNS))
    assert {"config.json", "metrics.jsonl", "prompts.jsonl", "checkpoints"} <= set(
        os.listdir(os.path.join(run_dir, PREVIOUS_RUNS, moved)))
    assert sorted(os.listdir(run_dir)) == sorted([PREVIOUS_RUNS, RUN_MANIFEST])
    # another experiment's attempt is still refused: its records are not this run's to move
    other = str(tmp_path / "other")
    _died_before_its_first_checkpoint(other, {**config, "seed": 7})
    with pytest.raises(ConfigError, match="differs at seed"):
        prepare_run_dir(other, resume=False, fresh=False, checkpoint=None, config=config)


def test_a_config_json_no_run_wrote_is_refused_and_kept(tmp_path, capsys):
    """An HF model directory given as run_dir: its config.json would be replaced."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    (model_dir / "model.safetensors").write_bytes(b"weights")
    before = _snapshot(model_dir)
    for flag in ((), ("--fresh",), ("--resume",)):
        code = main(["train", QUICKSTART, f"run_dir={model_dir}", "logging.wandb=disabled", *flag])
        _one_line_error(code, capsys.readouterr()[1], "holds a config.json that no run wrote")
        assert _snapshot(model_dir) == before and sorted(os.listdir(model_dir)) == ["config.json", "model.safetensors"]


def test_fresh_moves_only_the_runs_own_files(tiny_chat_model, tmp_path):
    """The user's files (there before the first run) and the run's own data file stay where they are."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "NOTES.md").write_text("my notes")
    config = to_dict(_config(tiny_chat_model, run_dir))
    prepare_run_dir(str(run_dir), resume=False, fresh=False, checkpoint=None, config=config)  # the first run
    (run_dir / "data").mkdir()  # the run's data, put in its directory after it started
    (run_dir / "data" / "train.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n')
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "predictions.jsonl").write_text("the run's own output\n")
    keep = (str(run_dir / "data" / "train.jsonl"),)
    prepare_run_dir(str(run_dir), resume=False, fresh=True, checkpoint=None, config=config, keep=keep)
    assert sorted(os.listdir(run_dir)) == sorted(["NOTES.md", "data", PREVIOUS_RUNS, RUN_MANIFEST])
    (moved,) = os.listdir(run_dir / PREVIOUS_RUNS)
    assert sorted(os.listdir(run_dir / PREVIOUS_RUNS / moved)) == ["config.json", "metrics.jsonl", "predictions.jsonl"]
    assert (run_dir / "NOTES.md").read_text() == "my notes"


def test_home_is_expanded_in_run_dir_and_data_paths(monkeypatch, tmp_path):
    """`~` means the home directory in run_dir and data paths, as in model.path (never a folder named `~`)."""
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_yaml(RunConfig, QUICKSTART, ["run_dir=~/runs/x", "data.train.kind=jsonl",
                                               "data.train.path=~/data/train.jsonl"])
    assert config.run_dir == str(tmp_path / "runs" / "x")
    assert config.data.train.path == str(tmp_path / "data" / "train.jsonl")


def _dead_pid() -> int:
    import subprocess

    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_a_killed_converts_temporary_directories_go_at_the_next_start(tmp_path):
    from megatron_rl.checkpoints_tools.convert import _atomic_dir

    dead = tmp_path / f".tmp-out-{_dead_pid()}-abcd_123"
    (dead / "model").mkdir(parents=True)
    (dead / "model" / "model.safetensors").write_bytes(b"\0" * 4096)
    old = tmp_path / f".old-out-{_dead_pid()}-zz99zz99"
    old.mkdir()
    alive = tmp_path / f".tmp-out-{os.getppid()}-abcd_123"  # a convert still running
    alive.mkdir()
    users = [tmp_path / ".tmp-out-notes", tmp_path / f".tmp-other-{_dead_pid()}-abcd_123"]
    for path in users:
        path.mkdir()
    made = _atomic_dir(str(tmp_path / "out"))
    assert not dead.exists() and not old.exists()
    assert alive.exists() and all(path.exists() for path in users)
    assert os.path.basename(made).startswith(f".tmp-out-{os.getpid()}-")


def test_a_killed_runs_sandbox_directories_go_when_the_next_sandbox_starts(tmp_path):
    from megatron_rl.recipes.agent.sandbox import Sandbox

    dead = tmp_path / f"mrl-sandbox-{_dead_pid()}-abcd_123"
    (dead / "scratch").mkdir(parents=True)
    (dead / "scratch" / "output.txt").write_text("left by a SIGKILLed run")
    alive = tmp_path / f"mrl-sandbox-{os.getppid()}-abcd_123"
    alive.mkdir()
    with Sandbox(parent_dir=str(tmp_path)) as box:
        assert os.path.basename(os.path.dirname(box.scratch)).startswith(f"mrl-sandbox-{os.getpid()}-")
        assert not dead.exists() and alive.exists()


def test_links_loops_and_fifos_are_named_for_what_they_are(tmp_path, capsys):
    """A symlink loop as run_dir, a dangling link or a FIFO as the data file: the message says what is there
    (it said "File exists" and "not found")."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dangling = tmp_path / "gone.jsonl"
    dangling.symlink_to(tmp_path / "nowhere.jsonl")
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    cases = [([f"run_dir={loop}"], f"run_dir {loop} is a symbolic link loop, not a directory"),
             ([f"run_dir={tmp_path / 'run'}", "data.train.kind=jsonl", f"data.train.path={dangling}"],
              f"data file {dangling} is a symbolic link to '{tmp_path / 'nowhere.jsonl'}', which does not exist"),
             ([f"run_dir={tmp_path / 'run'}", "data.train.kind=jsonl", f"data.train.path={fifo}"],
              f"data file {fifo} is a named pipe (FIFO), not a regular file")]
    for overrides, message in cases:
        code = main(["train", QUICKSTART, "logging.wandb=disabled", *overrides, "--check"])
        _one_line_error(code, capsys.readouterr()[1], message)


def test_tools_of_a_sigkilled_run_do_not_outlive_it(tmp_path):
    """The controlling process SIGKILLed mid-call: the tool's processes, a detached one included, end with
    it (parent-death signals down the sandbox's process chain, its PID namespace) well before the call's
    wall time, and the next sandbox removes the directory."""
    import subprocess
    import sys
    import time
    import uuid

    from megatron_rl.recipes.agent.sandbox import Sandbox
    from tests.test_agent_sandbox import _processes_with

    if "pidns" not in Sandbox.containment():  # without one, a detached tool process ends at the next start
        pytest.skip("this kernel grants the sandbox no PID namespace")
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997 + 1}"
    script = (f"from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits\n"
              f"box = Sandbox(SandboxLimits(wall_time_s=600.0), parent_dir={str(tmp_path)!r})\n"
              f"box.run_python(\"import subprocess\\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\\n"
              f"subprocess.run(['sleep', '{marker}'])\")\n")
    controller = subprocess.Popen([sys.executable, "-c", script])

    def tools():  # the controller's own command line holds the marker too
        return [pid for pid in _processes_with(marker) if pid != controller.pid]

    deadline = time.monotonic() + 60
    while len(tools()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(tools()) == 2, "the tool did not start"
    controller.kill()
    controller.wait()
    deadline = time.monotonic() + 10
    while tools() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tools() == []
    assert any(name.startswith("mrl-sandbox-") for name in os.listdir(tmp_path))
    with Sandbox(parent_dir=str(tmp_path)):
        assert [n for n in os.listdir(tmp_path) if n.startswith("mrl-sandbox-")] != []  # only this one's
    assert not any(name.startswith("mrl-sandbox-") for name in os.listdir(tmp_path))


def test_a_recipes_relative_paths_name_files_beside_it_from_any_directory(tmp_path, monkeypatch):
    """`megatron-rl plan` of a shipped recipe from another directory finds its model shape (examples/configs/
    models/, named relative to the recipe); a data file beside a user's recipe is found from anywhere; a
    relative path that exists from the working directory, or given on the command line, stays as it was."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", os.path.join(REPO, "examples", "configs", "llama3_8b.yaml")]) == 0
    recipe_dir = tmp_path / "recipes"
    recipe_dir.mkdir()
    (recipe_dir / "prompts.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (recipe_dir / "run.yaml").write_text("data:\n  train: {kind: jsonl, path: prompts.jsonl}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_run_config(str(recipe_dir / "run.yaml"))
    assert config.data.train.path == str(recipe_dir / "prompts.jsonl")
    assert load_run_config(str(recipe_dir / "run.yaml"), ["data.train.path=prompts.jsonl"]).data.train.path == \
        "prompts.jsonl"  # the command line is relative to the working directory
    (elsewhere / "prompts.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n')
    assert load_run_config(str(recipe_dir / "run.yaml")).data.train.path == "prompts.jsonl"
