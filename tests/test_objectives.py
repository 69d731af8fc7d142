"""The 2026 objectives against independent references, float64, random inputs with masks and uneven lengths:
GSPO, CISPO, GMPO, SAPO, Clip-Cov, KL-Cov, the pass@k and OPO estimators and the rollout correction (weights
and rejection masks) against verl 0.9.1's own code (tests/verl_reference.py, in a child process), values and
gradients to 1e-6; GSPO's sequence form and DAPO's overlong shaping against brute-force autograd and the
paper's formula; every new config field's bounds refused with the field named."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_rl.algorithms.advantages import compute_advantages, gae_advantages, overlong_penalty, token_rewards
from megatron_rl.algorithms.config import AdvantageConfig, LossConfig, OverlongConfig, RolloutCorrectionConfig
from megatron_rl.algorithms.losses import clipped_value_loss, compute_normalizer, make_loss_fn, policy_loss
from megatron_rl.algorithms.rollout_correction import correction_weights, rejection_mask
from megatron_rl.config import ConfigError
from megatron_rl.controller.loop import train
from megatron_rl.types import Completion, TrainBatch
from tests.test_loop import _config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, S = 6, 11
TOL = dict(rtol=1e-6, atol=1e-9)
AGG = {"token_mean": "token-mean", "seq_mean": "seq-mean-token-mean"}


def random_batch(seed, *, empty_row=True, sequence_advantages=False, spread=0.3):
    """[B, S] log pi, log mu, advantages and a mask of prompt (0), response (1) and padding (0) columns with
    uneven lengths; one row without loss tokens unless `empty_row` is False."""
    g = torch.Generator().manual_seed(seed)
    lp = -4 * torch.rand(B, S, generator=g, dtype=torch.float64) - 0.05
    mu = lp + spread * torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, S, dtype=torch.float64)
    for b in range(B):
        start = int(torch.randint(1, 4, (1,), generator=g))
        length = int(torch.randint(2, S - start + 1, (1,), generator=g))
        mask[b, start:start + length] = 1
    if empty_row:
        mask[3] = 0
    if sequence_advantages:
        adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone() * 1.5
    else:
        adv = torch.randn(B, S, generator=g, dtype=torch.float64) * 1.5
    return lp, mu, adv * mask, mask


def verl(cases):
    """verl's results for `cases` (see tests/verl_reference.py), from one child process."""
    import importlib.util
    import tempfile

    if importlib.util.find_spec("verl") is None:
        pytest.fail("verl 0.9.1 is not installed: scripts/setup_cpu.sh installs it (pip install --no-deps verl==0.9.1)")
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, results_path = os.path.join(tmp, "cases.pt"), os.path.join(tmp, "results.pt")
        torch.save(cases, cases_path)
        result = subprocess.run([sys.executable, os.path.join(REPO, "tests", "verl_reference.py"), cases_path,
                                 results_path], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return torch.load(results_path, weights_only=False)


# --- losses ---------------------------------------------------------------------------------------------

LOSS_CASES = [
    # (our loss, LossConfig fields, verl name, batch options, with rollout weights)
    ("gspo", dict(clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="seq_mean"), "gspo",
     dict(sequence_advantages=True, spread=0.05), False),
    ("gspo", dict(clip_eps_low=0.2, clip_eps_high=0.28), "gspo", {}, False),
    ("cispo", dict(clip_eps_low=0.9, clip_eps_high=0.28), "cispo", {}, False),
    ("cispo", dict(clip_eps_low=0.2, clip_eps_high=0.2, aggregation="seq_mean"), "cispo", {}, True),
    ("gmpo", dict(clip_eps_low=0.4, clip_eps_high=0.4, aggregation="seq_mean"), "geo_mean",
     dict(empty_row=False, sequence_advantages=True, spread=0.5), False),
    ("gmpo", dict(clip_eps_low=0.1, clip_eps_high=0.2, aggregation="seq_mean"), "geo_mean",
     dict(empty_row=False, sequence_advantages=True, spread=0.5), True),
    ("sapo", dict(aggregation="seq_mean"), "sapo", dict(spread=1.0), False),
    ("sapo", dict(aggregation="seq_mean", sapo_tau_pos=1.5, sapo_tau_neg=3.0), "sapo", dict(spread=1.0), True),
    ("clip_cov", dict(cov_ratio=0.2, clip_cov_lb=0.0, clip_cov_ub=5.0), "clip_cov", dict(spread=0.5), False),
    ("clip_cov", dict(cov_ratio=0.05, clip_cov_lb=-1.0, clip_cov_ub=2.0, clip_eps_high=0.28), "clip_cov",
     dict(spread=0.5), False),
    ("kl_cov", dict(cov_ratio=0.2, kl_cov_coef=1.0), "kl_cov", dict(spread=0.5), False),
    ("kl_cov", dict(cov_ratio=0.01, kl_cov_coef=0.5), "kl_cov", dict(spread=0.5), True),
]


def _verl_loss_case(verl_name, cfg: LossConfig, lp, mu, adv, mask, weights, m):
    case = dict(kind="loss", name=verl_name, old_log_prob=mu, log_prob=lp, advantages=adv, response_mask=mask,
                loss_agg_mode=AGG[cfg.aggregation],
                actor=dict(clip_ratio=cfg.clip_eps_high, clip_ratio_low=cfg.clip_eps_low,
                           clip_ratio_high=cfg.clip_eps_high, tau_pos=cfg.sapo_tau_pos, tau_neg=cfg.sapo_tau_neg),
                policy_loss=dict(clip_cov_ratio=cfg.cov_ratio, clip_cov_lb=cfg.clip_cov_lb,
                                 clip_cov_ub=cfg.clip_cov_ub, kl_cov_ratio=cfg.cov_ratio,
                                 ppo_kl_coef=cfg.kl_cov_coef),
                # clip_cov draws from the global RNG; ours from a generator seeded by the token count
                seed=0x5EED + int(m.sum()))
    if weights is not None:
        case["rollout_is_weights"] = weights
    return case


def test_losses_equal_verl():
    ours, cases = [], []
    for i, (name, fields, verl_name, batch_options, with_weights) in enumerate(LOSS_CASES):
        cfg = LossConfig(name=name, **fields)
        lp, mu, adv, mask = random_batch(100 + i, **batch_options)
        weights = None
        if with_weights:
            weights = (torch.rand(B, S, generator=torch.Generator().manual_seed(i), dtype=torch.float64) + 0.5) * mask
        lp1 = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(lp1, mu, adv, mask, cfg, compute_normalizer(mask, cfg), rollout_weights=weights)
        (grad,) = torch.autograd.grad(loss, [lp1])
        assert all(torch.isfinite(v) for v in metrics.values()), name
        ours.append((name, fields, loss.detach(), grad, mask))
        cases.append(_verl_loss_case(verl_name, cfg, lp, mu, adv, mask, weights, mask))
    for (name, fields, loss, grad, mask), reference in zip(ours, verl(cases)):
        torch.testing.assert_close(loss, reference["loss"], **TOL, msg=lambda m: f"{name} {fields}: {m}")
        torch.testing.assert_close(grad, reference["grad"], **TOL, msg=lambda m: f"{name} {fields} grad: {m}")
        assert grad[mask == 0].abs().max() == 0
        assert reference["grad"].abs().max() > 0  # a case with a gradient to compare


def test_clip_cov_and_kl_cov_select_tokens():
    """The covariance cases above exercise the selection: some tokens detached / penalised."""
    lp, mu, adv, mask = random_batch(108, spread=0.5)
    for name, key in (("clip_cov", "cov_detached_frac"), ("kl_cov", "cov_penalised_frac")):
        cfg = LossConfig(name=name, cov_ratio=0.2, clip_cov_lb=0.0)
        _, metrics = policy_loss(lp, mu, adv, mask, cfg, compute_normalizer(mask, cfg))
        assert metrics[key] > 0, name


def test_gspo_equals_the_sequence_objective():
    """With a sequence advantage and seq_mean, GSPO's token form has the value and gradient of the paper's
    sequence objective -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log pi/mu) (brute-force autograd)."""
    cfg = LossConfig(name="gspo", clip_eps_low=0.02, clip_eps_high=0.03, aggregation="seq_mean")
    lp, mu, adv, mask = random_batch(7, sequence_advantages=True, spread=0.05)
    lp1 = lp.clone().requires_grad_(True)
    loss, _ = policy_loss(lp1, mu, adv, mask, cfg, compute_normalizer(mask, cfg))
    (grad,) = torch.autograd.grad(loss, [lp1])

    lp2 = lp.clone().requires_grad_(True)
    terms = []
    for b in range(B):
        tokens = mask[b].nonzero().flatten().tolist()
        if not tokens:
            continue
        s = torch.exp(sum(lp2[b, t] - mu[b, t] for t in tokens) / len(tokens))
        a = adv[b, tokens[0]]
        clipped = torch.clamp(s, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high)
        terms.append(-torch.minimum(s * a, clipped * a))
    reference = sum(terms) / len(terms)
    (reference_grad,) = torch.autograd.grad(reference, [lp2])
    clipped_rows = sum(1 for t in terms if t.grad_fn is not None)
    assert clipped_rows == len(terms)
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-12, atol=1e-14)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    """PPO's clip zeroes the gradient of a token outside the range; CISPO's detached weight keeps it."""
    lp = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    mu = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)  # ratio e on the first token: far outside
    adv, mask = torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    grads = {}
    for name in ("ppo_clip", "cispo"):
        cfg = LossConfig(name=name, clip_eps_low=0.2, clip_eps_high=0.2)
        x = lp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, mu, adv, mask, cfg, compute_normalizer(mask, cfg))
        (grads[name],) = torch.autograd.grad(loss, [x])
    assert grads["ppo_clip"][0, 0] == 0
    assert grads["cispo"][0, 0] == pytest.approx(-1.2 / 2)  # -clip(e) * A / N_tokens


