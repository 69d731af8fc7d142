"""The loop's configuration, importable without torch: the curriculum hook (`curriculum:`) and the
registries of the loop's extension points: training objectives (`algorithm.objective`), curricula
(`curriculum.kind`), held-out metrics (`eval.metrics`) and recipes (`recipe`); docs/extending.md."""
from __future__ import annotations

import dataclasses

from megatron_rl.config import Registry, require
from megatron_rl.trainer.config import ValueModelConfig

# Each built-in is imported when a run builds it, so that validating a config imports no algorithm (and
# no torch).

# Objectives (controller/objectives.py): classes built as Class(config, tokenizer, model, policy=None).
OBJECTIVES = Registry("objective", {
    "policy_gradient": "megatron_rl.controller.objectives:PolicyGradientObjective",
    "ppo": "megatron_rl.controller.objectives:ActorCriticObjective",
    "distill": "megatron_rl.controller.objectives:DistillationObjective",
    "jepo": "megatron_rl.recipes.jepo.objective:JepoObjective",
    "sft": "megatron_rl.recipes.jepo.objective:SftObjective",
})

# Curricula (controller/curriculum.py build_selector). none, prefilter and dynamic_sampling are the
# curriculum module's own classes; any other is a function (config, *, tokenizer, policy_arch,
# policy_state, pg_collection) -> PromptSelector, as PCL's is.
SELECTORS = Registry("curriculum", {
    "none": "megatron_rl.controller.curriculum:PromptSelector",
    "prefilter": "megatron_rl.controller.curriculum:Prefilter",
    "dynamic_sampling": "megatron_rl.controller.curriculum:DynamicSampling",
    "pcl": "megatron_rl.recipes.pcl.selector:build_pcl_selector",
})

# Held-out metrics beyond greedy accuracy (controller/evaluate.py heldout_metrics):
# fn(engine, policy, tokenizer, prompts, run_config) -> {name: value}.
EVAL_METRICS = Registry("eval metric", {"likelihood": "megatron_rl.recipes.jepo.likelihood:likelihood_metric"})

# Recipes (controller/recipe.py): fn(config, model) -> RunParts.
BUILTIN_RECIPES = ("single_policy", "waltz", "agent")
RECIPES = Registry("recipe", {
    "single_policy": "megatron_rl.controller.recipe:build_single_policy",
    "waltz": "megatron_rl.recipes.waltz.recipe:build_waltz",
    "agent": "megatron_rl.recipes.agent.recipe:build_agent",
})


@dataclasses.dataclass(kw_only=True)
class CurriculumConfig:
    """Which prompts each step generates: all (none), a pre-filtered subset, dynamic sampling, or PCL."""

    kind: str = "none"
    """none: plain stream order; prefilter: mixed-reward prompts of one initial rollout; dynamic_sampling:
    roll out k*m, keep mixed-reward groups (DAPO); pcl: value-model selection (PCL); or a user selector
    registered with `SELECTORS.register` or 'package.module:function' (docs/extending.md)."""
    candidates_factor: int = 4
    """k: candidates drawn per selected prompt (dynamic_sampling and pcl draw k*m prompts a step)."""
    target: float = 0.5
    """tau: pcl keeps the m candidates whose predicted reward V(x) is closest to it."""
    prefilter_pool: int = 256
    """prefilter: prompts rolled out once (n samples each) with the initial policy before training."""
    value: ValueModelConfig = dataclasses.field(default_factory=ValueModelConfig)
    """pcl: the value model."""

    def __post_init__(self) -> None:
        SELECTORS.check(self.kind, "kind")
        require(self.candidates_factor >= 1, "candidates_factor", "must be >= 1")
        require(self.prefilter_pool >= 1, "prefilter_pool", "must be >= 1")


