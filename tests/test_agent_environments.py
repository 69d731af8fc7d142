"""Environments of the agent recipe from environment libraries (docs/environments.md): `verifiers` (its
own process, recipes/agent/verifiers_env.py) and OpenEnv (recipes/agent/openenv_env.py).

References: the libraries' own loops. verifiers: its evaluation loop (`Env.run_slot` with its null
harness, its MCP tool servers, its scoring) against a scripted OpenAI-compatible policy, run by
tests/verifiers_library_loop.py in the verifiers interpreter; OpenEnv: its rollout harness
(`openenv.core.harness.MCPHarnessAdapter` over a `StepEnvSessionAdapter`). Our environments replay the
same completions, written as the model writes them (hermes tool calls), and must give the same rewards,
reward terms, metrics and ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.recipes.agent.config import AgentConfig, OpenEnvConfig, VerifiersConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE_ENVS = os.path.join(REPO, "examples", "environments")
TEST_ENVS = os.path.join(REPO, "tests", "envs")
NO_TEMPLATE = types.SimpleNamespace(chat_template=None)  # hermes calls, tool instructions in the system prompt


@pytest.fixture(scope="module")
def verifiers_python():
    from megatron_rl.recipes.agent.verifiers_env import verifiers_python

    try:
        return verifiers_python()
    except ConfigError as exc:
        pytest.skip(f"no verifiers environment (bash scripts/setup_verifiers.sh): {exc}")


def _verifiers_source(env_id: str, **verifiers):
    from megatron_rl.recipes.agent.verifiers_env import verifiers_environment_factory

    config = VerifiersConfig(import_paths=[EXAMPLE_ENVS, TEST_ENVS], heldout_size=0, **verifiers)
    agent = AgentConfig(environment=f"verifiers:{env_id}", max_turns=8, verifiers=config)
    return verifiers_environment_factory(agent, NO_TEMPLATE)


def _library_loop(python: str, env_id: str, options: dict) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([EXAMPLE_ENVS, TEST_ENVS])}
    done = subprocess.run([python, os.path.join(REPO, "tests", "verifiers_library_loop.py"), env_id,
                           json.dumps(options)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _as_sampled(message: dict) -> str:
    """An assistant message as the model writes it: its content, then its tool calls in hermes format."""
    parts = [message["content"]] if message.get("content") else []
    parts += ["<tool_call>\n" + json.dumps({"name": call["function"]["name"],
                                             "arguments": json.loads(call["function"]["arguments"])})
              + "\n</tool_call>" for call in message.get("tool_calls") or []]
    return "\n".join(parts)


@pytest.mark.parametrize("env_id,options", [
    ("vf-calculator", {"taskset": {"num_examples": 9}}),  # single turn with a tool: right, wrong, without the tool
    ("vf-guess", {"seat": "player"}),                     # the environment plays the user
])
def test_verifiers_rewards_equal_the_library_evaluation_loop(verifiers_python, env_id, options):
    library = _library_loop(verifiers_python, env_id, options)
    source = _verifiers_source(env_id, taskset_args=options.get("taskset", {}))
    try:
        train, _ = source.datasets()
        prompts = {p.metadata["verifiers_key"]: p for p in train}
        assert sorted(prompts) == sorted(row["key"] for row in library)
        ends = set()
        for row in library:
            env = source()
            env.reset(prompts[row["key"]])
            steps = [env.step(_as_sampled(message)) for message in row["assistant"]]
            env.close()
            final = steps[-1]
            assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
            assert final.reward == row["reward"], row
            assert final.info["end"] == row["stop"]
            for name, (score, _weight) in row["rewards"].items():
                assert final.info[f"env/reward/{name}"] == score, (name, row)
            for name, value in row["metrics"].items():
                assert final.info[f"env/metric/{name}"] == value, (name, row)
            ends.add((row["reward"], len(row["assistant"])))
        assert len(ends) >= 3  # the script reaches distinct outcomes (right / wrong, with and without tools)
    finally:
        source.close()


def test_verifiers_episodes_are_token_exact_and_count_what_re_rendering_changes(verifiers_python, tiny_chat_model):
    """Episodes of the multi-turn environment (it answers every guess) with a tiny model: each turn's prompt
    is the previous one, the sampled ids and the template's ids of the environment's message, and decodes to
    the template's render of the conversation; the reward is the library's (efficiency at weight 0.5, plus
    1 for a lucky guess), with its terms and metrics."""
    from megatron_rl.models.pretrained import load_pretrained
    from megatron_rl.recipes.agent.episodes import AgentEpisodes, count_episode, episode_metrics, retokenization_changes
    from megatron_rl.recipes.agent.verifiers_env import verifiers_environment_factory
    from megatron_rl.rollout.engine import SamplingParams
    from megatron_rl.rollout.config import NativeEngineConfig
    from megatron_rl.rollout.native import NativeEngine

    model = load_pretrained(tiny_chat_model)
    tokenizer = model.tokenizer
    agent = AgentConfig(environment="verifiers:vf-guess", max_turns=3,
                        verifiers=VerifiersConfig(import_paths=[TEST_ENVS], heldout_size=0))
    source = verifiers_environment_factory(agent, tokenizer)
    try:
        train, _ = source.datasets()
        with NativeEngine(model.arch, model.state, tokenizer=tokenizer,
                          config=NativeEngineConfig(max_batch_size=8, max_seq_len=512)) as engine:
            producer = AgentEpisodes(engine, tokenizer, source, sampling=SamplingParams(max_new_tokens=6, temperature=1.0))
            episodes = producer.play(list(train), tag="t")
    finally:
        source.close()
    counts, changes = {}, 0
    for episode in episodes:
        count_episode(counts, episode)
        solved = episode.reward >= 1.0
        assert episode.end == ("user_closed" if solved else "max_turns")
        # the environment counts the turn the budget refused (a terminated segment), as with the library's max_turns
        efficiency = 1 / len(episode.turns) if solved else 1 / (len(episode.turns) + 1)
        assert episode.reward == pytest.approx(float(solved) + 0.5 * efficiency)
        full = episode.trajectory.prompt_ids + episode.trajectory.output_ids
        for k, turn in enumerate(episode.turns):
            assert turn.completion.prompt_ids == full[:len(turn.completion.prompt_ids)]
            if k:
                assert turn.messages[-1]["role"] == "user" and turn.messages[-1]["content"] in ("higher", "lower")
                before = episode.turns[k - 1].completion
                # the sampled text, without the stop token where the turn ended on one (a turn cut at max_new_tokens
                # may end on any token, a special one too, which the message's text drops)
                sampled_before = before.output_ids[:-1] if before.finish_reason == "stop" else before.output_ids
                if not any(tokenizer.token_text(t) and not tokenizer.decode([t]) for t in sampled_before):
                    assert tokenizer.decode(turn.completion.prompt_ids, skip_special_tokens=False) == \
                        tokenizer.render_chat(turn.messages)
        changes += retokenization_changes(tokenizer, episode)["turns"]
    metrics = episode_metrics(counts)
    assert changes == sum(len(e.turns) - 1 for e in episodes) > 0
    assert metrics["env/metric/guesses"] == pytest.approx(sum(len(e.turns) for e in episodes) / len(episodes))
    assert metrics["env/reward/efficiency"] == pytest.approx(
        sum(1 / (len(e.turns) + (e.reward < 1.0)) for e in episodes) / len(episodes))


def test_verifiers_refuses_what_the_bridge_cannot_honour(verifiers_python):
    with pytest.raises(ConfigError, match=r"@vf.stop hooks \['enough'\]"):
        _verifiers_source("vf-stopping").datasets()
    with pytest.raises(ConfigError, match="verifiers environment 'no-such-env'"):
        _verifiers_source("no-such-env").datasets()
    with pytest.raises(ConfigError, match=r"agent.verifiers.python: no Python with the verifiers package"):
        from megatron_rl.recipes.agent.verifiers_env import verifiers_python as find

        find(sys.executable if not _imports_verifiers() else "/nonexistent/python")


def _imports_verifiers() -> bool:
    import importlib.util

    return importlib.util.find_spec("verifiers") is not None


def test_library_environment_names_are_checked_in_the_config():
    assert AgentConfig(environment="verifiers:vf-calculator").environment == "verifiers:vf-calculator"
    with pytest.raises(ConfigError, match="name the openenv environment"):
        AgentConfig(environment="openenv:")
    with pytest.raises(ConfigError, match="agent.openai_agent|openai_agent"):
        AgentConfig(environment="verifiers:x", openai_agent="megatron_rl.recipes.agent.calculator_agent:calculator_agent")


# --- OpenEnv ---------------------------------------------------------------------------------------------
def _openenv_source(transport: str = "in_process", target: str = "openenv_arithmetic:ArithmeticEnvironment", **openenv):
    from megatron_rl.recipes.agent.openenv_env import openenv_environment_factory

    config = OpenEnvConfig(transport=transport, import_paths=[EXAMPLE_ENVS], train_size=6, heldout_size=0, **openenv)
    agent = AgentConfig(environment=f"openenv:{target}", max_turns=4, openenv=config)
    return openenv_environment_factory(agent, None)


def _scripted_replies(question: str, seed: int) -> list[str]:
    import re

    answer = sum(int(n) for n in re.findall(r"\d+", question.split(":")[-1]))
    return [[f"The answer is {answer}."], ["I think 1000.", f"It is {answer}"], ["no idea", "still none"]][seed % 3]


def _harness_rewards(client, seed: int, replies: list[str], typed_actions: bool) -> tuple[float, list[float]]:
    """OpenEnv's own rollout harness over `client` (reset / step): its episode reward
    (`_resolve_env_reward`) and its per-step rewards, the replies sent as calls of one `reply` tool."""
    from openenv.core.env_server.mcp_types import Tool
    from openenv.core.harness import (
        HarnessRunLimits,
        MCPHarnessAdapter,
        ModelStepResult,
        StepEnvSessionAdapter,
        ToolResult,
        _resolve_env_reward,
    )
    from openenv.core.llm_client import LLMResponse, ToolCall
    from openenv_arithmetic import ArithmeticAction

    tool = Tool(name="reply", description="Reply", input_schema={"type": "object", "properties": {
        "reply": {"type": "string"}}, "required": ["reply"]})
    session = StepEnvSessionAdapter(
        client, seed=seed, tool_specs=[tool],
        action_builder=lambda name, args: ArithmeticAction(**args) if typed_actions else dict(args),
        initial_messages_builder=lambda result, task: [{"role": "user", "content": str(result.observation)}],
        tool_result_builder=lambda name, args, result, state: ToolResult(
            data="", done=result.done, metadata={"reward": result.reward}))
    texts = iter(replies)

    def model_step(messages, tools, sampling):
        text = next(texts, None)
        calls = [] if text is None else [ToolCall(id=f"c{len(messages)}", name="reply", args={"reply": text})]
        return ModelStepResult(response=LLMResponse(content=text or "", tool_calls=calls))

    rollout = MCPHarnessAdapter().run_white_box(model_step, session, HarnessRunLimits(max_turns=8))
    reward = _resolve_env_reward(rollout, session.verify(rollout.messages))
    return reward, [entry.result.metadata["reward"] for entry in rollout.tool_trace]


class InProcessClient:
    """An in-process OpenEnv Environment behind the client interface the harness drives."""

    def __init__(self, env):
        self.env = env

    def _result(self, observation):
        from openenv.core.client_types import StepResult

        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def reset(self, **kwargs):
        return self._result(self.env.reset(**kwargs))

    def step(self, action):
        return self._result(self.env.step(action))

    def state(self):
        return self.env.state


@pytest.mark.parametrize("transport", ["in_process", "server"])
def test_openenv_rewards_equal_openenv_rollout_harness(transport):
    source = _openenv_source(transport)
    try:
        train, _ = source.datasets()
        outcomes = set()
        for prompt in train:
            seed = prompt.metadata["openenv_seed"]
            env = source()
            messages = env.reset(prompt)
            replies = _scripted_replies(messages[-1]["content"], seed)
            steps = [env.step(text) for text in replies]
            env.close()
            assert [s.done for s in steps] == [False] * (len(steps) - 1) + [True]
            assert steps[0].messages == [] or steps[0].messages[0]["content"].startswith("That is not right")
            if transport == "server":
                from openenv import GenericEnvClient

                with GenericEnvClient(base_url=source.server.url).sync() as client:
                    reference, per_step = _harness_rewards(client, seed, replies, typed_actions=False)
            else:
                reference, per_step = _harness_rewards(InProcessClient(source.env_cls()), seed, replies, True)
            assert steps[-1].reward == reference
            assert steps[-1].info["env/reward/sum"] == sum(per_step)
            assert steps[-1].info["env/steps"] == len(per_step)
            outcomes.add(reference)
        assert outcomes == {0.0, 0.5, 1.0}
    finally:
        source.close()
    if transport == "server":
        assert source.server.proc.poll() is not None  # the server went with the source


def test_openenv_observations_actions_and_refusals():
    from megatron_rl.recipes.agent.openenv_env import observation_text

    assert observation_text({"prompt": "2 + 2 =", "done": False, "reward": 0.0, "metadata": {}}, "") == "2 + 2 ="
    assert observation_text({"a": "x", "b": 2, "done": False}, "") == '{"a": "x", "b": 2}'
    assert observation_text({"a": "x", "b": "y"}, "b") == "y"
    with pytest.raises(ConfigError, match=r"agent.openenv.action_field: ArithmeticAction has no field 'text'"):
        _openenv_source(action_field="text")
    with pytest.raises(ConfigError, match="agent.openenv.action_field: name the Action's text field"):
        _openenv_source(target="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        _openenv_source(target="no_such_module:Env")
    with pytest.raises(ConfigError, match="does not declare its Action and Observation types"):
        _openenv_source(target="tests.test_agent_environments:UntypedEnvironment")


class UntypedEnvironment:
    """Not an OpenEnv Environment subclass (refused: no Action / Observation types)."""


def _train_two_steps(recipe: str, run_dir: str, model_path: str, *overrides: str) -> tuple[list[dict], list[dict]]:
    """Two steps of 2 x 2 episodes of an example recipe on the tiny model: (every metrics row, the trained
    steps' rows)."""
    from megatron_rl.controller.loop import train
    from megatron_rl.run_config import load_run_config

    config = load_run_config(os.path.join(REPO, "examples", "configs", recipe), [
        f"model.path={model_path}", f"run_dir={run_dir}", "steps=2", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6", "trainer.micro_batch_size=2",
        "engine.max_batch_size=8", "engine.num_threads=1", "eval.max_new_tokens=6", "logging.wandb=disabled",
        "logging.plots=false", "rollout.drop_uninformative_groups=false", *overrides])
    assert train(config).steps == 2
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    trained = [m for m in metrics if "agent/episodes" in m]
    assert len(trained) == 2 and all(m["agent/episodes"] == 4 for m in trained)
    return metrics, trained


def test_openenv_trains_through_the_agent_recipe_with_its_server(tmp_path, tiny_chat_model):
    _, trained = _train_two_steps("agent_openenv.yaml", str(tmp_path / "run"), tiny_chat_model,
                                  "agent.openenv.transport=server", "agent.openenv.train_size=8",
                                  "agent.openenv.heldout_size=2")
    assert all("agent/env/reward/last_step" in m and m["agent/turns_per_episode"] >= 1 for m in trained)
    assert not _children_running("openenv_server")  # the run's OpenEnv server went with it


def _children_running(name: str) -> list[int]:
    """This process's children whose command line mentions `name`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and name in command:
            found.append(int(pid))
    return found


def test_verifiers_trains_through_the_agent_recipe(verifiers_python, tmp_path, tiny_chat_model):
    run_dir = str(tmp_path / "run")
    metrics, trained = _train_two_steps("agent_verifiers.yaml", run_dir, tiny_chat_model,
                                        "agent.verifiers.taskset_args={num_examples: 12}",
                                        "agent.verifiers.heldout_size=2")
    assert all("agent/env/reward/correct" in m and "agent/env/metric/turns" in m for m in trained)
    assert any("eval/env/reward/correct" in m for m in metrics)
    episodes = [json.loads(line) for line in open(os.path.join(run_dir, "agent_episodes.jsonl"))]
    assert len(episodes) == 8 and all(e["end"] in ("agent_completed", "max_turns") for e in episodes)
    assert not _children_running("verifiers_worker")  # the run's verifiers process went with it


def test_verifiers_episodes_run_asynchronously_on_environment_threads(verifiers_python, tmp_path, tiny_chat_model):
    """Generation one step ahead of training (staleness 1), the environment's steps on 4 threads: the
    verifiers process answers concurrent episodes."""
    _, trained = _train_two_steps("agent_verifiers.yaml", str(tmp_path / "run"), tiny_chat_model,
                                  "agent.verifiers.taskset_args={num_examples: 12}", "agent.verifiers.heldout_size=2",
                                  "rollout.max_staleness=1", "agent.environment_threads=4")
    assert [m["rollout/staleness_max"] for m in trained] == [0.0, 1.0]