# --- advantage estimators -----------------------------------------------------------------------------

def test_passk_and_opo_advantages_equal_verl():
    g = torch.Generator().manual_seed(3)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    binary = (torch.rand(len(groups), generator=g) > 0.5).double()  # ties, and a group with one value
    binary[8:11] = 1.0
    graded = torch.rand(len(groups), generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, S, (len(groups),), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).double()
    cases, ours = [], []
    for rewards in (binary, graded):
        token_rewards = torch.zeros(len(groups), S, dtype=torch.float64)
        token_rewards[torch.arange(len(groups)), lengths - 1] = rewards
        for estimator, by_std in (("grpo_passk", True), ("grpo_passk", False), ("opo", True)):
            cfg = AdvantageConfig(estimator=estimator, scale_by_std=by_std)
            ours.append(compute_advantages(rewards, groups, cfg, lengths=lengths.double()))
            cases.append(dict(kind="advantage", name=estimator, token_level_rewards=token_rewards, response_mask=mask,
                              index=np.array(groups.tolist()), norm_adv_by_std_in_grpo=by_std))
    for mine, reference in zip(ours, verl(cases)):
        per_sequence = reference["advantages"].sum(-1) / mask.sum(-1)
        torch.testing.assert_close(mine, per_sequence, **TOL)
    assert any(bool((mine != 0).any()) for mine in ours)


