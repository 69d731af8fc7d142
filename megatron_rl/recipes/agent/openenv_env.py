"""`agent.environment: openenv:<package.module:EnvironmentClass | http://host:port>`: an OpenEnv
environment (Meta-PyTorch's `openenv` 0.10) as the agent recipe's environment.

Each prompt is one reset seed; an episode is

    observation = env.reset(seed)                       # rendered as the first user message
    repeat: action = Action(<action_field>=policy text)  # the sampled assistant message, verbatim
            observation, reward, done = env.step(action) # rendered as the next user message

until the environment says done or `agent.max_turns` assistant messages are spent. The episode's
reward is the last step's, as OpenEnv's own rollout harness (`openenv.core.harness`) resolves it, or
with `agent.openenv.reward: sum` the sum of the steps'. The environment runs in the driver's process
(`transport: in_process`), behind OpenEnv's own FastAPI server that the run starts on loopback
(`transport: server`, openenv_server.py), or behind a server someone else runs (a URL target); the two
server forms play over OpenEnv's WebSocket client. The trajectory stays token-exact (episodes.py): the
observations are new messages, never a re-rendered conversation.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import typing
from typing import Any

import httpx

from megatron_rl.config import ConfigError, import_object
from megatron_rl.data.prompts import Prompt, PromptDataset, stable_id
from megatron_rl.recipes.agent.config import AgentConfig, OpenEnvConfig, library_environment
from megatron_rl.recipes.agent.environment import EnvStep

logger = logging.getLogger(__name__)

_OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")


def _refuse(message: str, field: str = "agent.environment") -> ConfigError:
    return ConfigError(f"{field}: {message}", field=field)


def environment_types(env_cls: type) -> tuple[type, type]:
    """(Action class, Observation class) an OpenEnv `Environment[ActT, ObsT, StateT]` subclass declares."""
    from openenv.core.env_server.interfaces import Environment  # optional library: imported when used

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is Environment:
                action, observation = typing.get_args(base)[:2]
                if isinstance(action, type) and isinstance(observation, type):
                    return action, observation
    raise _refuse(f"{env_cls.__name__} does not declare its Action and Observation types "
                  "(subclass Environment[MyAction, MyObservation, MyState])")


def text_field(model: type, field: str, what: str, config_field: str) -> str:
    """The field of a pydantic Action that carries text: `field`, else the model's one string field."""
    fields = {name: info for name, info in model.model_fields.items() if name != "metadata"}
    if field:
        if field not in fields:
            raise _refuse(f"{model.__name__} has no field {field!r} (fields: {', '.join(fields)})", config_field)
        return field
    strings = [name for name, info in fields.items() if info.annotation is str]
    if len(strings) != 1:
        raise _refuse(f"{model.__name__} has {len(strings)} string fields ({', '.join(strings) or 'none'}): name the "
                      f"{what} field", config_field)
    return strings[0]


def observation_text(fields: dict[str, Any], field: str) -> str:
    """An observation as the user message's text: `field`; else its only field besides done, reward and
    metadata when that is a string; else those fields as JSON."""
    shown = {k: v for k, v in fields.items() if k not in _OBSERVATION_BASE_FIELDS}
    if field:
        value = shown.get(field, "")
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    only = list(shown.values())
    return only[0] if len(only) == 1 and isinstance(only[0], str) else json.dumps(shown, sort_keys=True)


class InProcessSession:
    """The Environment object itself, in this process."""

    def __init__(self, env_cls: type, env_args: dict, action_cls: type, action_field: str):
        self.env = env_cls(**env_args)
        self.action_cls, self.action_field = action_cls, action_field

    def reset(self, seed: int) -> tuple[dict, float | None, bool]:
        observation = self.env.reset(seed=seed)
        return observation.model_dump(), observation.reward, bool(observation.done)

    def step(self, text: str) -> tuple[dict, float | None, bool]:
        observation = self.env.step(self.action_cls(**{self.action_field: text}))
        return observation.model_dump(), observation.reward, bool(observation.done)

    def close(self) -> None:
        self.env.close()


class ClientSession:
    """One WebSocket session of OpenEnv's client with a server (one environment instance there)."""

    def __init__(self, url: str, action_field: str):
        from openenv import GenericEnvClient  # optional library: imported when used

        self.client = GenericEnvClient(base_url=url).sync()
        self.client.connect()
        self.action_field = action_field

    @staticmethod
    def _unpack(result) -> tuple[dict, float | None, bool]:
        observation = dict(result.observation or {})
        return observation, result.reward, bool(result.done)

    def reset(self, seed: int) -> tuple[dict, float | None, bool]:
        return self._unpack(self.client.reset(seed=seed))

    def step(self, text: str) -> tuple[dict, float | None, bool]:
        return self._unpack(self.client.step({self.action_field: text}))

    def close(self) -> None:
        self.client.close()


