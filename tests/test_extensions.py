"""Extension points (docs/extending.md): a user loss and advantage estimator from a module outside the
package, named by a decorator-registered name (with `imports:`) or as 'package.module:function', reach
`train`, `megatron-rl config`, `megatron-rl plan` and the Slurm launcher's launch_env alike; bad specs are
one line naming the field; every registry refuses duplicates and resolves its built-ins as before."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.cli import main
from megatron_rl.config import ConfigError, Registry
from tests.test_bad_input_more import _one_line_error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "examples", "configs", "quickstart.yaml")
LLAMA_8B = os.path.join(REPO, "examples", "configs", "llama3_8b.yaml")
PACKAGE = "ext_user_pkg"
MODULE = f"{PACKAGE}.parts"

# The user module of docs/extending.md: a REINFORCE loss (the same arithmetic as the built-in `pg` without
# KL / entropy terms) that counts its calls in a metric, and a batch-mean baseline estimator.
USER_MODULE = '''
import torch

from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.losses import register_loss

CALLS = {"loss": 0, "estimator": 0}


@register_loss("my_reinforce")
def my_reinforce(logprobs, behaviour_logprobs, advantages, mask, config, normalizer, *,
                 reference_logprobs=None, entropy=None, proximal_logprobs=None):
    """l_t = -A_t log pi(y_t), summed over the loss tokens and divided by the global normaliser."""
    CALLS["loss"] += 1
    m = mask > 0
    logp = torch.where(m, logprobs, torch.zeros_like(logprobs))  # padding may hold anything
    adv = torch.where(m, advantages.to(logp.dtype), torch.zeros_like(logp))
    loss = (-adv * logp).sum() / normalizer
    return loss, {"my_reinforce_ran": torch.ones(())}


@ADVANTAGE_ESTIMATORS.register("batch_mean_baseline")
def batch_mean_baseline(rewards, group_ids, config):
    """A_i = r_i - mean(r) over the whole batch (no groups, no std)."""
    CALLS["estimator"] += 1
    return rewards - rewards.mean()
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    """The user's package in a directory outside ours, importable in this process and in subprocesses."""
    root = tmp_path_factory.mktemp("user_code")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "parts.py").write_text(USER_MODULE)
    (root / "ext_exits.py").write_text("raise SystemExit('this module refuses to be imported')\n")
    sys.path.insert(0, str(root))
    yield str(root)
    sys.path.remove(str(root))
    from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS, LOSSES
    LOSSES.unregister("my_reinforce")
    ADVANTAGE_ESTIMATORS.unregister("batch_mean_baseline")
    for name in (MODULE, PACKAGE, "ext_exits"):
        sys.modules.pop(name, None)


BY_NAME = [f"imports=[{MODULE}]", "algorithm.loss.name=my_reinforce",
           "algorithm.advantage.estimator=batch_mean_baseline"]
BY_PATH = [f"algorithm.loss.name={MODULE}:my_reinforce",
           f"algorithm.advantage.estimator={MODULE}:batch_mean_baseline"]


def _subprocess(user_root, *argv):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([user_root, REPO]), OMP_NUM_THREADS="1",
               WANDB_MODE="disabled")
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


# --- the user loss really is the loss -----------------------------------------------------------------------

def test_user_loss_resolves_both_ways_and_matches_an_independent_computation(user_module):
    from megatron_rl.algorithms.config import LossConfig
    from megatron_rl.algorithms.losses import compute_normalizer, get_loss, pg_loss
    from megatron_rl.run_config import load_run_config

    config = load_run_config(QUICKSTART, BY_NAME)  # importing the module registered the names
    parts = sys.modules[MODULE]
    assert get_loss("my_reinforce") is get_loss(f"{MODULE}:my_reinforce") is parts.my_reinforce
    g = torch.Generator().manual_seed(0)
    logprobs, advantages = -torch.rand(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    loss_config = LossConfig(name=config.algorithm.loss.name)
    normalizer = compute_normalizer(mask, loss_config)
    loss, metrics = get_loss(loss_config.name)(logprobs, None, advantages, mask, loss_config, normalizer)
    expected = -(advantages * logprobs * mask).sum() / mask.sum()  # token_mean by hand
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(loss, pg_loss(logprobs, None, advantages, mask, LossConfig(name="pg"), normalizer)[0])
    assert metrics == {"my_reinforce_ran": torch.ones(())}

    from megatron_rl.algorithms.advantages import compute_advantages
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.0])
    torch.testing.assert_close(compute_advantages(rewards, [0, 0, 1, 1], config.algorithm.advantage),
                               torch.tensor([0.0, -1.0, 2.0, -1.0]))


