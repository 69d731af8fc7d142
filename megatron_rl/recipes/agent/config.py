"""The agent recipe's configuration (`agent:`), importable without torch: the task, the tools, the
episode protocol."""
from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_rl.config import RECIPE_PATH_FIELD, Registry, require
from megatron_rl.recipes.agent.sandbox import SandboxConfig

TOOLS = ("calculator", "python")

# `agent.environment`: fn(agent config, tokenizer) -> a factory of fresh `Environment`s.
ENVIRONMENTS = Registry("agent environment", {"tools": "megatron_rl.recipes.agent.recipe:tool_environment_factory"})
# `agent.environment: <library>:<target>`: an environment library's own environments (docs/environments.md).
LIBRARY_ENVIRONMENTS = {"verifiers": "megatron_rl.recipes.agent.verifiers_env:verifiers_environment_factory",
                        "openenv": "megatron_rl.recipes.agent.openenv_env:openenv_environment_factory"}


def library_environment(spec: str) -> tuple[str, str] | None:
    """(library, target) of `verifiers:<env>` / `openenv:<env>`, else None (a registered name or a
    'package.module:function' factory)."""
    library, sep, target = spec.partition(":")
    return (library, target) if sep and library in LIBRARY_ENVIRONMENTS else None
# `agent.openai_agent`: fn(agent config, tokenizer) -> agent(client, model, prompt); none built in.
OPENAI_AGENTS = Registry("OpenAI agent")


@dataclasses.dataclass(kw_only=True)
class CalculatorTaskConfig:
    """Arithmetic a small model gets wrong alone and right with a calculator, generated from a seed."""

    kind: Literal["multiply", "chain_sum", "reasoning_gym"] = "multiply"
    """multiply: a x b with `digits` digits each; chain_sum: the sum of `terms` numbers of `digits` digits;
    reasoning_gym: the arithmetic generator `reasoning_gym_task` of reasoning-gym (its questions, its
    answers; problems with a non-integer answer are skipped)."""
    reasoning_gym_task: str = "products"
    """reasoning_gym: an arithmetic task whose entries carry their expression (products, chain_sum,
    basic_arithmetic)."""
    task_config: dict = dataclasses.field(default_factory=dict)
    """reasoning_gym: the generator's own options, e.g. {min_digits: 3, max_digits: 4} for products."""
    digits: list[int] = dataclasses.field(default_factory=lambda: [4, 3])
    """multiply: the digits of each factor; chain_sum: [digits of every term]."""
    terms: int = 6
    """chain_sum: numbers to add."""
    train_size: int = 256
    """Training problems."""
    heldout_size: int = 32
    """Held-out problems (disjoint from the training ones)."""
    seed: int = 2024
    """Seed of the problems."""
    instruction: str = "Use the calculator tool, then give the final answer as a number."
    """Appended to every question."""

    def __post_init__(self) -> None:
        require(self.kind != "reasoning_gym" or bool(self.reasoning_gym_task), "reasoning_gym_task",
                "name a reasoning-gym task")
        require(self.kind != "multiply" or len(self.digits) == 2, "digits", "multiply needs two digit counts")
        require(self.kind != "chain_sum" or len(self.digits) == 1, "digits", "chain_sum needs one digit count")
        require(all(1 <= d <= 30 for d in self.digits), "digits", "each digit count must be in [1, 30]")
        require(self.terms >= 2, "terms", "must be >= 2")
        require(self.train_size >= 1, "train_size", "must be >= 1")
        require(self.heldout_size >= 0, "heldout_size", "must be >= 0")


