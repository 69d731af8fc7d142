"""The agent recipe: one policy trained on multi-turn, tool-using episodes (episodes.py) of a seeded
calculator task (tasks.py), with held-out accuracy and tool-call metrics."""
from __future__ import annotations

import os

from megatron_rl import ranks
from megatron_rl.controller.evaluate import HeldoutEvaluation
from megatron_rl.controller.recipe import RunParts, build_policy
from megatron_rl.config import import_object
from megatron_rl.recipes.agent.config import (
    ENVIRONMENTS,
    LIBRARY_ENVIRONMENTS,
    OPENAI_AGENTS,
    AgentConfig,
    library_environment,
)
from megatron_rl.recipes.agent.environment import ToolEnvironment
from megatron_rl.recipes.agent.episodes import (
    AgentEpisodes,
    count_episode,
    episode_metrics,
)
from megatron_rl.recipes.agent.sandbox import SandboxLimits, check_containment
from megatron_rl.recipes.agent.tasks import (
    build_calculator_datasets,
    grade_final_answer,
    worked_examples,
)
from megatron_rl.data.tool_calls import tool_call_format, tool_call_format_for
from megatron_rl.recipes.agent.tools import Calculator, PythonTool
from megatron_rl.rollout.engine import SamplingParams

TOOL_CLASSES = {"calculator": Calculator, "python": PythonTool}


def environment_factory(agent: AgentConfig, tokenizer):
    """() -> a fresh environment for one episode: the configured task and tools, an environment
    library's (`verifiers:` / `openenv:`), or the custom environment `agent.environment` names. A
    factory with a `datasets()` method brings its own (train, held-out) prompts."""
    library = library_environment(agent.environment)
    if library is not None:
        return import_object(LIBRARY_ENVIRONMENTS[library[0]], "agent environment")(agent, tokenizer)
    return ENVIRONMENTS.resolve(agent.environment)(agent, tokenizer)


def agent_datasets(agent: AgentConfig, tokenizer=None):
    """(train, held-out) prompts of an agent run without its model (`train --check`): the environment
    library's own, or the calculator task's; the library's process or server is closed again."""
    if library_environment(agent.environment) is None:
        return build_calculator_datasets(agent.task)
    source = environment_factory(agent, tokenizer)
    try:
        return environment_prompts(agent, source)
    finally:
        source.close()


def environment_prompts(agent: AgentConfig, make_environment):
    """(train, held-out): the environment's own (its factory's `datasets()`), else the calculator task's."""
    own = getattr(make_environment, "datasets", None)
    return own() if own is not None else build_calculator_datasets(agent.task)


def tool_environment_factory(agent: AgentConfig, tokenizer):
    """`agent.environment: tools`: the configured task with the configured tools."""
    tools = [TOOL_CLASSES[name]() for name in agent.tools]
    template = tokenizer.chat_template
    if agent.tool_call_format == "auto":
        fmt = tool_call_format_for(template if isinstance(template, str) else None)
    else:
        fmt = tool_call_format(agent.tool_call_format)
    check_containment(agent.sandbox)  # refuses a required layer this machine lacks; reports the others once
    limits = SandboxLimits(wall_time_s=agent.tool_wall_time_s, memory_mb=agent.tool_memory_mb,
                           processes=agent.sandbox.processes, cpus=agent.sandbox.cpus,
                           read_only=tuple(agent.sandbox.read_only), backend=agent.sandbox.backend)
    examples = worked_examples(agent.task, agent.few_shot)

    def make() -> ToolEnvironment:
        return ToolEnvironment(tools, fmt, grade_final_answer, max_turns=agent.max_turns, limits=limits,
                               chat_template=template, examples=examples)
    return make


def context_length(config, model) -> int:
    """The engine's context: engine.max_seq_len capped by the model's positions (0: the model's)."""
    limit = model.arch.max_position_embeddings
    return min(config.engine.max_seq_len or limit, limit)


