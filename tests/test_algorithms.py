"""Advantages and policy losses against brute-force per-token Python loops (float64, random inputs)."""
from __future__ import annotations

import math
import statistics
import zlib

import pytest
import torch

from megatron_rl.algorithms.advantages import (
    compute_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_advantages,
)
from megatron_rl.algorithms.config import AdvantageConfig, LossConfig
from megatron_rl.algorithms.losses import compute_normalizer, make_loss_fn, policy_loss
from megatron_rl.config import ConfigError
from megatron_rl.types import TrainBatch

B, S = 5, 7


# --- brute force ----------------------------------------------------------------------------------------

def brute_token_term(name, lp, mu, a, cfg, prox=None):
    """The per-token loss written out from the papers' formulas, one scalar at a time."""
    def clipped(r):
        s1 = r * a
        s2 = min(max(r, torch.tensor(1 - cfg.clip_eps_low, dtype=r.dtype)),
                 torch.tensor(1 + cfg.clip_eps_high, dtype=r.dtype)) * a
        term = -min(s1, s2)
        if cfg.dual_clip_c is not None and a < 0:
            term = min(term, -cfg.dual_clip_c * a)
        return term

    if name == "pg":
        return -a * lp
    if name == "ppo_clip":
        return clipped(torch.exp(lp - mu))
    if name == "aipo":
        w = min(math.exp(float(lp) - float(mu)), cfg.aipo_rho)  # a plain float: no gradient
        return -w * a * lp
    if name == "tis":
        p = lp.detach() if prox is None else prox
        raw = math.exp(float(p) - float(mu))
        w = min(raw, cfg.tis_cap) if cfg.tis_mode == "truncate" else (0.0 if raw > cfg.tis_cap else raw)
        return w * clipped(torch.exp(lp - p))
    raise AssertionError(name)


def brute_kl(lp, ref, estimator):
    x = lp - ref
    return {"k1": x, "k2": 0.5 * x * x, "k3": torch.exp(-x) + x - 1}[estimator]


def brute_loss(name, lp, mu, adv, mask, cfg, ref=None, ent=None, prox=None, max_len=None):
    per_seq_terms = []
    for b in range(lp.shape[0]):
        terms = []
        for t in range(lp.shape[1]):
            if mask[b, t] == 0:
                continue
            term = brute_token_term(name, lp[b, t], mu[b, t] if mu is not None else None, adv[b, t], cfg,
                                    None if prox is None else prox[b, t])
            if ref is not None and cfg.kl_coef > 0:
                term = term + cfg.kl_coef * brute_kl(lp[b, t], ref[b, t], cfg.kl_estimator)
            if ent is not None and cfg.entropy_coef > 0:
                term = term - cfg.entropy_coef * ent[b, t]
            terms.append(term)
        per_seq_terms.append(terms)
    n_tokens = sum(len(t) for t in per_seq_terms)
    n_seqs = sum(1 for t in per_seq_terms if t)
    if cfg.aggregation == "token_mean":
        return sum(sum(t) for t in per_seq_terms if t) / n_tokens
    if cfg.aggregation == "seq_mean":
        return sum(sum(t) / len(t) for t in per_seq_terms if t) / n_seqs
    return sum(sum(t) for t in per_seq_terms if t) / (n_seqs * cfg.max_response_tokens)


def random_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -3 * torch.rand(B, S, generator=g, dtype=torch.float64) - 0.01
    mu = lp + 0.4 * torch.randn(B, S, generator=g, dtype=torch.float64)
    adv = torch.randn(B, S, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, S, generator=g) > 0.25).double()
    mask[:, 0] = 0
    mask[2] = 0  # a row with no loss tokens
    mask[0, 1] = 1
    ref = lp + 0.3 * torch.randn(B, S, generator=g, dtype=torch.float64)
    ent = torch.rand(B, S, generator=g, dtype=torch.float64) * 2
    prox = lp + 0.2 * torch.randn(B, S, generator=g, dtype=torch.float64)
    return lp, mu, adv, mask, ref, ent, prox