@dataclasses.dataclass(kw_only=True)
class VerifiersConfig:
    """`agent.environment: verifiers:<env id or module>`: a `verifiers` (0.4, `verifiers.v1`) environment,
    its taskset's rows as the prompts, its tools as the policy's, its rubric as the reward
    (recipes/agent/verifiers_env.py)."""

    python: str = ""
    """The interpreter that imports verifiers (its pins, openai<3 and mcp==2.0.0, may clash with the
    trainer's environment): '' takes $MEGATRON_RL_VERIFIERS_PYTHON, else this interpreter when it has
    verifiers, else .venv-verifiers/bin/python (`bash scripts/setup_verifiers.sh`)."""
    import_paths: list[str] = dataclasses.field(default_factory=list, metadata={RECIPE_PATH_FIELD: True})
    """Folders put first on the worker's module path, for an environment module that is not installed
    (relative to the config file)."""
    taskset_args: dict = dataclasses.field(default_factory=dict)
    """The taskset config's fields besides its id (e.g. {num_examples: 500})."""
    env_args: dict = dataclasses.field(default_factory=dict)
    """The environment config's other fields (e.g. a seat's settings)."""
    heldout_size: int = 32
    """Rows set aside for the held-out evaluation (after a seeded shuffle)."""
    train_size: int = 0
    """Training rows (0: all the others)."""
    seed: int = 2024
    """Shuffles the rows before the split."""
    call_timeout_s: float = 300.0
    """Longest wait for one answer of the environment (a tool call, the scoring)."""

    def __post_init__(self) -> None:
        require(self.heldout_size >= 0, "heldout_size", "must be >= 0")
        require(self.train_size >= 0, "train_size", "must be >= 0")
        require(self.call_timeout_s > 0, "call_timeout_s", "must be > 0")