def test_remax_advantages_equal_verl():
    g = torch.Generator().manual_seed(4)
    rewards = torch.rand(8, generator=g, dtype=torch.float64)
    baselines = torch.rand(8, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, S, (8,), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).double()
    token_level = torch.zeros(8, S, dtype=torch.float64)
    token_level[torch.arange(8), lengths - 1] = rewards
    ours = compute_advantages(rewards, torch.arange(8) // 2, AdvantageConfig(estimator="remax"), baselines=baselines)
    (reference,) = verl([dict(kind="remax", token_level_rewards=token_level, reward_baselines=baselines,
                              response_mask=mask)])
    # verl's ReMax advantage is the reward-to-go minus the baseline on every token: r - b for an outcome reward
    torch.testing.assert_close(ours[:, None] * mask, reference["advantages"], **TOL)
    missing = baselines.clone()
    missing[3] = float("nan")
    partial = compute_advantages(rewards, torch.arange(8) // 2, AdvantageConfig(estimator="remax"), baselines=missing)
    assert partial[3] == 0 and partial[2] == ours[2]


def test_opo_needs_lengths_and_singletons_get_zero():
    with pytest.raises(ValueError, match="lengths"):
        compute_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), AdvantageConfig(estimator="opo"))
    adv = compute_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]), AdvantageConfig(estimator="opo"),
                             lengths=torch.tensor([3.0, 1.0, 5.0]))
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.75, 0.0], dtype=adv.dtype))


