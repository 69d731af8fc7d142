"""PCL: selection at intermediate difficulty, the value loss, the value model, and the curriculum hook in
the RL loop (none / prefilter / dynamic_sampling / pcl) on a tiny model."""
from __future__ import annotations

import io
import itertools
import json
import logging
import os
import random

import pytest
import torch

from megatron_rl.algorithms.pcl import (
    explained_variance,
    has_mixed_rewards,
    select_closest_to_target,
    value_loss,
    value_targets,
)

# --- selection ----------------------------------------------------------------------------------------------

def _brute_force_selection(values, count, target):
    """Reference: among all subsets of size `count`, the one with the smallest sorted distance vector
    (lexicographically), ties between equal distance vectors broken by the earliest positions."""
    best = None
    for subset in itertools.combinations(range(len(values)), count):
        key = (sorted(abs(values[i] - target) for i in subset), list(subset))
        # A valid "m closest" set: no excluded candidate strictly closer than an included one.
        excluded = [i for i in range(len(values)) if i not in subset]
        if excluded and min(abs(values[i] - target) for i in excluded) < max(abs(values[i] - target) for i in subset):
            continue
        if best is None or key[1] < best[1]:
            best = key
    return best[1]


@pytest.mark.parametrize("seed", range(20))
def test_selection_is_exactly_the_m_closest_with_earliest_ties(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    # Values on a coarse grid so that ties (equal distance, on both sides of tau) are frequent.
    values = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, 0.125, 0.875]) for _ in range(n)]
    count = rng.randint(1, n)
    chosen = select_closest_to_target(values, count, 0.5)
    assert chosen == _brute_force_selection(values, count, 0.5)
    assert len(chosen) == count and chosen == sorted(set(chosen))


def test_selection_ties_are_broken_by_candidate_order_and_deterministic():
    values = [0.75, 0.25, 0.5, 0.25, 0.75, 1.0]
    # |v - 0.5| = .25 .25 0 .25 .25 .5: the exact 0.5 first, then the earliest of the equal ones.
    assert select_closest_to_target(values, 3, 0.5) == [0, 1, 2]
    assert select_closest_to_target(list(reversed(values)), 3, 0.5) == [1, 2, 3]
    assert all(select_closest_to_target(values, 3, 0.5) == [0, 1, 2] for _ in range(5))
    assert select_closest_to_target(values, 10, 0.5) == list(range(6))
    assert select_closest_to_target(torch.tensor([0.9, 0.1, 0.6]), 1, 0.2) == [1]


# --- value loss and targets -------------------------------------------------------------------------------