@pytest.mark.parametrize("overrides", [BY_NAME, BY_PATH], ids=["imports_and_name", "module_path"])
def test_train_runs_the_user_loss_and_estimator(tmp_path, tiny_chat_model, user_module, overrides):
    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import load_run_config

    run_dir = str(tmp_path / "run")
    config = load_run_config(QUICKSTART, [
        f"model.path={tiny_chat_model}", f"run_dir={run_dir}", "steps=2", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "trainer.micro_batch_size=4",
        "data.train.size=16", "data.heldout_size=2", "eval.max_new_tokens=4", "eval.before_training=false",
        "eval.after_training=false", "engine.max_batch_size=8", "checkpoint.every_steps=0",
        "logging.wandb=disabled", "logging.plots=false", "rollout.drop_uninformative_groups=false",
        "reward.name=tests.test_loop:vowel_fraction", *overrides])
    calls = sys.modules[MODULE].CALLS
    before = dict(calls)
    assert train(config).steps == 2
    assert calls["estimator"] - before["estimator"] >= 2 and calls["loss"] - before["loss"] >= 2
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in records if "rollout/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train/my_reinforce_ran"] == 1.0 for r in steps), steps
    assert all("train/clip_frac" not in r for r in steps)  # AIPO's metric: the default loss did not run


# --- config, plan and launch_env know the names too (fresh processes: nothing imported by this one) ---------

@pytest.mark.parametrize("overrides", [BY_NAME, BY_PATH], ids=["imports_and_name", "module_path"])
def test_config_plan_and_launch_env_accept_the_user_parts(user_module, overrides):
    config = _subprocess(user_module, "-m", "megatron_rl.cli", "config", QUICKSTART, *overrides)
    assert config.returncode == 0, config.stderr
    name = overrides[-2].partition("=")[2]
    assert f"name: {name}" in config.stdout
    plan = _subprocess(user_module, "-m", "megatron_rl.cli", "plan", LLAMA_8B, *overrides)
    assert plan.returncode == 0, plan.stderr
    launch = _subprocess(user_module, "-m", "megatron_rl.cli.launch_env", LLAMA_8B, *overrides)
    assert launch.returncode == 0, launch.stdout + launch.stderr
    assert "GPUS_PER_NODE=" in launch.stdout and "exit 2" not in launch.stdout


def test_a_registered_name_needs_its_imports(user_module):
    """Without `imports:` nothing registers the name: the same one-line refusal from config and launch_env."""
    config = _subprocess(user_module, "-m", "megatron_rl.cli", "config", QUICKSTART, "algorithm.loss.name=my_reinforce")
    _one_line_error(config.returncode, config.stderr, "'algorithm.loss.name'", "unknown loss 'my_reinforce'")
    launch = _subprocess(user_module, "-m", "megatron_rl.cli.launch_env", LLAMA_8B, "algorithm.loss.name=my_reinforce")
    assert launch.returncode == 2
    shell = subprocess.run(["bash", "-c", launch.stdout], capture_output=True, text=True, timeout=60)  # as slurm_common.sh
    assert shell.returncode == 2 and "launch_env:" in shell.stderr and "unknown loss 'my_reinforce'" in shell.stderr


# --- bad input: one line, exit 2, naming the field ------------------------------------------------------------