# --- PPO's critic: GAE and the clipped value loss ------------------------------------------------------

def test_gae_and_the_value_loss_equal_verl():
    """GAE over token-aligned rows (prompt and padding columns are not steps; a multi-turn row's tool-output
    tokens in the middle are not either) and the clipped value loss, values and gradients."""
    _, _, _, mask = random_batch(31, empty_row=False)
    mask[1, 5] = 0  # an environment token between two policy tokens
    g = torch.Generator().manual_seed(31)
    values = torch.randn(B, S, generator=g, dtype=torch.float64) * mask
    rewards = token_rewards(torch.randn(B, generator=g, dtype=torch.float64), mask)
    cases, ours = [], []
    for gamma, lam in ((1.0, 1.0), (0.99, 0.95), (0.9, 0.0)):
        ours.append(gae_advantages(rewards, values, mask, gamma=gamma, lam=lam))
        cases.append(dict(kind="gae", token_level_rewards=rewards, values=values, response_mask=mask, gamma=gamma,
                          lam=lam))
    predictions = values + 0.8 * torch.randn(B, S, generator=g, dtype=torch.float64)
    returns = ours[1][1]
    for clip in (0.2, 5.0):
        x = predictions.clone().requires_grad_(True)
        loss, metrics = clipped_value_loss(x, values, returns, mask, clip, compute_normalizer(mask, LossConfig()))
        (grad,) = torch.autograd.grad(loss, [x])
        ours.append((loss.detach(), grad, metrics))
        cases.append(dict(kind="value_loss", vpreds=predictions, returns=returns, values=values, response_mask=mask,
                          cliprange_value=clip))
    results = verl(cases)
    for (advantages, returns), reference in zip(ours[:3], results[:3]):
        torch.testing.assert_close(advantages, reference["advantages"] * mask, **TOL)
        torch.testing.assert_close(returns, reference["returns"] * mask, **TOL)
    for (loss, grad, metrics), reference in zip(ours[3:], results[3:]):
        torch.testing.assert_close(loss, reference["loss"], **TOL)
        torch.testing.assert_close(grad, reference["grad"], **TOL)
        assert float(metrics["value_clip_frac"]) == pytest.approx(reference["clipfrac"], rel=1e-6)  # a float32 metric
    assert 0 < results[3]["clipfrac"] < 1  # the tight clip binds on some tokens


def test_gae_with_gamma_and_lambda_one_is_the_return_minus_the_value():
    _, _, _, mask = random_batch(32, empty_row=False)
    g = torch.Generator().manual_seed(32)
    values = torch.randn(B, S, generator=g, dtype=torch.float64) * mask
    outcome = torch.randn(B, generator=g, dtype=torch.float64)
    advantages, returns = gae_advantages(token_rewards(outcome, mask), values, mask, gamma=1.0, lam=1.0, whiten=False)
    expected = (outcome[:, None] - values) * mask
    torch.testing.assert_close(advantages, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, outcome[:, None] * mask, rtol=1e-12, atol=1e-12)


# --- rollout correction ---------------------------------------------------------------------------------