def test_value_targets_are_the_mean_reward_of_each_prompts_samples():
    torch.testing.assert_close(value_targets([[1, 0, 0, 1], [0, 0], [1]]), torch.tensor([0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="at least one"):
        value_targets([[1.0], []])


def test_value_loss_matches_the_papers_sum_of_squares_and_its_gradient():
    torch.manual_seed(0)
    predictions = torch.rand(7, dtype=torch.float64, requires_grad=True)
    targets = torch.rand(7, dtype=torch.float64)
    loss = value_loss(predictions, targets)
    reference = sum((float(p) - float(t)) ** 2 for p, t in zip(predictions, targets)) / 7
    assert abs(float(loss) - reference) < 1e-12
    loss.backward()
    torch.testing.assert_close(predictions.grad, 2 * (predictions.detach() - targets).float() / 7,
                               check_dtype=False)


def test_value_loss_shares_of_micro_batches_sum_to_the_global_loss():
    predictions, targets = torch.rand(10), torch.rand(10)
    shares = sum(value_loss(predictions[i:i + 3], targets[i:i + 3], normalizer=10) for i in range(0, 10, 3))
    torch.testing.assert_close(shares, value_loss(predictions, targets))
    with pytest.raises(ValueError, match="shape"):
        value_loss(torch.zeros(3), torch.zeros(4))


def test_explained_variance_and_mixed_rewards():
    observed = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert explained_variance(observed, observed) == 1.0
    assert abs(explained_variance(torch.full((4,), float(observed.mean())), observed)) < 1e-12
    assert explained_variance(1 - observed, observed) < 0
    assert explained_variance([0.3, 0.4], [1.0, 1.0]) != explained_variance([0.3, 0.4], [1.0, 1.0])  # NaN
    assert has_mixed_rewards([0, 1, 0]) and not has_mixed_rewards([1, 1]) and not has_mixed_rewards([0.5])


# --- the value model --------------------------------------------------------------------------------------

def test_value_model_reads_the_last_prompt_token_and_fits_targets(tiny_arch):
    from megatron_rl.trainer.config import TrainerConfig, ValueModelConfig
    from megatron_rl.trainer.value import ValueTrainer
    from tests.helpers import near_uniform_state

    # The paper's plain regression head (no standardisation, no prior): value/loss is then exactly the
    # error of the predictions `predict` made before the update.
    config = ValueModelConfig(trainer=TrainerConfig(lr=1e-3, micro_batch_size=4), head_lr=1e-2,
                              standardize_features=False, mean_reward_prior=False)
    value = ValueTrainer(tiny_arch, config, hf_state=near_uniform_state(tiny_arch))
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14], [3, 3, 3], [5]]
    torch.testing.assert_close(value.predict(prompts), torch.full((6,), 0.5))  # zero-initialised head
    # Padding after the prompt must not change V (the state after the last prompt token is read).
    with torch.no_grad():
        value.network.value_head.weight.normal_()
    # (predict orders prompts by length and trims each micro-batch: values come back in prompt order)
    alone = torch.cat([value.predict([p]) for p in prompts])
    together = value.predict(prompts)
    torch.testing.assert_close(alone, together, atol=1e-5, rtol=0)
    assert len(set(together.tolist())) == len(prompts)
    with torch.no_grad():  # a random head saturates the sigmoid; fit from a small one
        value.network.value_head.weight.mul_(1e-3)
    together = value.predict(prompts)
    # The reported loss is the mean squared error of the predictions made before the update.
    targets = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.1, 0.9])
    first = value.update(prompts, targets)["value/loss"]
    expected = float(((together - targets) ** 2).mean())
    assert abs(first - expected) < 1e-5
    for _ in range(40):
        last = value.update(prompts, targets)["value/loss"]
    assert last < 0.1 * first
    assert float((value.predict(prompts) - targets).abs().max()) < 0.1

    # Its weights (what a checkpoint holds) are the backbone plus the head; a copy predicts the same.
    copy = ValueTrainer(tiny_arch, config, hf_state=near_uniform_state(tiny_arch, seed=1))
    copy.load_shard(value.shard_state())
    torch.testing.assert_close(copy.predict(prompts), value.predict(prompts), atol=0, rtol=0)
    # ... and its optimizer state loads back (the head's param groups, which differ from the backbone's
    # only in their learning rate, must not be confused with them), so both take the same next step.
    saved = io.BytesIO()  # through bytes, as in a checkpoint (a live state dict shares Adam's step tensors)
    torch.save(value.optimizer.state_dict(), saved)
    saved.seek(0)
    copy.optimizer.load_state_dict(torch.load(saved, weights_only=True))
    copy.update(prompts, targets), value.update(prompts, targets)
    for mine, theirs in zip(copy.model.parameters(), value.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    with pytest.raises(ValueError, match="scalar head is missing"):
        copy.load_shard({k: v for k, v in value.shard_state().items() if not k.startswith("value_head.")})


def test_value_head_statistics_merge_exactly_and_standardise_its_input():
    from megatron_rl.trainer.value import STANDARDIZE_EPS, ValueHead

    torch.manual_seed(0)
    head = ValueHead(6, torch.float32, standardize=True)
    states = 3.0 + 0.01 * torch.randn(23, 6) * torch.arange(1, 7)  # a large shared part, small differences
    for chunk in torch.split(states, [5, 1, 9, 8]):
        head.observe_features(chunk)
    reference = states.double()
    torch.testing.assert_close(head.statistics["feature_mean"], reference.mean(0))
    torch.testing.assert_close(head.statistics["feature_var"], reference.var(0, unbiased=False))
    assert float(head.statistics["feature_count"]) == 23
    with torch.no_grad():
        head.weight.normal_()
        head.bias.fill_(0.3)
    head.statistics["prior"].fill_(-1.0)
    expected = ((states - states.mean(0)) / (states.var(0, unbiased=False) + STANDARDIZE_EPS).sqrt()) @ head.weight[0] + 0.3 - 1.0
    torch.testing.assert_close(head(states), expected, atol=1e-4, rtol=1e-4)
    # Standardised inputs differ by O(1) between states, the raw ones by O(0.01).
    assert float(head(states).std()) > 0.5
    raw = ValueHead(6, torch.float32, standardize=False)
    raw.load_state_dict(head.state_dict())
    raw.observe_features(states)  # a no-op without standardisation
    assert float(raw.statistics["feature_count"]) == 0
    torch.testing.assert_close(raw(states), states @ head.weight[0] + 0.3, atol=1e-5, rtol=1e-5)


def _shared_suffix_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3-7 distinct tokens followed by a long suffix they all share (as a chat template's
    closing tokens are): the state after the last token is mostly the suffix's."""
    generator = torch.Generator().manual_seed(seed)
    suffix = [7, 8, 9, 10, 11, 12, 13, 14]
    return [torch.randint(20, 200, (3 + i % 5,), generator=generator).tolist() + suffix for i in range(count)]


def _fit(value, prompts, targets, updates):
    for _ in range(updates):
        value.update(prompts, targets)
    return explained_variance(value.predict(prompts), targets), float((value.predict(prompts) - targets).abs().max())


def test_value_model_fits_fixed_prompt_targets_within_a_few_updates(tiny_arch):
    """V (standardised head, mean-reward prior, the recipe's backbone rate) fits 12 fixed prompt ->
    mean-reward targets within 15 updates, on prompts that share a long suffix as chat prompts do.
    (That the raw head learns far more slowly shows on the real model's states, whose shared part is
    ~20x the per-prompt part; a tiny random model's are not so lopsided, and there both fit.)"""
    from megatron_rl.trainer.config import TrainerConfig, ValueModelConfig
    from megatron_rl.trainer.value import ValueTrainer
    from tests.helpers import near_uniform_state

    prompts = _shared_suffix_prompts(12)
    targets = torch.tensor([0.0, 0.125, 0.25, 0.875, 0.5, 0.0, 1.0, 0.375, 0.125, 0.75, 0.0, 0.25])
    backbone = TrainerConfig(lr=1e-5, micro_batch_size=4)  # the recipe's rates: the head does the fitting
    fixed = ValueTrainer(tiny_arch, ValueModelConfig(trainer=backbone, head_lr=1e-2),
                         hf_state=near_uniform_state(tiny_arch))
    torch.testing.assert_close(fixed.predict(prompts), torch.full((12,), 0.5))  # untrained: tau everywhere
    first_loss = fixed.update(prompts, targets)["value/loss"]
    # The prior: after one update V's mean is already near the targets' mean (0.354), not at 0.5.
    assert abs(float(fixed.predict(prompts).mean()) - float(targets.mean())) < 0.05
    explained, worst = _fit(fixed, prompts, targets, 14)
    assert explained > 0.9 and worst < 0.2, (explained, worst)
    assert fixed.update(prompts, targets)["value/loss"] < 0.1 * first_loss

    # A copy from its checkpoint state (backbone, head and the head's statistics) predicts the same;
    # a state without the statistics is refused.
    copy = ValueTrainer(tiny_arch, ValueModelConfig(trainer=backbone, head_lr=1e-2),
                        hf_state=near_uniform_state(tiny_arch, seed=1))
    copy.load_shard(fixed.shard_state())
    torch.testing.assert_close(copy.predict(prompts), fixed.predict(prompts), atol=0, rtol=0)
    with pytest.raises(ValueError, match="statistics"):
        copy.load_shard({k: v for k, v in fixed.shard_state().items() if k != "value_head.feature_var"})


def test_mean_reward_prior_sets_v_to_the_targets_mean_before_any_learning(tiny_arch):
    from megatron_rl.trainer.config import TrainerConfig, ValueModelConfig
    from megatron_rl.trainer.value import PRIOR_CLIP, ValueTrainer
    from tests.helpers import near_uniform_state

    prompts = _shared_suffix_prompts(5)
    for head, targets, expected in (("sigmoid", [0.1, 0.3, 0.2, 0.4, 0.0], 0.2), ("linear", [2.0, -1.0, 0.5, 0.5, 3.0], 1.0),
                                    ("sigmoid", [0.0] * 5, PRIOR_CLIP)):
        config = ValueModelConfig(trainer=TrainerConfig(lr=0.0, micro_batch_size=4), head_lr=0.0, head=head)
        value = ValueTrainer(tiny_arch, config, hf_state=near_uniform_state(tiny_arch))
        value.update(prompts, torch.tensor(targets))  # no learning (zero rates): only the prior moves
        torch.testing.assert_close(value.predict(prompts), torch.full((5,), expected), atol=1e-6, rtol=0)


def test_truncated_value_model_keeps_the_first_layers(tiny_arch):
    from megatron_rl.trainer.value import truncate_layers
    from tests.helpers import near_uniform_state

    state = near_uniform_state(tiny_arch)
    arch, kept = truncate_layers(tiny_arch, state, 1)
    assert arch.num_layers == 1
    assert not any(k.startswith("model.layers.1.") for k in kept) and "model.norm.weight" in kept
    with pytest.raises(ValueError, match="exceeds"):
        truncate_layers(tiny_arch, state, tiny_arch.num_layers + 1)


# --- the curriculum in the loop ---------------------------------------------------------------------------

def _config(model_path, run_dir, *extra):
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    quickstart = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "quickstart.yaml")
    return load_yaml(RunConfig, quickstart, [
        f"model.path={model_path}", f"run_dir={run_dir}", "steps=2", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=4", "rollout.max_new_tokens=6", "trainer.micro_batch_size=4",
        "data.train.size=64", "data.heldout_size=2", "eval.max_new_tokens=4", "eval.before_training=false",
        "engine.max_batch_size=32", "checkpoint.every_steps=0", "checkpoint.save_at_end=false",
        "logging.wandb=disabled", "logging.plots=false", "reward.name=tests.test_loop:vowel_fraction", *extra])


