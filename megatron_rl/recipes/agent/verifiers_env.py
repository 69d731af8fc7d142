"""`agent.environment: verifiers:<env id or module>`: a `verifiers` environment (PrimeIntellect's
library, 0.4 `verifiers.v1`: a `Taskset` of `Task`s with tools and `@vf.reward` rubrics, optionally an
`Env` whose `run` plays the user) as the agent recipe's environment.

The library runs in its own process (verifiers_worker.py, in whichever interpreter has verifiers: its
pins clash with other stacks), driven over JSON lines. What comes from the library: the taskset's rows
(the prompts; a seeded split gives the held-out rows), the tools offered and their results, the
environment's user messages, and the reward, computed by the library's own scoring of its own trace of
the conversation. What stays here: the chat template, the sampling and the token-exact trajectory
(episodes.py): the policy's text is parsed into OpenAI tool calls by the template's tool-call format,
as a serving engine's tool parser would, and the library never re-renders the conversation.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import random
import subprocess
import sys
import threading
import uuid
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any

from megatron_rl.config import ConfigError, interpreter_has_module
from megatron_rl.data.prompts import Prompt, PromptDataset, stable_id
from megatron_rl.data.tool_calls import ToolCallFormat, tool_call_format, tool_call_format_for
from megatron_rl.recipes.agent.config import AgentConfig, library_environment
from megatron_rl.recipes.agent.environment import EnvStep, renders_tools, with_tool_instructions

logger = logging.getLogger(__name__)

VERIFIERS_PYTHON_ENV = "MEGATRON_RL_VERIFIERS_PYTHON"
DEFAULT_VERIFIERS_VENV = ".venv-verifiers"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "verifiers_worker.py")


class VerifiersError(RuntimeError):
    """The verifiers side refused a request or failed (its one-line reason)."""


def verifiers_python(configured: str = "") -> str:
    """The interpreter of the verifiers side: `configured`, else $MEGATRON_RL_VERIFIERS_PYTHON, else this
    interpreter when it has verifiers, else .venv-verifiers/bin/python in the working directory or the
    repository; refused by name when none has verifiers."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    venv_pythons = [os.path.join(DEFAULT_VERIFIERS_VENV, "bin", "python"),
                    os.path.join(repo, DEFAULT_VERIFIERS_VENV, "bin", "python")]
    candidates = [configured] if configured else [os.environ.get(VERIFIERS_PYTHON_ENV, ""), sys.executable,
                                                  *venv_pythons]
    for path in candidates:
        python = os.path.abspath(os.path.expanduser(path)) if path else ""
        if python and os.path.isfile(python) and os.access(python, os.X_OK) and \
                interpreter_has_module(python, "verifiers"):
            return python
    where = configured or f"${VERIFIERS_PYTHON_ENV}, this interpreter or {DEFAULT_VERIFIERS_VENV}/bin/python"
    raise ConfigError(f"agent.verifiers.python: no Python with the verifiers package at {where}; create one with "
                      "`bash scripts/setup_verifiers.sh` or point it at a Python that imports verifiers",
                      field="agent.verifiers.python")