def test_rollout_correction_equals_verl():
    lp, mu, _, mask = random_batch(11, spread=0.4)
    log_ratio = (lp - mu) * mask
    settings = [dict(weights="token", weight_cap=1.5), dict(weights="sequence", weight_cap=3.0),
                dict(weights="token", weight_cap=1.6, weight_floor=0.6),
                dict(weights="sequence", weight_cap=4.0, weight_floor=0.25)]
    rejections = [{"token_k1": [0.7, 1.4]}, {"seq_mean_k1": [0.9, 1.1], "token_k3": 0.08},
                  {"seq_sum_k2": 0.3, "seq_max_k3": 0.2}, {"seq_mean_k2": 0.05, "seq_sum_k1": [0.5, 2.0]}]
    cases, ours = [], []
    for fields in settings:
        cfg = RolloutCorrectionConfig(**fields)
        ours.append(correction_weights(log_ratio, mask, cfg))
        threshold = cfg.weight_cap if cfg.weight_floor is None else f"{cfg.weight_floor}_{cfg.weight_cap}"
        cases.append(dict(kind="rollout_weights", log_ratio=log_ratio, response_mask=mask, rollout_is=cfg.weights,
                          rollout_is_threshold=threshold))
    for reject in rejections:
        cfg = RolloutCorrectionConfig(reject=reject)
        ours.append(rejection_mask(log_ratio, mask, cfg))
        spec = ",".join(f"{v[0]}_{v[1]}" if isinstance(v, list) else str(v) for v in reject.values())
        cases.append(dict(kind="rollout_rejection", log_ratio=log_ratio, response_mask=mask,
                          rollout_rs=",".join(reject), rollout_rs_threshold=spec))
    results = verl(cases)
    for (weights, metrics), reference in zip(ours[:len(settings)], results):
        torch.testing.assert_close(weights, reference["weights"], **TOL)
        assert float(metrics["rollout_is_ess"]) == pytest.approx(reference["ess"], rel=1e-6)
    kept_fractions = []
    for (keep, metrics), reference in zip(ours[len(settings):], results[len(settings):]):
        torch.testing.assert_close(keep, reference["mask"].to(keep.dtype), **TOL)
        assert float(metrics["rollout_rs_masked_frac"]) == pytest.approx(reference["masked_fraction"], abs=1e-9)
        kept_fractions.append(float(keep.sum() / mask.sum()))
    assert min(kept_fractions) < 1.0 and max(kept_fractions) > 0.0  # the criteria bite, and not on everything


def test_the_loss_hook_applies_weights_and_rejection():
    """make_loss_fn with rollout correction = the loss on the kept tokens, its policy-gradient terms times the
    weights, over the normaliser fixed before the forward; rejected tokens get no gradient."""
    lp, mu, adv, mask = random_batch(21, spread=0.4)
    loss_cfg = LossConfig(name="ppo_clip", kl_coef=0.0)
    correction = RolloutCorrectionConfig(weights="sequence", weight_cap=2.0, reject={"seq_mean_k1": [0.9, 1.1]})
    normalizer = compute_normalizer(mask, loss_cfg)
    batch = TrainBatch(tokens=torch.zeros(B, S, dtype=torch.long), loss_mask=mask, advantages=adv,
                       behaviour_logprobs=mu)
    x = lp.clone().requires_grad_(True)
    loss, metrics = make_loss_fn(loss_cfg, normalizer, correction)(x, batch)
    (grad,) = torch.autograd.grad(loss, [x])

    weights, _ = correction_weights((lp - mu) * mask, mask, correction)
    keep, _ = rejection_mask((lp - mu) * mask, mask, correction)
    y = lp.clone().requires_grad_(True)
    expected, _ = policy_loss(y, mu, adv, keep, loss_cfg, normalizer, rollout_weights=weights)
    (expected_grad,) = torch.autograd.grad(expected, [y])
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    rejected = (mask > 0) & (keep == 0)
    assert rejected.any() and grad[rejected].abs().max() == 0
    assert 0 < metrics["rollout_rs_masked_frac"] < 1 and "rollout_is_ess" in metrics


def test_a_user_loss_without_rollout_weights_is_refused_with_weights():
    from megatron_rl.algorithms.config import LOSSES

    def plain(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, **kwargs):
        return logprobs.sum(), {}

    def strict(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *, reference_logprobs=None,
               entropy=None, proximal_logprobs=None):
        return logprobs.sum(), {}

    LOSSES.register("test_strict_loss")(strict)
    try:
        with pytest.raises(ValueError, match="takes no rollout_weights"):
            make_loss_fn(LossConfig(name="test_strict_loss"), 1.0, RolloutCorrectionConfig(weights="token"))
        make_loss_fn(LossConfig(name="test_strict_loss"), 1.0, RolloutCorrectionConfig(reject={"token_k2": 1.0}))
    finally:
        LOSSES.unregister("test_strict_loss")
    assert plain  # a **kwargs loss accepts the keyword


