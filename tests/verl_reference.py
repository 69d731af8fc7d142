"""verl 0.9.1's own implementations as the reference for tests/test_objectives.py, run in a child process:

    python tests/verl_reference.py CASES.pt RESULTS.pt

verl is installed without its dependencies (scripts/setup_cpu.sh: `pip install --no-deps verl==0.9.1`):
`verl.trainer.ppo.core_algos` and `rollout_corr_helper` need only torch and numpy for their arithmetic, but
verl's package imports pull Ray, tensordict, OmegaConf, codetiming and orjson at import time. Those few, when
absent, are stood in for by empty modules in *this* process only (so that no test process ever sees a fake
`ray`); nothing of theirs is called by the functions used here. Each case is a dict naming a verl function
and its inputs; the result holds the value, the gradient with respect to `log_prob` where there is one, and
any extra outputs.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

IMPORT_TIME_ONLY = ("ray", "tensordict", "omegaconf", "codetiming", "orjson")


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {"__init__": lambda self, *a, **k: None})


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Placeholder(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def load_verl():
    missing = [name for name in IMPORT_TIME_ONLY if importlib.util.find_spec(name) is None]
    sys.meta_path.append(_PlaceholderFinder(missing))
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    return core_algos, rollout_corr_helper, ActorConfig, PolicyLossConfig


def run_case(case, core_algos, rollout_corr_helper, ActorConfig, PolicyLossConfig):
    import torch

    kind = case["kind"]
    if kind == "loss":
        policy_loss = PolicyLossConfig(**case.get("policy_loss", {}))
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=policy_loss,
                             **case.get("actor", {}))
        log_prob = case["log_prob"].clone().requires_grad_(True)
        if "seed" in case:
            torch.manual_seed(case["seed"])
        loss, _ = core_algos.get_policy_loss_fn(case["name"])(
            old_log_prob=case["old_log_prob"], log_prob=log_prob, advantages=case["advantages"],
            response_mask=case["response_mask"], loss_agg_mode=case["loss_agg_mode"], config=config,
            rollout_is_weights=case.get("rollout_is_weights"))
        (grad,) = torch.autograd.grad(loss, [log_prob])
        return {"loss": loss.detach(), "grad": grad}
    if kind == "advantage":
        fn = core_algos.get_adv_estimator_fn(case["name"])
        config = {"norm_adv_by_std_in_grpo": case.get("norm_adv_by_std_in_grpo", True)}
        advantages, _ = fn(token_level_rewards=case["token_level_rewards"], response_mask=case["response_mask"],
                           index=case["index"], config=config)
        return {"advantages": advantages}
    if kind == "remax":
        advantages, _ = core_algos.compute_remax_outcome_advantage(
            token_level_rewards=case["token_level_rewards"], reward_baselines=case["reward_baselines"],
            response_mask=case["response_mask"])
        return {"advantages": advantages}
    if kind == "gae":
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=case["token_level_rewards"], values=case["values"], response_mask=case["response_mask"],
            gamma=case["gamma"], lam=case["lam"])
        return {"advantages": advantages, "returns": returns}
    if kind == "value_loss":
        vpreds = case["vpreds"].clone().requires_grad_(True)
        loss, clipfrac = core_algos.compute_value_loss(vpreds=vpreds, returns=case["returns"], values=case["values"],
                                                       response_mask=case["response_mask"],
                                                       cliprange_value=case["cliprange_value"])
        (grad,) = torch.autograd.grad(loss, [vpreds])
        return {"loss": loss.detach(), "grad": grad, "clipfrac": float(clipfrac)}
    if kind == "rollout_weights":
        weights, metrics = rollout_corr_helper.compute_rollout_correction_weights(
            log_ratio=case["log_ratio"], response_mask=case["response_mask"], rollout_is=case["rollout_is"],
            rollout_is_threshold=case["rollout_is_threshold"])
        return {"weights": weights, "ess": metrics["rollout_is_eff_sample_size"]}
    if kind == "rollout_rejection":
        mask, metrics = rollout_corr_helper.compute_rollout_rejection_mask(
            log_ratio=case["log_ratio"], response_mask=case["response_mask"], rollout_rs=case["rollout_rs"],
            rollout_rs_threshold=case["rollout_rs_threshold"])
        return {"mask": mask, "masked_fraction": metrics["rollout_rs_masked_fraction"]}
    raise ValueError(f"unknown case kind {kind!r}")


def main(cases_path: str, results_path: str) -> None:
    import torch

    loaded = load_verl()
    cases = torch.load(cases_path, weights_only=False)
    torch.save([run_case(case, *loaded) for case in cases], results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