@pytest.mark.parametrize("override, fragments", [
    ("algorithm.loss.name=ext_no_such_module:fn", ["'algorithm.loss.name'", "cannot import module 'ext_no_such_module'"]),
    (f"algorithm.loss.name={MODULE}:no_such_fn", ["'algorithm.loss.name'", "has no attribute 'no_such_fn'"]),
    (f"algorithm.loss.name={MODULE}:CALLS", ["'algorithm.loss.name'", "is not callable"]),
    ("algorithm.advantage.estimator=grpoo", ["'algorithm.advantage.estimator'", "did you mean 'grpo'"]),
    ("algorithm.objective=ext_no_such_module:Objective", ["'algorithm.objective'", "cannot import module"]),
    ("reward.name=nope", ["'reward.name'", "unknown reward 'nope'"]),
    ("curriculum.kind=ext_no_such_module:build", ["'curriculum.kind'", "cannot import module"]),
    ("eval.metrics=[accuracy,perplexity]", ["'eval.metrics'", "unknown eval metric 'perplexity'"]),
    ("recipe=ext_no_such_module:build", ["'recipe'", "cannot import module"]),
    ("recipe=waltz", ["'recipe'", "needs a `waltz:` section"]),
    ("imports=[ext_no_such_module]", ["command-line override 'imports'", "No module named 'ext_no_such_module'"]),
    ("imports=[ext_exits]", ["'imports'", "SystemExit: this module refuses to be imported"]),
])
def test_bad_specs_are_one_line_naming_the_field(capsys, user_module, override, fragments):
    code = main(["config", QUICKSTART, override])
    _one_line_error(code, capsys.readouterr().err, *fragments)


def test_a_bad_import_names_the_line_of_the_yaml(tmp_path, capsys, user_module):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(textwrap.dedent("""\
        steps: 2
        imports:
          - ext_no_such_module
        """))
    _one_line_error(main(["config", str(recipe)]), capsys.readouterr().err, f"{recipe}:2", "'imports'",
                    "No module named 'ext_no_such_module'")


def test_agent_environment_spec_is_checked(capsys, tmp_path):
    recipe = tmp_path / "agent.yaml"
    recipe.write_text("agent:\n  environment: ext_no_such_module:make\n")
    _one_line_error(main(["config", str(recipe)]), capsys.readouterr().err, "'agent.environment'",
                    "cannot import module 'ext_no_such_module'")


# --- the registries ---------------------------------------------------------------------------------------------

def _registries():
    from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS, LOSSES
    from megatron_rl.controller.config import EVAL_METRICS, OBJECTIVES, RECIPES, SELECTORS
    from megatron_rl.recipes.agent.config import ENVIRONMENTS, OPENAI_AGENTS
    from megatron_rl.rewards.config import REWARDS
    return [LOSSES, ADVANTAGE_ESTIMATORS, OBJECTIVES, SELECTORS, EVAL_METRICS, RECIPES, REWARDS, ENVIRONMENTS,
            OPENAI_AGENTS]


def test_every_registry_refuses_duplicates():
    for registry in _registries():
        builtins = registry.names()
        if builtins:
            with pytest.raises(ValueError, match="already registered"):
                registry.register(builtins[0])(lambda *a: None)
        registry.register("ext_test_duplicate")(len)
        try:
            assert "ext_test_duplicate" in registry and registry.resolve("ext_test_duplicate") is len
            with pytest.raises(ValueError, match="already registered"):
                registry.register("ext_test_duplicate")(abs)
        finally:
            registry.unregister("ext_test_duplicate")
        assert registry.names() == builtins
    with pytest.raises(ValueError, match="without ':'"):
        Registry("thing").register("a:b")