CASES = [
    ("pg", {}),
    ("ppo_clip", {}),
    ("ppo_clip", {"clip_eps_low": 0.1, "clip_eps_high": 0.28, "dual_clip_c": 1.5}),
    ("aipo", {"aipo_rho": 1.2}),
    ("aipo", {"aipo_rho": 4.0, "aggregation": "seq_mean"}),
    ("tis", {"tis_cap": 1.3}),
    ("tis", {"tis_cap": 1.3, "tis_mode": "mask"}),
    ("tis", {"tis_cap": 1.3, "_prox": True}),
    ("tis", {"tis_cap": 1.3, "tis_mode": "mask", "dual_clip_c": 2.0, "_prox": True}),
    ("ppo_clip", {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01}),
    ("aipo", {"kl_coef": 0.05, "kl_estimator": "k1", "aggregation": "seq_sum_norm", "max_response_tokens": 9}),
    ("pg", {"kl_coef": 0.2, "kl_estimator": "k2", "entropy_coef": 0.1, "aggregation": "seq_mean"}),
]


@pytest.mark.parametrize("name,overrides", CASES)
def test_loss_gradient_matches_brute_force(name, overrides):
    overrides = dict(overrides)
    use_prox = overrides.pop("_prox", False)
    lp, mu, adv, mask, ref, ent, prox = random_inputs(seed=zlib.crc32(f"{name}{overrides}".encode()) % 1000)
    cfg = LossConfig(name=name, **overrides)
    prox = prox if use_prox else None

    lp1 = lp.clone().requires_grad_(True)
    ent1 = ent.clone().requires_grad_(True)
    normalizer = compute_normalizer(mask, cfg)
    loss, metrics = policy_loss(lp1, mu, adv, mask, cfg, normalizer, reference_logprobs=ref, entropy=ent1,
                                proximal_logprobs=prox)
    g_lp, g_ent = torch.autograd.grad(loss, [lp1, ent1], allow_unused=True)

    lp2 = lp.clone().requires_grad_(True)
    ent2 = ent.clone().requires_grad_(True)
    ref_loss = brute_loss(name, lp2, mu, adv, mask, cfg, ref=ref, ent=ent2, prox=prox)
    r_lp, r_ent = torch.autograd.grad(ref_loss, [lp2, ent2], allow_unused=True)

    torch.testing.assert_close(g_lp, r_lp, rtol=1e-10, atol=1e-12)
    if cfg.entropy_coef > 0:
        torch.testing.assert_close(g_ent, r_ent, rtol=1e-10, atol=1e-12)
    assert g_lp[mask == 0].abs().max() == 0
    if name != "pg":  # pg's value is not an objective; the others' values match too
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    assert all(v.dim() == 0 and torch.isfinite(v) for v in metrics.values())
    if name == "ppo_clip" or use_prox or (name == "aipo" and cfg.aipo_rho < 2):  # clipping is exercised
        assert 0 < metrics["clip_frac"] < 1


def test_aipo_weight_is_detached_and_clipped_from_above():
    lp, mu, adv, mask, *_ = random_inputs(3)
    cfg = LossConfig(name="aipo", aipo_rho=1.5)
    lp = lp.requires_grad_(True)
    n = compute_normalizer(mask, cfg)
    loss, metrics = policy_loss(lp, mu, adv, mask, cfg, n)
    (grad,) = torch.autograd.grad(loss, [lp])
    expected = -torch.clamp(torch.exp(lp.detach() - mu), max=1.5) * adv * mask / n
    torch.testing.assert_close(grad, expected)
    ratio = torch.exp(lp.detach() - mu)[mask > 0]
    assert metrics["clip_frac"].item() == pytest.approx((ratio > 1.5).double().mean().item(), abs=1e-6)
    assert metrics["is_weight_max"].item() == pytest.approx(ratio.max().item(), rel=1e-5)
    assert metrics["is_weight_min"].item() == pytest.approx(ratio.min().item(), rel=1e-5)
    assert metrics["is_weight_mean"].item() == pytest.approx(ratio.mean().item(), rel=1e-5)
    mismatch = (lp.detach() - mu)[mask > 0].abs().mean().item()
    assert metrics["logprob_mismatch"].item() == pytest.approx(mismatch, rel=1e-5)


