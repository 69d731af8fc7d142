"""Reward-model training (trainer/reward_model.py, `objective: reward_model`): scores and the exported model
against transformers' own *ForSequenceClassification, the Bradley-Terry loss against the same loss computed
on transformers' scores, and learning a preference that a held-out set can check."""
from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from megatron_rl.algorithms.losses import bradley_terry_loss
from megatron_rl.models.families import to_hf_config
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.reward_model import SCORE, RewardModelTrainer
from tests.helpers import tiny_state


def _conversations(seed: int, count: int, vocab: int, marker: int | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        length = int(torch.randint(5, 14, (1,), generator=g))
        ids = torch.randint(1, vocab, (length,), generator=g)
        if marker is not None:
            ids = ids.masked_fill(ids == marker, marker + 1)
        rows.append(ids.tolist())
    return rows


def _hf_classifier(arch, state: dict[str, torch.Tensor]):
    """transformers' own sequence classifier of the family, loaded with `state` (the independent reference)."""
    config = transformers.AutoConfig.for_model(**{k: v for k, v in to_hf_config(arch).items()
                                                  if k not in ("architectures", "torch_dtype")},
                                               num_labels=1, pad_token_id=0)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.float().eval()


def _hf_scores(model, rows: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([ids])).logits[:, 0] for ids in rows]).float()