@dataclasses.dataclass(kw_only=True)
class OpenEnvConfig:
    """`agent.environment: openenv:<package.module:EnvironmentClass | http://host:port>`: an OpenEnv
    environment, reset with one seed per prompt, its observations rendered as user messages, the
    policy's text as its action (recipes/agent/openenv_env.py)."""

    transport: Literal["in_process", "server"] = "in_process"
    """in_process: the Environment class runs in the driver; server: the run starts OpenEnv's own
    FastAPI server for it (uvicorn on loopback) and plays over its WebSocket client. A URL target is
    always a server someone else started."""
    env_args: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments of the Environment class."""
    import_paths: list[str] = dataclasses.field(default_factory=list, metadata={RECIPE_PATH_FIELD: True})
    """Folders put first on the module path (this process's and the server's), for an environment module
    that is not installed (relative to the config file)."""
    action_field: str = ""
    """The Action field that takes the policy's text ('': the Action's one string field; required for
    a URL target)."""
    observation_field: str = ""
    """The Observation field rendered as the user message ('': its only field besides done, reward and
    metadata when that is a string; else those fields as JSON)."""
    system_prompt: str = ""
    """A system message before the first observation ('' : none)."""
    reward: Literal["last", "sum"] = "last"
    """The episode's reward: the last step's (as OpenEnv's rollout harness scores), or the sum of all."""
    python: str = ""
    """server: the interpreter that runs the server ('': this one)."""
    startup_timeout_s: float = 60.0
    """server: longest wait for the server's health check."""
    train_size: int = 256
    """Training episodes (reset seeds seed+heldout_size ...)."""
    heldout_size: int = 32
    """Held-out episodes (reset seeds seed ... seed+heldout_size-1)."""
    seed: int = 2024
    """First reset seed."""

    def __post_init__(self) -> None:
        require(self.train_size >= 1, "train_size", "must be >= 1")
        require(self.heldout_size >= 0, "heldout_size", "must be >= 0")
        require(self.startup_timeout_s > 0, "startup_timeout_s", "must be > 0")


@dataclasses.dataclass(kw_only=True)
class AgentConfig:
    """A multi-turn tool-using agent run (recipes/agent/): every episode alternates the policy and its
    tools until a final answer or `max_turns`; one token-exact trajectory per episode."""

    task: CalculatorTaskConfig = dataclasses.field(default_factory=CalculatorTaskConfig)
    """The problems and their grading (replaces the `data` section)."""
    environment: str = "tools"
    """tools: the task with the tools below (ToolEnvironment); `verifiers:<env id or module>` or
    `openenv:<package.module:EnvironmentClass or URL>`: an environment of those libraries, with its own
    prompts and reward (the `verifiers` / `openenv` sections; docs/environments.md); or a custom
    environment: a name registered with `ENVIRONMENTS.register` or 'package.module:function', called with
    (this config, the tokenizer), returning a factory of fresh `Environment`s (docs/extending.md)."""
    openai_agent: str = ""
    """'package.module:function' (or a name registered with `OPENAI_AGENTS.register`): train an agent
    written against the OpenAI API instead of running `environment`
    here. The function is called with (this config, the tokenizer) and returns agent(client, model,
    prompt) -> its reward, or its final answer (graded by the task); the recipe serves the policy's engine
    on a loopback port and the agent's official `openai` client reaches it token-exact (openai_agent.py).
    Example: megatron_rl.recipes.agent.calculator_agent:calculator_agent."""
    openai_concurrency: int = 64
    """Agent episodes run at once (threads) when `openai_agent` is set."""
    tools: list[str] = dataclasses.field(default_factory=lambda: ["calculator"])
    """Tools offered: calculator (safe arithmetic), python (runs code in the sandbox)."""
    tool_call_format: Literal["auto", "hermes", "llama3_json", "mistral"] = "auto"
    """How tool calls are written: auto picks from the chat template's own text (hermes when it has none)."""
    few_shot: int = 1
    """Worked examples (a problem solved with the calculator) shown as earlier chat turns (calculator only)."""
    max_turns: int = 3
    """Assistant messages per episode (the last one must be the answer)."""
    tool_wall_time_s: float = 5.0
    """Sandbox wall-time limit of one tool call."""
    tool_memory_mb: int = 512
    """Sandbox memory limit of one tool call (all of its processes together where cgroups can be made)."""
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    """How tool calls are contained: layers required, host paths readable, process and CPU limits per call
    (docs/agents.md#the-sandbox-what-contains-a-tool-and-what-does-not)."""
    environment_threads: int = 8
    """Asynchronous runs (rollout.max_staleness > 0): threads that run environment steps (tool calls) off
    the engine's thread. Synchronous runs step environments in the engine's thread (batches independent of
    timing: a resumed run is bit-exact)."""
    record_episodes: bool = True
    """Append every training episode, turn by turn, to RUN_DIR/agent_episodes.jsonl."""
    verifiers: VerifiersConfig = dataclasses.field(default_factory=VerifiersConfig)
    """`environment: verifiers:<env>`: where verifiers runs and how its rows split."""
    openenv: OpenEnvConfig = dataclasses.field(default_factory=OpenEnvConfig)
    """`environment: openenv:<env>`: how the environment runs, what its actions and observations are."""

    def __post_init__(self) -> None:
        require(self.max_turns >= 1, "max_turns", "must be >= 1")
        library = library_environment(self.environment)
        if library is None:
            ENVIRONMENTS.check(self.environment, "environment")
        else:
            require(bool(library[1].strip()), "environment", f"name the {library[0]} environment after '{library[0]}:'")
            require(not self.openai_agent, "openai_agent", f"an OpenAI agent replaces the environment; "
                    f"'{self.environment}' would be ignored")
        if self.openai_agent:
            OPENAI_AGENTS.check(self.openai_agent, "openai_agent")
        require(self.openai_concurrency >= 1, "openai_concurrency", "must be >= 1")
        for name in self.tools:
            require(name in TOOLS, "tools", f"unknown tool {name!r}; known: {', '.join(TOOLS)}")
        require(self.few_shot >= 0, "few_shot", "must be >= 0")
        require(not self.few_shot or "calculator" in self.tools, "few_shot", "the worked examples use the calculator")
        require(self.tool_wall_time_s > 0, "tool_wall_time_s", "must be > 0")
        require(self.tool_memory_mb >= 64, "tool_memory_mb", "must be >= 64")
        require(self.environment_threads >= 1, "environment_threads", "must be >= 1")