# --- overlong shaping ------------------------------------------------------------------------------------

def test_overlong_penalty_is_dapos_formula():
    max_tokens, buffer, factor = 20, 8, 0.5
    lengths = torch.arange(0, 21)
    got = overlong_penalty(lengths, max_tokens, buffer, factor)
    for length, value in zip(lengths.tolist(), got.tolist()):
        expected = 0.0 if length <= max_tokens - buffer else ((max_tokens - buffer) - length) / buffer
        assert value == pytest.approx(factor * expected, abs=1e-15)
    assert got[-1] == pytest.approx(-factor)
    assert torch.equal(overlong_penalty(lengths, max_tokens, 0, factor), torch.zeros(21, dtype=torch.float64))


def test_build_step_batch_shapes_rewards_and_masks_truncated_samples():
    from megatron_rl.controller.batching import build_step_batch
    from megatron_rl.controller.episodes import Group, Sample
    from megatron_rl.rewards.registry import RewardResult

    def sample(n_out, finish, reward, k):
        c = Completion(request_id=f"r{k}", prompt_ids=[1, 2, 3], output_ids=list(range(10, 10 + n_out)),
                       output_logprobs=[-0.5] * n_out, weight_versions=[0] * n_out, finish_reason=finish)
        return Sample(c, "", RewardResult(reward=reward))

    samples = [sample(4, "stop", 1.0, 0), sample(9, "stop", 1.0, 1), sample(10, "length", 0.0, 2),
               sample(6, "stop", 0.0, 3)]
    groups = [Group(prompt=None, samples=samples, requested_at_version=0)]
    overlong = OverlongConfig(buffer_tokens=4, penalty=1.0, mask_truncated=True)
    step = build_step_batch(groups, advantage=AdvantageConfig(estimator="grpo", scale_by_std=False),
                            trainer_version=0, micro_batch_size=4, pad_token_id=0, drop_uninformative=False,
                            overlong=overlong, max_new_tokens=10)
    shaped = torch.tensor([1.0, 1.0 - 3 / 4, 0.0 - 1.0, 0.0])  # lengths 4, 9, 10, 6 against 10 - 4 = 6
    expected_adv = shaped - shaped.mean()
    assert step.full_loss_mask[2].sum() == 0 and step.full_loss_mask[0].sum() == 4
    batch = step.batch
    row_advantages = {}
    for r in range(batch.tokens.shape[0]):
        response = batch.loss_mask[r] > 0
        if response.any():
            row_advantages[int(response.sum())] = float(batch.advantages[r][response][0])
    assert row_advantages == pytest.approx({4: float(expected_adv[0]), 9: float(expected_adv[1]),
                                            6: float(expected_adv[3])})
    assert step.metrics["rollout/overlong_penalty_mean"] == pytest.approx(float((shaped - torch.tensor(
        [1.0, 1.0, 0.0, 0.0])).mean()))


# --- configuration -----------------------------------------------------------------------------------

@pytest.mark.parametrize("section,fields,field", [
    (LossConfig, dict(sapo_tau_pos=0), "sapo_tau_pos"),
    (LossConfig, dict(sapo_tau_neg=-1), "sapo_tau_neg"),
    (LossConfig, dict(cov_ratio=0), "cov_ratio"),
    (LossConfig, dict(cov_ratio=1.5), "cov_ratio"),
    (LossConfig, dict(clip_cov_lb=5, clip_cov_ub=1), "clip_cov_ub"),
    (LossConfig, dict(kl_cov_coef=-1), "kl_cov_coef"),
    (LossConfig, dict(name="gmpo"), "aggregation"),
    (RolloutCorrectionConfig, dict(weight_cap=0), "weight_cap"),
    (RolloutCorrectionConfig, dict(weight_floor=3.0), "weight_floor"),
    (RolloutCorrectionConfig, dict(reject={"token_k4": 1.0}), "reject"),
    (RolloutCorrectionConfig, dict(reject={"token_k1": 1.5}), "reject"),
    (RolloutCorrectionConfig, dict(reject={"token_k1": [2.0, 1.0]}), "reject"),
    (RolloutCorrectionConfig, dict(reject={"seq_max_k3": [0.1, 0.2]}), "reject"),
    (RolloutCorrectionConfig, dict(reject={"seq_max_k3": 0}), "reject"),
    (AdvantageConfig, dict(gamma=0), "gamma"),
    (AdvantageConfig, dict(gamma=1.5), "gamma"),
    (AdvantageConfig, dict(lam=-0.1), "lam"),
    (OverlongConfig, dict(buffer_tokens=-1), "buffer_tokens"),
    (OverlongConfig, dict(penalty=-0.5), "penalty"),
])
def test_new_fields_are_bounded(section, fields, field):
    with pytest.raises(ConfigError) as error:
        section(**fields)
    assert error.value.field == field