class VerifiersWorker:
    """The verifiers process of a run, shared by its episodes (requests from several threads)."""

    def __init__(self, python: str, timeout_s: float):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([python, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="verifiers-worker", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except json.JSONDecodeError:  # a library printing to stdout: not ours, shown as a log line
                logger.info("verifiers: %s", line.rstrip())
                continue
            future = self._pending.pop(answer.get("id"), None)
            if future is not None:
                future.set_result(answer)
        code = self.proc.wait()
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            future.set_exception(VerifiersError(f"the verifiers process exited (code {code})"))

    def call(self, op: str, **fields: Any) -> dict:
        future: Future = Future()
        with self._lock:
            if self.proc.poll() is not None:
                raise VerifiersError(f"the verifiers process exited (code {self.proc.returncode})")
            rid, self._next = self._next, self._next + 1
            self._pending[rid] = future
            self.proc.stdin.write(json.dumps({"id": rid, "op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        try:
            answer = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            self._pending.pop(rid, None)
            raise VerifiersError(f"{op}: no answer within agent.verifiers.call_timeout_s={self.timeout_s:g} s") from None
        if not answer.get("ok"):
            raise VerifiersError(f"{op}: {answer.get('error')}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the worker exits at the end of its input
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class RemoteTool:
    """A tool of the verifiers environment as the chat template sees it (its schema); it runs there."""

    def __init__(self, schema: dict):
        function = schema["function"]
        self.name, self.description = function["name"], function.get("description", "")
        self.parameters = function.get("parameters", {})
        self._schema = schema

    def schema(self) -> dict:
        return self._schema


class VerifiersEnvironment:
    """One episode of the verifiers environment (the `Environment` protocol, environment.py)."""

    def __init__(self, worker: VerifiersWorker, tool_format: ToolCallFormat, *, max_turns: int,
                 instructions_in_system: bool):
        self.worker, self.tool_format, self.max_turns = worker, tool_format, max_turns
        self.instructions_in_system = instructions_in_system
        self.tools: list[RemoteTool] = []
        self.episode = ""
        self.turns = 0

    def reset(self, prompt: Prompt) -> list[dict[str, Any]]:
        self.episode, self.turns = uuid.uuid4().hex, 0
        event = self.worker.call("start", episode=self.episode, index=int(prompt.metadata["verifiers_row"]))
        if event["event"] != "turn":
            raise VerifiersError("the environment finished before the policy's first turn")
        self.tools = [RemoteTool(schema) for schema in event["tools"]]
        messages = [dict(m) for m in event["messages"]]
        if self.instructions_in_system and self.tools:
            messages = with_tool_instructions(messages, self.tools, self.tool_format)
        return messages

    def assistant_message(self, text: str) -> tuple[dict[str, Any], dict[str, int]]:
        """The OpenAI assistant message a serving engine's tool parser makes of `text`: its calls as
        `tool_calls`, the text outside them as content. A turn with only malformed calls is plain text
        (the library then takes it for the answer), counted as malformed."""
        parsed = self.tool_format.parse(text)
        calls = [{"id": call.id or f"call_{self.turns}_{k}", "type": "function",
                  "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                 for k, call in enumerate(parsed.calls)]
        message = ({"role": "assistant", "content": parsed.content, "tool_calls": calls} if calls
                   else {"role": "assistant", "content": text})
        return message, {"tool_calls": len(calls), "malformed_calls": len(parsed.errors)}

    def step(self, assistant_text: str) -> EnvStep:
        self.turns += 1
        message, info = self.assistant_message(assistant_text)
        event = self.worker.call("step", episode=self.episode, message=message, last=self.turns >= self.max_turns)
        if event["event"] == "turn":
            return EnvStep([dict(m) for m in event["messages"]], None, False, info)
        terms = {f"env/reward/{name}": score for name, (score, _weight) in
                 ((n, t) for n, t in event["rewards"].items() if t is not None)}
        terms.update({f"env/metric/{name}": value for name, value in event["metrics"].items()})
        return EnvStep([], float(event["reward"]), True, {**info, **terms, "end": event["stop"] or "done"})

    def close(self) -> None:
        if self.episode:
            try:
                self.worker.call("close", episode=self.episode)
            except VerifiersError:
                pass  # the worker is gone: nothing left to release
            self.episode = ""


class VerifiersSource:
    """`agent.environment: verifiers:<env>`: called, a fresh episode environment; `datasets()`, the
    taskset's rows as (train, held-out) prompts. The verifiers process starts on first use (the driver's)."""

    def __init__(self, agent: AgentConfig, tokenizer, env: str):
        self.agent, self.env = agent, env
        template = tokenizer.chat_template if tokenizer is not None else None  # None: checking the config alone
        if agent.tool_call_format == "auto":
            self.tool_format = tool_call_format_for(template if isinstance(template, str) else None)
        else:
            self.tool_format = tool_call_format(agent.tool_call_format)
        self.instructions_in_system = not renders_tools(template)
        self._worker: VerifiersWorker | None = None
        self._rows: list[dict] = []
        self._lock = threading.Lock()

    def worker(self) -> VerifiersWorker:
        with self._lock:
            if self._worker is None:
                config = self.agent.verifiers
                worker = VerifiersWorker(verifiers_python(config.python), config.call_timeout_s)
                try:
                    loaded = worker.call("load", env=self.env, taskset_args=config.taskset_args,
                                         env_args=config.env_args,
                                         import_paths=[os.path.abspath(p) for p in config.import_paths])
                except VerifiersError as exc:
                    worker.close()
                    raise ConfigError(f"agent.environment: verifiers environment {self.env!r}: {exc}",
                                      field="agent.environment") from None
                logger.info("verifiers %s: environment %s (%s, taskset %s), %d rows", loaded["verifiers"], self.env,
                            loaded["env"], loaded["taskset"], len(loaded["rows"]))
                self._rows, self._worker = loaded["rows"], worker
            return self._worker

    def datasets(self) -> tuple[PromptDataset, PromptDataset]:
        self.worker()
        config = self.agent.verifiers
        prompts = [self._prompt(row) for row in self._rows]
        random.Random(config.seed).shuffle(prompts)
        heldout = prompts[:config.heldout_size]
        train = prompts[config.heldout_size:]
        train = train[:config.train_size] if config.train_size else train
        if not train:
            raise ConfigError(f"agent.verifiers.heldout_size: the taskset has {len(prompts)} rows, none left to train "
                              "on", field="agent.verifiers.heldout_size")
        return PromptDataset(f"verifiers:{self.env}", train), PromptDataset(f"verifiers:{self.env}:heldout", heldout)

    def _prompt(self, row: dict) -> Prompt:
        users = [m.get("content") for m in row["messages"] if m.get("role") == "user"]
        question = users[-1] if users and isinstance(users[-1], str) else row["key"]
        return Prompt(prompt_id=stable_id(f"verifiers-{self.env}", row["key"], None), messages=row["messages"],
                      question=question, metadata={"verifiers_row": row["index"], "verifiers_key": row["key"]})

    def __call__(self) -> VerifiersEnvironment:
        return VerifiersEnvironment(self.worker(), self.tool_format, max_turns=self.agent.max_turns,
                                    instructions_in_system=self.instructions_in_system)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


def verifiers_environment_factory(agent: AgentConfig, tokenizer) -> VerifiersSource:
    """`agent.environment: verifiers:<env>` (config.LIBRARY_ENVIRONMENTS)."""
    return VerifiersSource(agent, tokenizer, library_environment(agent.environment)[1])