def _steps(run_dir):
    return [r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if "rollout/reward_mean" in r]


def test_pcl_selects_candidates_trains_the_value_model_and_counts_samples(tmp_path, tiny_chat_model):
    from megatron_rl.controller.loop import train

    run_dir = str(tmp_path / "pcl")
    train(_config(tiny_chat_model, run_dir, "steps=3", "curriculum.kind=pcl",
                  "curriculum.value.trainer.micro_batch_size=4", "curriculum.value.replay_prompts=3"))
    steps = _steps(run_dir)
    assert len(steps) == 3
    # V trains on the step's m = 2 groups plus up to 3 replayed pairs of earlier steps.
    assert [r["curriculum/value_train_prompts"] for r in steps] == [2, 4, 5]
    for i, record in enumerate(steps):
        assert record["rollout/generated_samples_total"] == (i + 1) * 2 * 4  # only the m selected are generated
        for key in ("curriculum/value_explained_variance", "curriculum/predicted_reward_mean", "value/loss",
                    "curriculum/select_time", "rollout/effective_ratio"):
            assert key in record, key
    assert steps[0]["curriculum/predicted_reward_mean"] == pytest.approx(0.5)  # untrained head
    assert steps[1]["curriculum/candidate_value_std"] > 0  # V was updated after step 1