def test_a_yaml_config_selects_the_new_objectives(tmp_path):
    from megatron_rl.run_config import load_run_config

    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  advantage: {estimator: grpo_passk}\n  loss: {name: gspo, aggregation: seq_mean,"
                    " clip_eps_low: 0.0003, clip_eps_high: 0.0004}\n  rollout_correction:\n    weights: sequence\n"
                    "    reject: {seq_mean_k1: [0.999, 1.001], token_k3: 0.5}\n"
                    "  overlong: {buffer_tokens: 16, mask_truncated: true}\n")
    config = load_run_config(str(path))
    assert config.algorithm.loss.name == "gspo"
    assert config.algorithm.rollout_correction.reject == {"seq_mean_k1": [0.999, 1.001], "token_k3": 0.5}
    assert config.algorithm.overlong.buffer_tokens == 16


# --- ReMax: a greedy baseline response per prompt ---------------------------------------------------------

def test_remax_samples_a_greedy_baseline_per_prompt_and_trains_only_the_samples(tmp_path, tiny_chat_model):
    from megatron_rl.controller.episodes import BASELINE_ROLE, GroupRequest, SingleTurnSampling
    from megatron_rl.data.prompts import Prompt
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.rewards.config import RewardConfig
    from megatron_rl.rewards.registry import Reward
    from megatron_rl.rollout.config import NativeEngineConfig, RolloutConfig
    from megatron_rl.rollout.engine import GenerateRequest, SamplingParams
    from megatron_rl.rollout.native import NativeEngine

    model = load_pretrained(tiny_chat_model)
    config = RolloutConfig(samples_per_prompt=3, max_new_tokens=6)
    prompt = Prompt(prompt_id="p0", messages=[{"role": "user", "content": "What is 2 + 3?"}], question="What is 2 + 3?")
    ids = model.tokenizer.encode_chat(prompt.messages)
    with NativeEngine(model.arch, model.state, tokenizer=model.tokenizer,
                      config=NativeEngineConfig(max_batch_size=8)) as engine:
        producer = SingleTurnSampling(engine, model.tokenizer, Reward(RewardConfig(name="tests.test_loop:vowel_fraction")),
                                      config, greedy_baseline=True)
        (futures,) = producer.submit([GroupRequest(prompt, ids, "s0-p0-p0", seed=5)])
        samples = producer.collect(prompt, futures)
        greedy = engine.generate([GenerateRequest("g", ids, SamplingParams(max_new_tokens=6, temperature=0.0))])[0]
    assert [s.role for s in samples] == ["policy"] * 3 + [BASELINE_ROLE]
    assert samples[-1].completion.output_ids == greedy.output_ids

    run_dir = str(tmp_path / "remax")
    train(_config(tiny_chat_model, run_dir, "algorithm.advantage.estimator=remax", "steps=2",
                  "checkpoint.every_steps=0"))
    steps = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if "rollout/trained_samples" in line]
    assert [s["rollout/trained_samples"] for s in steps] == [8.0, 8.0]  # 2 prompts x 4 samples, no greedy row
    assert all("train/loss" in s for s in steps)


def test_remax_is_refused_where_no_greedy_baseline_is_generated():
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig
    from tests.test_loop import QUICKSTART

    with pytest.raises(ConfigError, match="remax generates a greedy baseline"):
        load_yaml(RunConfig, QUICKSTART, ["algorithm.advantage.estimator=remax", "algorithm.objective=jepo"])