def test_each_registry_resolves_its_builtins_to_the_same_objects_as_before():
    from megatron_rl.algorithms import advantages, losses
    from megatron_rl.controller import curriculum, objectives, recipe
    from megatron_rl.recipes.agent import recipe as agent_recipe
    from megatron_rl.recipes.jepo import likelihood, objective as jepo_objective
    from megatron_rl.recipes.pcl import selector
    from megatron_rl.recipes.waltz import recipe as waltz_recipe
    from megatron_rl.rewards import registry as rewards

    expected = {
        "loss": {"pg": losses.pg_loss, "ppo_clip": losses.ppo_clip_loss, "aipo": losses.aipo_loss,
                 "tis": losses.tis_loss},
        "estimator": {"grpo": advantages.grpo_estimator, "rloo": advantages.rloo_estimator,
                      "reinforce_pp": advantages.reinforce_pp_estimator},
        "objective": {"policy_gradient": objectives.PolicyGradientObjective, "jepo": jepo_objective.JepoObjective,
                      "sft": jepo_objective.SftObjective},
        "curriculum": {"none": curriculum.PromptSelector, "prefilter": curriculum.Prefilter,
                       "dynamic_sampling": curriculum.DynamicSampling, "pcl": selector.build_pcl_selector},
        "eval metric": {"likelihood": likelihood.likelihood_metric},
        "recipe": {"single_policy": recipe.build_single_policy, "waltz": waltz_recipe.build_waltz,
                   "agent": agent_recipe.build_agent},
        "reward": {"reasoning_gym": rewards.reasoning_gym_reward, "math": rewards.math_reward,
                   "exact_match": rewards.exact_match_reward, "soft_match": rewards.soft_match_reward},
        "agent environment": {"tools": agent_recipe.tool_environment_factory},
        "OpenAI agent": {},
    }
    for registry in _registries():
        builtins = expected[registry.what]
        assert set(builtins) <= set(registry), registry.what  # this module's fixture may have added names
        assert {name: registry.resolve(name) for name in builtins} == builtins, registry.what
    # The built-in estimators keep their arithmetic.
    r = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    from megatron_rl.algorithms.config import AdvantageConfig
    torch.testing.assert_close(advantages.compute_advantages(r, None, AdvantageConfig(estimator="rloo")),
                               advantages.rloo_advantages(r))
    torch.testing.assert_close(advantages.compute_advantages(r, None, AdvantageConfig()),
                               advantages.grpo_advantages(r, scale_by_std=True, eps=1e-6))


def test_validating_builtin_names_imports_no_torch():
    code = ("import sys; from megatron_rl.run_config import load_run_config; "
            f"load_run_config({QUICKSTART!r}, ['algorithm.loss.name=pg', 'algorithm.advantage.estimator=rloo', "
            "'curriculum.kind=pcl', 'eval.metrics=[accuracy,likelihood]', 'recipe=single_policy']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr


def test_an_estimator_of_the_wrong_shape_is_named(user_module):
    from megatron_rl.algorithms.advantages import compute_advantages
    from megatron_rl.algorithms.config import ADVANTAGE_ESTIMATORS, AdvantageConfig

    ADVANTAGE_ESTIMATORS.register("ext_scalar")(lambda rewards, group_ids, config: rewards.mean())
    try:
        with pytest.raises(ValueError, match="'ext_scalar' returned \\(\\), not a tensor of the rewards' shape"):
            compute_advantages(torch.ones(4), None, AdvantageConfig(estimator="ext_scalar"))
    finally:
        ADVANTAGE_ESTIMATORS.unregister("ext_scalar")


def test_a_pickled_config_imports_its_modules_in_the_new_process(user_module, tmp_path):
    """Spawned ranks get the config pickled: unpickling imports `imports` before a part is resolved."""
    import pickle

    from megatron_rl.run_config import load_run_config

    blob = tmp_path / "config.pkl"
    blob.write_bytes(pickle.dumps(load_run_config(QUICKSTART, BY_NAME)))
    code = ("import pickle, sys; config = pickle.load(open(sys.argv[1], 'rb')); "
            "from megatron_rl.algorithms.config import LOSSES; "
            "assert LOSSES.resolve(config.algorithm.loss.name).__module__ == sys.argv[2]")
    result = _subprocess(user_module, "-c", code, str(blob), MODULE)
    assert result.returncode == 0, result.stderr


def test_registry_check_raises_config_errors_naming_the_field():
    registry = Registry("widget", {"plain": "os.path:join"})
    registry.check("plain", "kind")
    registry.check("os.path:basename", "kind")
    with pytest.raises(ConfigError, match="field 'kind': unknown widget 'plan' \\(did you mean 'plain'\\?\\)"):
        registry.check("plan", "kind")
    with pytest.raises(ConfigError, match="field 'kind': widget 'os:sep': 'sep' is not callable"):
        registry.check("os:sep", "kind")
    assert registry.resolve("plain") is os.path.join