def test_pcl_in_the_asynchronous_loop_selects_with_a_value_model_one_more_step_behind(tmp_path, tiny_chat_model):
    from megatron_rl.controller.loop import train

    run_dir = str(tmp_path / "pcl_async")
    train(_config(tiny_chat_model, run_dir, "steps=3", "curriculum.kind=pcl", "rollout.max_staleness=1",
                  "curriculum.value.trainer.micro_batch_size=4", "eval.after_training=false"))
    steps = _steps(run_dir)
    # Steps 1 and 2 are admitted before any update of V (generation runs one step ahead); step 3's
    # prompts are chosen by V after step 1's update.
    assert [r["curriculum/candidate_value_std"] == 0 for r in steps] == [True, True, False]
    assert [r["rollout/generated_samples_total"] for r in steps] == [8, 16, 24]
    assert max(r["rollout/staleness_max"] for r in steps) == 1


def _value_checkpoint(run_dir, step):
    from safetensors.torch import load_file

    path = os.path.join(run_dir, "value", "checkpoints", f"step_{step:08d}")
    weights = load_file(os.path.join(path, "model", "mp_rank_00_000", "model.safetensors"))
    optimizer = torch.load(os.path.join(path, "optimizer", "rank_00000.pt"), weights_only=True)
    optimizer["moments"] = load_file(os.path.join(path, "optimizer_state", "mp_rank_00_000", "optimizer.safetensors"))
    return weights, optimizer