def build_agent(config, model) -> RunParts:
    """The run's parts: the policy, the calculator task, the multi-turn episode producer and the
    held-out evaluation (greedy episodes: accuracy, tool-call rates)."""
    policy, selector = build_policy(config, model)
    agent: AgentConfig = config.agent
    driver = ranks.is_driver()
    if agent.openai_agent:
        train, heldout = build_calculator_datasets(agent.task)
        return _openai_agent_parts(config, model, policy, selector, train, heldout)
    make_environment = environment_factory(agent, model.tokenizer)
    # trainer ranks receive scored groups from the driver
    train, heldout = environment_prompts(agent, make_environment) if driver else ([], [])
    context = context_length(config, model)
    episodes = None
    if driver:
        record = os.path.join(config.run_dir, "agent_episodes.jsonl") if agent.record_episodes else None
        episodes = AgentEpisodes(policy.engine, model.tokenizer, make_environment,
                                 sampling=SamplingParams.for_rollouts(config.rollout, None),
                                 samples_per_prompt=config.rollout.samples_per_prompt, record_path=record,
                                 max_seq_len=context,
                                 environment_threads=agent.environment_threads if config.rollout.is_async else 0)

    def measure(step: int) -> dict[str, float]:
        if not driver:
            return {}
        greedy = SamplingParams(max_new_tokens=config.eval.max_new_tokens, temperature=0.0,
                                stop=list(config.rollout.stop) or None)
        evaluator = AgentEpisodes(policy.engine, model.tokenizer, make_environment, sampling=greedy,
                                  max_seq_len=context)
        return heldout_metrics(evaluator.play(list(heldout), tag=f"eval{step}"), count_episode, episode_metrics)

    return RunParts(model.tokenizer, [policy], train, heldout, episodes, selector,
                    HeldoutEvaluation(config.eval, measure))


def _openai_agent_parts(config, model, policy, selector, train, heldout) -> RunParts:
    """The run's parts for an agent written against the OpenAI API (`agent.openai_agent`): its episodes
    run through a server over the policy's engine; the held-out evaluation runs it greedily."""
    from megatron_rl.recipes.agent.openai_agent import OpenAIAgentEpisodes, count_openai_run, openai_run_metrics

    agent: AgentConfig = config.agent
    episodes = None
    if ranks.is_driver():
        make_agent = OPENAI_AGENTS.resolve(agent.openai_agent)
        rollout = config.rollout
        record = os.path.join(config.run_dir, "agent_episodes.jsonl") if agent.record_episodes else None
        episodes = OpenAIAgentEpisodes(policy.engine, model.tokenizer, make_agent(agent, model.tokenizer),
                                       grade=grade_final_answer, temperature=rollout.temperature, top_p=rollout.top_p,
                                       top_k=rollout.top_k, stop=list(rollout.stop) or None,
                                       max_tokens=rollout.max_new_tokens, samples_per_prompt=rollout.samples_per_prompt,
                                       concurrency=agent.openai_concurrency, record_path=record)
    else:
        train, heldout = [], []

    def measure(step: int) -> dict[str, float]:
        if episodes is None:
            return {}
        runs = episodes.play(list(heldout), tag=f"eval{step}",
                             forced={"temperature": 0.0, "max_tokens": config.eval.max_new_tokens})
        return heldout_metrics(runs, count_openai_run, openai_run_metrics)

    return RunParts(model.tokenizer, [policy], train, heldout, episodes, selector,
                    HeldoutEvaluation(config.eval, measure))


def heldout_metrics(episodes, count, summarize) -> dict[str, float]:
    """The held-out evaluation's metrics of `episodes`: each counted by `count(counts, episode)`, the
    counts turned into rates by `summarize`, plus the evaluation's own fields."""
    counts: dict[str, float] = {}
    for episode in episodes:
        count(counts, episode)
    return {**summarize(counts), "reward_errors": 0.0, "samples": counts.get("episodes", 0.0)}