class OpenEnvEnvironment:
    """One episode (the `Environment` protocol, environment.py)."""

    tools: list = []

    def __init__(self, session, config: OpenEnvConfig, max_turns: int):
        self.session, self.config, self.max_turns = session, config, max_turns
        self.rewards: list[float] = []
        self.turns = 0

    def _user(self, fields: dict) -> dict[str, str]:
        return {"role": "user", "content": observation_text(fields, self.config.observation_field)}

    def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        self.rewards, self.turns = [], 0
        fields, _, _ = self.session.reset(int(prompt.metadata["openenv_seed"]))
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return system + [self._user(fields)]

    def step(self, assistant_text: str) -> EnvStep:
        self.turns += 1
        fields, reward, done = self.session.step(assistant_text)
        self.rewards.append(float(reward or 0.0))
        if done or self.turns >= self.max_turns:
            total = sum(self.rewards) if self.config.reward == "sum" else self.rewards[-1]
            info = {"end": "done" if done else "max_turns", "env/steps": float(len(self.rewards)),
                    "env/reward/last_step": self.rewards[-1], "env/reward/sum": sum(self.rewards)}
            return EnvStep([], total, True, info)
        return EnvStep([self._user(fields)], None, False, {})

    def close(self) -> None:
        self.session.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenEnvServer:
    """OpenEnv's FastAPI server for an Environment class, started by the run on loopback
    (openenv_server.py); it exits with the run (it watches its stdin)."""

    def __init__(self, target: str, config: OpenEnvConfig, max_sessions: int):
        python = config.python or sys.executable
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [python, "-m", "megatron_rl.recipes.agent.openenv_server", target, "--port", str(self.port),
                   "--env-args", json.dumps(config.env_args), "--max-sessions", str(max_sessions)]
        paths = [os.path.abspath(p) for p in config.import_paths] + [os.environ.get("PYTHONPATH", "")]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, env={
            **os.environ, "ENABLE_WEB_INTERFACE": "false", "PYTHONPATH": os.pathsep.join(p for p in paths if p)})
        atexit.register(self.close)
        self._wait(config.startup_timeout_s)
        logger.info("OpenEnv server for %s at %s", target, self.url)

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise _refuse(f"the OpenEnv server exited (code {self.proc.returncode}) before it answered")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.close()
        raise _refuse(f"the OpenEnv server did not answer within agent.openenv.startup_timeout_s={timeout_s:g} s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class OpenEnvSource:
    """`agent.environment: openenv:<env>`: called, a fresh episode environment; `datasets()`, the reset
    seeds as (train, held-out) prompts."""

    def __init__(self, agent: AgentConfig, target: str):
        self.agent, self.target, self.config = agent, target, agent.openenv
        self.url = target if "://" in target else ""
        self.server: OpenEnvServer | None = None
        self._lock = threading.Lock()
        if self.url:
            if not self.config.action_field:
                raise _refuse("name the Action's text field for a server target", "agent.openenv.action_field")
            self.env_cls, self.action_field = None, self.config.action_field
        else:
            for path in reversed(self.config.import_paths):
                if os.path.abspath(path) not in sys.path:
                    sys.path.insert(0, os.path.abspath(path))
            try:
                self.env_cls = import_object(target, "OpenEnv environment")
            except ValueError as exc:
                raise _refuse(str(exc)) from None
            action_cls, _ = environment_types(self.env_cls)
            if self.config.transport == "server" and not getattr(self.env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False):
                raise _refuse(f"{target} is not marked SUPPORTS_CONCURRENT_SESSIONS, and a run plays its episodes "
                              "at once: use transport: in_process", "agent.openenv.transport")
            self.action_cls = action_cls
            self.action_field = text_field(action_cls, self.config.action_field, "action", "agent.openenv.action_field")

    def datasets(self) -> tuple[PromptDataset, PromptDataset]:
        config = self.config
        seeds = range(config.seed, config.seed + config.heldout_size + config.train_size)
        # The episode's first messages come from its reset; a prompt names the seed (what the run's ledger
        # and its prompt-length check read).
        prompts = [Prompt(prompt_id=stable_id(f"openenv-{self.target}", str(seed), None),
                          messages=[{"role": "user", "content": f"{self.target} (reset seed {seed})"}],
                          question=f"{self.target} seed {seed}", metadata={"openenv_seed": seed}) for seed in seeds]
        return (PromptDataset(f"openenv:{self.target}", prompts[config.heldout_size:]),
                PromptDataset(f"openenv:{self.target}:heldout", prompts[:config.heldout_size]))

    def __call__(self) -> OpenEnvEnvironment:
        if self.url:
            session = ClientSession(self.url, self.action_field)
        elif self.config.transport == "server":
            with self._lock:  # the first episodes may start on several threads
                if self.server is None:
                    sessions = 256  # every episode in flight holds one, the held-out evaluation's too
                    self.server = OpenEnvServer(self.target, self.config, sessions)
            session = ClientSession(self.server.url, self.action_field)
        else:
            session = InProcessSession(self.env_cls, self.config.env_args, self.action_cls, self.action_field)
        return OpenEnvEnvironment(session, self.config, self.agent.max_turns)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def openenv_environment_factory(agent: AgentConfig, tokenizer) -> OpenEnvSource:
    """`agent.environment: openenv:<env>` (config.LIBRARY_ENVIRONMENTS)."""
    return OpenEnvSource(agent, library_environment(agent.environment)[1])