def _adam_moments(optimizer_record):
    return [t for _, t in sorted(optimizer_record["moments"].items())]


def test_resumed_pcl_run_restores_the_value_model_and_its_optimizer(tmp_path, tiny_chat_model):
    import shutil

    from megatron_rl.checkpoint.manager import CheckpointError
    from megatron_rl.controller.loop import train

    pcl = ("curriculum.kind=pcl", "curriculum.value.trainer.micro_batch_size=4", "curriculum.value.head_lr=1e-2",
           "curriculum.value.replay_prompts=3", "checkpoint.every_steps=1", "eval.after_training=false")
    straight = str(tmp_path / "straight")
    train(_config(tiny_chat_model, straight, "steps=3", *pcl))
    interrupted = str(tmp_path / "interrupted")
    train(_config(tiny_chat_model, interrupted, "steps=1", *pcl))
    saved_weights, saved_optimizer = _value_checkpoint(interrupted, 1)
    assert "value_head.weight" in saved_weights and bool(saved_weights["value_head.weight"].abs().sum() > 0)
    assert saved_optimizer["step_count"] == 1 and _adam_moments(saved_optimizer)
    assert float(saved_weights["value_head.feature_count"]) == 2  # the head's statistics are saved with it
    unusable = str(tmp_path / "unusable")
    shutil.copytree(interrupted, unusable)

    train(_config(tiny_chat_model, interrupted, "steps=3", *pcl), resume=True)
    # The resumed run continued from the saved V: its step-3 value model (weights, head, Adam moments)
    # is bit-identical to the uninterrupted run's, and so is every curriculum metric after the resume.
    for step in (2, 3):
        expected, actual = _value_checkpoint(straight, step), _value_checkpoint(interrupted, step)
        assert expected[0].keys() == actual[0].keys()
        for name in expected[0]:
            assert torch.equal(expected[0][name], actual[0][name]), (step, name)
        assert expected[1]["step_count"] == actual[1]["step_count"] == step
        for a, b in zip(_adam_moments(expected[1]), _adam_moments(actual[1]), strict=True):
            assert torch.equal(a, b)
    assert not torch.equal(_value_checkpoint(interrupted, 3)[0]["value_head.weight"], saved_weights["value_head.weight"])
    curriculum = lambda run: [{k: v for k, v in r.items() if k.startswith(("curriculum/", "value/")) and "time" not in k}
                              for r in _steps(run)]  # noqa: E731
    assert json.dumps(curriculum(interrupted)) == json.dumps(curriculum(straight))  # NaN-safe equality

    # Without the value model's checkpoint the run refuses to resume (a fresh V would change the curriculum).
    shutil.rmtree(os.path.join(unusable, "value", "checkpoints", "step_00000001"))
    with pytest.raises(CheckpointError, match="'value' executor"):
        train(_config(tiny_chat_model, unusable, "steps=3", *pcl), resume=True)