def test_on_policy_losses_agree():
    """With mu = pi (no staleness, no mismatch) pg, ppo_clip, aipo and tis have the same gradient."""
    lp, _, adv, mask, *_ = random_inputs(4)
    grads = []
    for name in ["pg", "ppo_clip", "aipo", "tis"]:
        cfg = LossConfig(name=name)
        x = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, lp, adv, mask, cfg, compute_normalizer(mask, cfg))
        grads.append(torch.autograd.grad(loss, [x])[0])
        assert metrics["logprob_mismatch"] == 0 and metrics["is_weight_mean"] == pytest.approx(1.0)
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0])


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "seq_sum_norm"])
@pytest.mark.parametrize("name", ["ppo_clip", "aipo"])
def test_micro_batch_shares_sum_to_global_loss(aggregation, name):
    lp, mu, adv, mask, ref, *_ = random_inputs(5)
    cfg = LossConfig(name=name, aggregation=aggregation, max_response_tokens=S, kl_coef=0.1)
    normalizer = compute_normalizer(mask, cfg)
    x = lp.clone().requires_grad_(True)
    full, _ = policy_loss(x, mu, adv, mask, cfg, normalizer, reference_logprobs=ref)
    (g_full,) = torch.autograd.grad(full, [x])
    for sizes in ([1, 1, 1, 1, 1], [2, 3], [4, 1]):
        # the normaliser can also be computed from the pieces
        pieces = list(torch.split(mask, sizes))
        assert compute_normalizer(pieces, cfg) == normalizer
        y = lp.clone().requires_grad_(True)
        total = sum(policy_loss(a, b, c, d, cfg, normalizer, reference_logprobs=e)[0]
                    for a, b, c, d, e in zip(torch.split(y, sizes), torch.split(mu, sizes),
                                             torch.split(adv, sizes), pieces, torch.split(ref, sizes)))
        torch.testing.assert_close(total, full)
        torch.testing.assert_close(torch.autograd.grad(total, [y])[0], g_full)


def test_make_loss_fn_is_the_trainer_hook():
    lp, mu, adv, mask, ref, *_ = random_inputs(6)
    batch = TrainBatch(tokens=torch.zeros(B, S, dtype=torch.long), loss_mask=mask, advantages=adv,
                       behaviour_logprobs=mu, reference_logprobs=ref)
    cfg = LossConfig(name="aipo", kl_coef=0.01)
    fn = make_loss_fn(cfg, compute_normalizer(batch.loss_mask, cfg))
    shares = [fn(lp[i:i + 2], mb)[0] for i, mb in zip(range(0, B, 2), batch.micro_batches(2))]
    full, _ = policy_loss(lp, mu, adv, mask, cfg, compute_normalizer(mask, cfg), reference_logprobs=ref)
    torch.testing.assert_close(sum(shares), full)


def test_normalizer_values_and_empty_batch():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 1.]])
    assert compute_normalizer(mask, LossConfig(aggregation="token_mean")) == 5
    assert compute_normalizer(mask, LossConfig(aggregation="seq_mean")) == 2
    assert compute_normalizer(mask, LossConfig(aggregation="seq_sum_norm", max_response_tokens=10)) == 20
    empty = torch.zeros(2, 3)
    cfg = LossConfig(name="ppo_clip")
    loss, metrics = policy_loss(torch.zeros(2, 3, requires_grad=True), empty, empty, empty, cfg,
                                compute_normalizer(empty, cfg))
    assert loss.item() == 0 and all(torch.isfinite(v) for v in metrics.values())


def test_padding_with_extreme_values_gives_finite_gradients():
    lp, mu, adv, mask, *_ = random_inputs(7)
    lp = lp.masked_fill(mask == 0, -1e4)
    mu = mu.masked_fill(mask == 0, 0.0)
    for name in ["ppo_clip", "aipo", "tis"]:
        x = lp.clone().requires_grad_(True)
        cfg = LossConfig(name=name)
        loss, _ = policy_loss(x, mu, adv, mask, cfg, compute_normalizer(mask, cfg))
        (g,) = torch.autograd.grad(loss, [x])
        assert torch.isfinite(g).all() and g[mask == 0].abs().max() == 0


def test_loss_config_validation():
    with pytest.raises(ConfigError, match="name"):
        LossConfig(name="nope")
    with pytest.raises(ConfigError, match="max_response_tokens"):
        LossConfig(aggregation="seq_sum_norm")
    with pytest.raises(ConfigError, match="dual_clip_c"):
        LossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="reference_logprobs"):
        z = torch.zeros(1, 2)
        policy_loss(z, z, z, torch.ones(1, 2), LossConfig(kl_coef=0.1), 1.0)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        z = torch.zeros(1, 2)
        policy_loss(z, None, z, torch.ones(1, 2), LossConfig(name="aipo"), 1.0)


# --- advantages ---------------------------------------------------------------------------------------