def test_bradley_terry_loss_is_the_mean_negative_log_sigmoid_of_the_margins():
    chosen = torch.tensor([2.0, -1.0, 0.5, 3.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.0, 0.5, -2.0])
    loss, metrics = bradley_terry_loss(chosen, rejected, normalizer=4)
    want = sum(math.log(1 + math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 4
    assert abs(float(loss) - float(want)) < 1e-6
    assert float(metrics["accuracy"]) == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    # shares of a split add up to the whole (the trainer's loss-hook contract)
    first, _ = bradley_terry_loss(chosen[:1], rejected[:1], normalizer=4)
    rest, _ = bradley_terry_loss(chosen[1:], rejected[1:], normalizer=4)
    assert abs(float(first + rest) - float(loss)) < 1e-6
    with pytest.raises(ValueError, match="differ in shape"):
        bradley_terry_loss(chosen, rejected[:2], normalizer=2)


def test_reward_model_scores_loss_and_export_equal_transformers(tiny_arch):
    """After two steps (the head and the backbone both moved) the exported state loads into transformers'
    sequence classifier, whose scores equal `predict`'s and whose Bradley-Terry loss equals the one the next
    step reports. fp32 on both sides with different kernels and summation orders: a few ulps of scores of
    size ~1, so 1e-5."""
    rm = RewardModelTrainer(tiny_arch, TrainerConfig(lr=1e-3, micro_batch_size=4, seed=0),
                            hf_state=tiny_state(tiny_arch, seed=3), head_lr=1e-2)
    chosen = _conversations(1, 6, tiny_arch.vocab_size)
    rejected = _conversations(2, 6, tiny_arch.vocab_size)
    assert torch.equal(rm.predict(chosen), torch.zeros(6))  # a zero head scores everything 0
    first = rm.update(chosen, rejected)
    assert first["reward_model/loss"] == pytest.approx(6 * 0.6931471805599453 / 6, abs=1e-6)  # log 2 at margin 0
    rm.update(chosen, rejected)
    state = rm.gather_reward_model_state()
    assert SCORE in state and state[SCORE].shape == (1, tiny_arch.hidden_size) and "lm_head.weight" not in state
    assert float(state[SCORE].abs().max()) > 0
    hf = _hf_classifier(tiny_arch, state)
    ours, theirs = rm.predict(chosen + rejected), _hf_scores(hf, chosen + rejected)
    assert float((ours - theirs).abs().max()) <= 1e-5, (ours, theirs)
    want = -torch.nn.functional.logsigmoid(theirs[:6] - theirs[6:]).mean()
    third = rm.update(chosen, rejected)
    assert abs(third["reward_model/loss"] - float(want)) <= 1e-5
    assert third["reward_model/accuracy"] == pytest.approx(float((theirs[:6] > theirs[6:]).float().mean()))


def test_a_reward_model_learns_a_preference_that_held_out_pairs_confirm(tiny_arch):
    """Chosen answers end with a marker token, rejected ones never hold it: a few steps rank held-out pairs
    (other random conversations) right."""
    marker = 7
    rm = RewardModelTrainer(tiny_arch, TrainerConfig(lr=1e-3, micro_batch_size=8, seed=0),
                            hf_state=tiny_state(tiny_arch, seed=4), head_lr=1e-2)

    def pairs(seed: int, count: int):
        base = _conversations(seed, count, tiny_arch.vocab_size, marker=marker)
        other = _conversations(seed + 100, count, tiny_arch.vocab_size, marker=marker)
        return [ids + [marker] for ids in base], [ids + [marker + 1] for ids in other]

    held_c, held_r = pairs(50, 32)
    before = rm.predict(held_c) > rm.predict(held_r)
    for step in range(12):
        chosen, rejected = pairs(step, 16)
        rm.update(chosen, rejected)
    after = (rm.predict(held_c) > rm.predict(held_r)).float().mean()
    assert float(before.float().mean()) == 0.0  # all ties at the zero head
    assert float(after) >= 0.9, float(after)


def test_an_odd_micro_batch_is_refused(tiny_arch):
    with pytest.raises(ValueError, match="micro_batch_size=3: a reward model's micro-batches hold whole pairs"):
        RewardModelTrainer(tiny_arch, TrainerConfig(micro_batch_size=3), hf_state=tiny_state(tiny_arch))


# --- the recipe: `megatron-rl train` with `objective: reward_model` -------------------------------------------

def _write_pairs(path, count: int, seed: int) -> None:
    """Arithmetic questions, the right sum chosen over a wrong one (the quickstart task's kind of pair)."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b, off = (int(x) for x in torch.randint(1, 50, (3,), generator=g))
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}",
                                "rejected": f"{a} + {b} = {a + b + off}"}) + "\n")


def test_the_train_command_trains_exports_and_the_reward_scores_with_the_export(tiny_chat_model, tmp_path, capsys):
    """The command writes metrics, summary and an export that transformers loads as a sequence classifier,
    whose scores, through `reward.name: reward_model`, equal what the trainer predicted for the same
    conversations; a second run into the same directory is refused."""
    from megatron_rl.cli import main
    from megatron_rl.data.tokenizer import ChatTokenizer
    from megatron_rl.rewards.reward_model import conversation_ids, reward_model_batch

    _write_pairs(tmp_path / "pairs.jsonl", 40, seed=0)
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(f"objective: reward_model\nrun_dir: {tmp_path / 'run'}\nmodel: {{path: {tiny_chat_model}}}\n"
                      "data: {train: pairs.jsonl, heldout_fraction: 0.2}\npairs_per_step: 8\nepochs: 2\n"
                      "head_lr: 1.0e-2\ntrainer: {lr: 1.0e-3, micro_batch_size: 4}\n")
    assert main(["train", str(recipe), "--check"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["train_pairs"] == 40
    assert main(["train", str(recipe)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward_model/loss" in r] == list(range(1, 9))  # 32 pairs / 8, 2 epochs
    assert summary["pairwise_accuracy_before"] == 0.5  # a zero head: every pair a tie
    export = summary["export"]
    config = json.loads((run / "reward_model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    model = transformers.AutoModelForSequenceClassification.from_pretrained(export, torch_dtype=torch.float32)
    assert float(model.score.weight.abs().max()) > 0

    class _Question:
        question = "What is 3 + 4?"
    answers = ["3 + 4 = 7", "3 + 4 = 9", "seven"]
    scored = [r.reward for r in reward_model_batch(answers, [_Question()] * 3, path=export, batch_size=2)]
    tokenizer = ChatTokenizer.from_hf_dir(export).hf_tokenizer
    ids = [conversation_ids(tokenizer, [{"role": "user", "content": _Question.question},
                                        {"role": "assistant", "content": a}]) for a in answers]
    with torch.no_grad():
        direct = [float(model(input_ids=torch.tensor([row])).logits[0, 0]) for row in ids]
    assert max(abs(a - b) for a, b in zip(scored, direct)) <= 1e-5
    assert main(["train", str(recipe)]) == 2  # the run directory holds the first run's files
    assert "already holds files" in capsys.readouterr().err


@pytest.mark.parametrize("row,message", [
    ({"prompt": "q", "chosen": "a"}, "field 'rejected' is missing"),
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "'chosen' and 'rejected' are the same conversation"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": "b"}, "field 'chosen' must end with the assistant"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "field 'prompt' must be a string or a non-empty list"),
])
def test_a_bad_pair_is_refused_with_its_line_and_field(tmp_path, capsys, row, message):
    from megatron_rl.cli import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" + json.dumps(row) + "\n")
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(f"objective: reward_model\nrun_dir: {tmp_path / 'run'}\ndata: {{train: pairs.jsonl}}\n")
    assert main(["train", str(recipe), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"pairs.jsonl:2: {message}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_settings_reward_model_training_cannot_honour_are_refused_by_name(tmp_path, capsys):
    from megatron_rl.cli import main

    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    recipe = tmp_path / "rm.yaml"
    recipe.write_text(f"objective: reward_model\nrun_dir: {tmp_path / 'run'}\ndata: {{train: pairs.jsonl}}\n")
    for extra, field in (("trainer.micro_batch_size=3", "trainer.micro_batch_size"),
                         ("trainer.lora.rank=4", "trainer.lora"),
                         ("model.chat_template=tool_use", "model.chat_template")):
        assert main(["train", str(recipe), extra, "--check"]) == 2
        assert field in capsys.readouterr().err
    assert main(["train", str(recipe), "--fresh"]) == 2
    assert "--fresh: reward-model training does not move a previous run aside" in capsys.readouterr().err
    assert main(["train", str(recipe), f"data.heldout={tmp_path / 'missing.jsonl'}", "--check"]) == 2
    assert "data.heldout: no file" in capsys.readouterr().err


def always_right(response: str, prompt) -> float:
    return 1.0


def test_eval_reward_decides_heldout_accuracy_instead_of_the_training_reward(tmp_path, tiny_chat_model):
    """A run trained on one reward (here: every answer right) reports held-out accuracy by `eval.reward`
    (the task's checker), as when training on a reward model's scores; other recipes refuse it."""
    from megatron_rl.config import ConfigError
    from megatron_rl.controller.loop import train
    from tests.test_loop import _config

    summary = train(_config(tiny_chat_model, str(tmp_path / "own"), "steps=0",
                            "reward.name=tests.test_reward_model_training:always_right"))
    assert summary.accuracy_before == 1.0
    checked = train(_config(tiny_chat_model, str(tmp_path / "checked"), "steps=0",
                            "reward.name=tests.test_reward_model_training:always_right",
                            "eval.reward.name=reasoning_gym"))
    assert checked.accuracy_before == 0.0  # a random 2-layer model never answers chain_sum right
    with pytest.raises(ConfigError, match="eval.reward"):
        _config(tiny_chat_model, str(tmp_path / "own_recipe"), "eval.reward.name=reasoning_gym",
                "recipe=tests.test_reward_model_training:always_right")


def test_a_crashed_reward_model_run_resumes_to_the_bits_of_an_uninterrupted_one(tiny_chat_model, tmp_path, capsys,
                                                                                monkeypatch):
    """Checkpoints every 2 steps; a run that dies in step 5 and is continued with --resume ends with the export,
    metrics and held-out accuracy of the run that never stopped."""
    from safetensors.torch import load_file

    from megatron_rl.cli import main

    _write_pairs(tmp_path / "pairs.jsonl", 40, seed=1)
    recipe = tmp_path / "rm.yaml"
    recipe.write_text("objective: reward_model\nmodel: {path: %s}\ndata: {train: pairs.jsonl, heldout_fraction: 0.2}\n"
                      "pairs_per_step: 8\nepochs: 2\nhead_lr: 1.0e-2\ntrainer: {lr: 1.0e-3, micro_batch_size: 4}\n"
                      "checkpoint: {every_steps: 2}\n" % tiny_chat_model)
    assert main(["train", str(recipe), f"run_dir={tmp_path / 'straight'}"]) == 0
    capsys.readouterr()
    assert main(["train", str(recipe), f"run_dir={tmp_path / 'none'}", "--resume"]) == 2
    assert "holds no complete reward-model checkpoint" in capsys.readouterr().err

    calls = [0]
    update = RewardModelTrainer.update

    def dies_in_step_5(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt  # the process ends mid-step, after the step-4 checkpoint
        return update(self, *args, **kwargs)

    monkeypatch.setattr(RewardModelTrainer, "update", dies_in_step_5)
    assert main(["train", str(recipe), f"run_dir={tmp_path / 'crashed'}"]) != 0
    assert "keeps its last checkpoint: continue with --resume" in capsys.readouterr().err
    monkeypatch.setattr(RewardModelTrainer, "update", update)
    assert main(["train", str(recipe), f"run_dir={tmp_path / 'crashed'}"]) == 2  # a fresh start is refused there
    assert "--resume continues the run there" in capsys.readouterr().err
    assert main(["train", str(recipe), f"run_dir={tmp_path / 'crashed'}", "--resume"]) == 0

    def export(run):
        return load_file(str(tmp_path / run / "reward_model" / "model.safetensors"))

    straight, resumed = export("straight"), export("crashed")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)

    def records(run):
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    def without_times(rows):
        return [{k: v for k, v in r.items() if not k.endswith("step_time")} for r in rows]
    assert without_times(records("crashed")) == without_times(records("straight"))


def _rm_worker(rank, world_size, model, pairs, run_dir, parallel):
    from megatron_rl.checkpoints_tools.convert import save_hf
    from megatron_rl.config import load_yaml
    from megatron_rl.recipes.reward_model.config import RewardModelRunConfig
    from megatron_rl.recipes.reward_model.recipe import train_reward_model

    config = load_yaml(RewardModelRunConfig, None, [
        "objective=reward_model", f"run_dir={run_dir}", f"model.path={model}", f"data.train={pairs}",
        "data.heldout_fraction=0.2", "pairs_per_step=8", "epochs=1", "head_lr=1.0e-2", "trainer.lr=1.0e-3",
        "trainer.micro_batch_size=4", "checkpoint.every_steps=2", *parallel])
    summary = train_reward_model(config, export=save_hf)
    return summary.accuracy_after


@pytest.mark.parametrize("parallel", [["trainer.parallel.tensor_parallel=2"], []], ids=["tp2", "dp2"])
def test_a_reward_model_trained_over_two_ranks_equals_one_trained_in_one_process(tiny_chat_model, tmp_path, parallel):
    """Tensor parallel (TP=2) and data parallel (DP=2: each rank half of every step's pairs) end the same Adam
    steps as one process, up to the rounding their different summation orders allow (tests/helpers.py)."""
    from safetensors.torch import load_file

    from megatron_rl.placement.launch import run_distributed
    from tests.helpers import assert_close_after_adam

    _write_pairs(tmp_path / "pairs.jsonl", 40, seed=2)
    runs = {}
    for name, world in (("one", 1), ("two", 2)):
        results = run_distributed(_rm_worker, world, tiny_chat_model, str(tmp_path / "pairs.jsonl"),
                                  str(tmp_path / name), parallel if world == 2 else [])
        assert len(set(results)) == 1  # every rank measured the same held-out accuracy
        runs[name] = load_file(str(tmp_path / name / "reward_model" / "model.safetensors"))
    steps = 4  # 32 training pairs, 8 a step
    head = {SCORE: runs["one"][SCORE]}
    assert_close_after_adam({SCORE: runs["two"][SCORE]}, head, [1e-2] * steps)
    backbone = {k: v for k, v in runs["one"].items() if k != SCORE}
    assert_close_after_adam(runs["two"], backbone, [1e-3] * steps)
    assert sorted((tmp_path / "two" / "checkpoints").iterdir())[-1].name.startswith("step_")

    def losses(run):  # the mean over the whole batch's pairs, however many ranks shared them (Adam cannot tell)
        return [r["reward_model/loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").read_text()
                                                         .splitlines()) if "reward_model/loss" in r]
    assert len(losses("two")) == steps
    assert losses("two") == pytest.approx(losses("one"), rel=1e-3)