@pytest.mark.parametrize("kind", ["dynamic_sampling", "prefilter"])
def test_baseline_selectors_generate_what_they_promise(tmp_path, tiny_chat_model, kind):
    from megatron_rl.controller.loop import train

    run_dir = str(tmp_path / kind)
    train(_config(tiny_chat_model, run_dir, f"curriculum.kind={kind}", "curriculum.prefilter_pool=6",
                  "eval.after_training=false"))
    steps = _steps(run_dir)
    if kind == "dynamic_sampling":
        # k*m = 8 candidates rolled out per step; vowel fractions of random text are always mixed.
        assert [r["rollout/generated_samples_total"] for r in steps] == [32, 64]
        assert all(r["curriculum/candidates"] == 8 and r["curriculum/mixed_candidates"] == 8 for r in steps)
        assert all(r["rollout/trained_samples"] == 8 for r in steps)  # m groups kept
    else:
        # The pool is rolled out once before training, then m groups a step.
        assert [r["rollout/generated_samples_total"] for r in steps] == [6 * 4 + 8, 6 * 4 + 16]
        assert steps[0]["curriculum/prefilter_pool"] == 6


def test_resumed_prefilter_run_keeps_its_filtered_prompts_and_position(tmp_path, tiny_chat_model, caplog):
    from megatron_rl.controller.loop import train

    prefilter = ("curriculum.kind=prefilter", "curriculum.prefilter_pool=6", "checkpoint.every_steps=1",
                 "eval.after_training=false")
    straight, interrupted = str(tmp_path / "straight"), str(tmp_path / "interrupted")
    train(_config(tiny_chat_model, straight, "steps=3", *prefilter))
    train(_config(tiny_chat_model, interrupted, "steps=1", *prefilter))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_rl"):
        train(_config(tiny_chat_model, interrupted, "steps=3", *prefilter), resume=True)
    assert "prefilter: restored" in caplog.text  # no second filtering rollout
    prompts = lambda run: [json.loads(line)["prompts"] for line in open(os.path.join(run, "prompts.jsonl"))]  # noqa: E731
    # The resumed run continues the filtered stream where it was: the same prompts as without the stop.
    assert prompts(interrupted) == prompts(straight)
    assert [r["rollout/generated_samples_total"] for r in _steps(interrupted)] == [6 * 4 + 8 * s for s in (1, 2, 3)]


def test_mixture_source_interleaves_components_and_splits_the_heldout_set():
    from megatron_rl.data.config import DataConfig, SourceConfig
    from megatron_rl.data.prompts import normalize_question
    from megatron_rl.data.sources import build_datasets

    easy = SourceConfig(task="chain_sum", size=40, seed=1,
                        task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    hard = SourceConfig(task="chain_sum", size=40, seed=2,
                        task_config={"min_terms": 4, "max_terms": 4, "min_digits": 3, "max_digits": 3})
    train, heldout = build_datasets(DataConfig(train=SourceConfig(kind="mixture", components=[easy, hard]),
                                               heldout_size=10))
    terms = lambda p: p.metadata["reasoning_gym"]["config"]["min_terms"]  # noqa: E731
    assert [terms(p) for p in heldout] == [2, 4] * 5  # an equal share of each component, interleaved
    assert [terms(p) for p in train][:6] == [2, 4, 2, 4, 2, 4]
    assert not {normalize_question(p.question) for p in train} & heldout.questions()
    assert len({p.prompt_id for p in train}) == len(train)
    with pytest.raises(ValueError, match="components"):
        SourceConfig(kind="mixture")