def brute_groups(rewards, groups):
    by = {}
    for i, g in enumerate(groups):
        by.setdefault(g, []).append(i)
    return by


def test_advantages_match_brute_force():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (23,), generator=g).double() / 2
    groups = [f"p{int(i)}" for i in torch.randint(0, 6, (23,), generator=g)] + []
    groups[-1] = "singleton"
    by = brute_groups(rewards, groups)
    grpo = grpo_advantages(rewards, groups, eps=1e-6)
    dr = grpo_advantages(rewards, groups, scale_by_std=False)
    rloo = rloo_advantages(rewards, groups)
    for members in by.values():
        rs = [float(rewards[i]) for i in members]
        for i in members:
            if len(members) == 1:
                assert grpo[i] == 0 and dr[i] == 0 and rloo[i] == 0
                continue
            mean = statistics.fmean(rs)
            assert grpo[i].item() == pytest.approx((rewards[i].item() - mean) / (statistics.stdev(rs) + 1e-6))
            assert dr[i].item() == pytest.approx(rewards[i].item() - mean)
            others = [float(rewards[j]) for j in members if j != i]
            assert rloo[i].item() == pytest.approx(rewards[i].item() - statistics.fmean(others))
    rs = rewards.tolist()
    rpp = reinforce_pp_advantages(rewards, groups)
    for i, r in enumerate(rs):
        assert rpp[i].item() == pytest.approx((r - statistics.fmean(rs)) / (statistics.stdev(rs) + 1e-6))
    centred = [r - statistics.fmean([rs[j] for j in by[groups[i]]]) for i, r in enumerate(rs)]
    rppb = reinforce_pp_advantages(rewards, groups, group_baseline=True)
    for i, c in enumerate(centred):
        assert rppb[i].item() == pytest.approx((c - statistics.fmean(centred)) / (statistics.stdev(centred) + 1e-6))


def test_advantages_grouped_tensor_and_config():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    flat_ids = [0, 0, 0, 0, 1, 1, 1, 1]
    for est in ["grpo", "rloo", "reinforce_pp"]:
        cfg = AdvantageConfig(estimator=est)
        torch.testing.assert_close(compute_advantages(r, None, cfg).reshape(-1),
                                   compute_advantages(r.reshape(-1), flat_ids, cfg))
    a = compute_advantages(r, None, AdvantageConfig())
    assert a[1].abs().max() == 0  # all-equal group: no signal
    with pytest.raises(ConfigError, match="estimator"):
        AdvantageConfig(estimator="vtrace")


def test_token_advantages():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1.]])
    out = token_advantages(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 2, 2, 0], [0, 0, -1, -1.]]))


def _normalizer_rank(rank, world_size, masks):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return [compute_normalizer(masks[rank], LossConfig(aggregation=agg, max_response_tokens=8), group=dist.group.WORLD)
            for agg in ("token_mean", "seq_mean", "seq_sum_norm")]


def test_normalizer_sums_over_data_parallel_ranks():
    from megatron_rl.placement.launch import run_distributed

    mask = random_inputs(8)[3]
    expected = [compute_normalizer(mask, LossConfig(aggregation=agg, max_response_tokens=8))
                for agg in ("token_mean", "seq_mean", "seq_sum_norm")]
    results = run_distributed(_normalizer_rank, 2, [mask[:2], mask[2:]], timeout=120)
    assert results == [expected, expected]


def test_config_names_match_the_registries():
    """The torch-free config validates names against lists that must equal the registries themselves."""
    from megatron_rl.algorithms import advantages, losses
    from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS, LOSSES

    assert {name: ADVANTAGE_ESTIMATORS.resolve(name) for name in ADVANTAGE_ESTIMATORS} == {
        "grpo": advantages.grpo_estimator, "rloo": advantages.rloo_estimator,
        "reinforce_pp": advantages.reinforce_pp_estimator, "grpo_passk": advantages.grpo_passk_estimator,
        "opo": advantages.opo_estimator, "remax": advantages.remax_estimator}
    assert {name: losses.get_loss(name) for name in LOSSES} == {
        "pg": losses.pg_loss, "ppo_clip": losses.ppo_clip_loss, "aipo": losses.aipo_loss, "tis": losses.tis_loss,
        "gspo": losses.gspo_loss, "cispo": losses.cispo_loss, "gmpo": losses.gmpo_loss, "sapo": losses.sapo_loss,
        "clip_cov": losses.clip_cov_loss, "kl_cov": losses.kl_cov_loss}
