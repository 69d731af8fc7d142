"""The `verifiers` side of `agent.environment: verifiers:<env>` (verifiers_env.py drives it).

It runs in an interpreter that has `verifiers` 0.4 (`verifiers.v1`) installed, which may not be the
trainer's: verifiers pins `openai<3` and `mcp==2.0.0`, which other stacks (OpenEnv's fastmcp) refuse. So
this file imports only the standard library and verifiers, is started by path, and answers JSON lines
on stdin / stdout: requests `{"id", "op", ...}`, answers `{"id", "ok": true, ...}` or `{"id", "ok":
false, "error"}`.

    load   {env, taskset_args, env_args, import_paths} -> {rows: [{index, key, messages}], env, taskset}
    start  {episode, index}                            -> an event
    step   {episode, message, last}                    -> an event
    close  {episode}                                    -> {}

An event is `{"event": "turn", "messages": [...], "tools": [...]}` (the policy's turn: the messages
new since its last one: the prompt, tool results or the environment's user message) or `{"event":
"finished", "reward", "rewards": {name: [score, weight]}, "metrics", "stop"}`.

The episode is the library's own: the environment's `Env.run(task, agents)` runs with a seat whose
turns are the policy's messages (each `turn()` a segment: assistant messages until one without tool
calls, the task's tools run in process on this event loop), the trace the library's own graph built
from those messages, and the reward the library's own scoring of it (`task.score`, then
`Env.finalize`), as its evaluation loop does. What this bridge cannot honour is refused by name when
the environment loads: `@vf.stop` hooks and request interceptors (they act on the harness's
requests), rewards or metrics that need a live runtime (a sandbox), toolsets with their own state,
and environments with more than one seat.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import threading
import time
import traceback

import verifiers
import verifiers.v1 as vf
from mcp.server.mcpserver import MCPServer
from verifiers.v1.dialects.chat import message_to_wire, parse_message, parse_tools
from verifiers.v1.graph import prepare_turn
from verifiers.v1.harnesses.utils.compaction import bound_tool_message
from verifiers.v1.harnesses.utils.mcp import mcp_content_to_chat_content
from verifiers.v1.state import State, state_cls


# The protocol owns stdout; whatever the library or an environment prints goes to stderr instead.
_PROTOCOL = sys.stdout


def _reply(payload: dict) -> None:
    _PROTOCOL.write(json.dumps(payload) + "\n")
    _PROTOCOL.flush()


class BridgeError(Exception):
    """A request this bridge refuses (one line, sent back as the error)."""


def _initial_messages(task) -> list[dict]:
    """The messages a prompted task opens with (its system prompt, then its prompt), as the library's
    chat programs build them."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [message_to_wire(m) for m in data.prompt]
    return messages


def _needs_runtime(fn) -> bool:
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _check_task(task) -> None:
    """Refuse, by name, what the bridge would otherwise silently do differently from the library."""
    name = type(task).__name__
    stops = [fn.__name__ for fn in task.hooks("stop")]
    if stops:
        raise BridgeError(f"task {name}: @vf.stop hooks {stops} act on the harness's requests; the token-exact "
                          "bridge does not run them")
    runtime = [fn.__name__ for attr in ("reward", "metric") for fn in task.hooks(attr) if _needs_runtime(fn)]
    if runtime:
        raise BridgeError(f"task {name}: {runtime} need a live runtime (a sandbox), which the bridge does not start")
    for toolset in type(task).toolsets(task.config):
        if toolset._state_cls is not State:
            raise BridgeError(f"task {name}: toolset {type(toolset).__name__} keeps its own state, which the "
                              "bridge's in-process tools cannot carry between calls")


class Tools:
    """The task's toolsets (and the taskset's shared ones) on in-process MCP servers, one set per
    episode as the library starts one server per rollout."""

    def __init__(self, env, task):
        self.task_toolsets = type(task).toolsets(task.config)
        self.shared_toolsets = type(env.taskset).toolsets(env.taskset.config)
        self.servers: dict[str, object] = {}
        self.routes: dict[str, tuple[str, str]] = {}
        self.schemas: list[dict] = []

    async def start(self, task) -> "Tools":
        for toolset in self.task_toolsets + self.shared_toolsets:
            await toolset.setup()
            if toolset in self.task_toolsets:  # taskset-scoped servers skip the per-task hook
                await toolset.setup_task(task)
            prefix = toolset.server_name
            server = MCPServer(prefix or type(toolset).__name__)
            toolset.register(server)
            self.servers[prefix] = server
            for tool in await server.list_tools():
                name = f"{prefix}_{tool.name}" if prefix else tool.name
                self.routes[name] = (prefix, tool.name)
                self.schemas.append({"type": "function", "function": {
                    "name": name, "description": tool.description or "", "parameters": tool.input_schema}})
        return self

    async def call(self, name: str, arguments: str) -> str:
        """The tool message's content, as the library's chat loop and MCP server write it (errors as text)."""
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return f"error: invalid JSON in tool arguments ({exc}); resend the call with valid JSON"
        if not isinstance(args, dict):
            return f"error: tool arguments must be a JSON object, got {type(args).__name__}; resend as an object"
        if name not in self.routes:
            return f"error: unknown tool {name!r}"
        prefix, tool = self.routes[name]
        try:
            content = mcp_content_to_chat_content((await self.servers[prefix].call_tool(tool, args)).content)
        except Exception as exc:  # noqa: BLE001 - the MCP server answers a failing tool with its message
            content = str(exc)
        return bound_tool_message({"content": content})["content"]


def build_trace(task, messages: list[dict], tools: list[dict], sampled: set[int] = frozenset()):
    """The library's trace of a conversation: one model call per sampled assistant message (`sampled`:
    their positions; the prompt's own assistant messages, e.g. worked examples, are part of the request),
    committed through its own graph, so the rewards read exactly what its rollouts record."""
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), state=state_cls(type(task))())
    parsed = [parse_message(m) for m in messages]
    typed_tools = parse_tools(tools) or []
    for i, message in enumerate(parsed):
        if i in sampled:
            response = vf.Response(id=f"turn-{i}", created=int(time.time()), model="policy", message=message,
                                   finish_reason="tool_calls" if message.tool_calls else "stop")
            prepare_turn(trace, parsed[:i], typed_tools).commit(response)
    trace.is_completed, trace.ok = True, True
    return trace


class Interaction:
    """One seat's exchange (the library's `Interaction` contract): `turn()` runs one segment of the
    policy, `trace` is the conversation so far."""

    def __init__(self, episode: "Episode"):
        self.episode = episode
        self.messages: list[dict] = []
        self.sampled: set[int] = set()
        self.trace = build_trace(episode.task, [], [])
        self.started = False
        self.over = False
        self.stop: str | None = None

    async def turn(self, message=None):
        if self.over:
            return vf.Segment(messages=[], terminated=True)
        new = [] if self.started else _initial_messages(self.episode.task)
        if isinstance(message, str):
            new.append({"role": "user", "content": message})
        elif message is not None:
            new += [m if isinstance(m, dict) else message_to_wire(m) for m in message]
        self.started = True
        segment: list[dict] = []
        while True:
            self.messages += new
            assistant, last = await self.episode.ask_policy(new)
            self.sampled.add(len(self.messages))
            self.messages.append(assistant)
            segment.append(assistant)
            calls = assistant.get("tool_calls") or []
            if last:  # the policy's turn budget is spent: the exchange ends here, as at the library's max_turns
                self.over, self.stop = True, "max_turns"
                break
            if not calls:
                break
            new = [{"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                    "content": await self.episode.tools.call(call["function"]["name"], call["function"]["arguments"])}
                   for call in calls]
            segment += new
        self.trace = build_trace(self.episode.task, self.messages, self.episode.tools.schemas, self.sampled)
        return vf.Segment(messages=[parse_message(m) for m in segment])

    async def finish(self, condition: str):
        self.trace = build_trace(self.episode.task, self.messages, self.episode.tools.schemas, self.sampled)
        self.trace.stop(self.stop or condition)
        await self.episode.task.score(self.trace, None)
        self.episode.traces.append(self.trace)
        return self.trace


class Seat:
    """The agent an environment's `run` addresses (`agents.<seat>`): the policy."""

    def __init__(self, episode: "Episode", name: str):
        self.episode, self.name = episode, name

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        interaction = self.episode.open(self.name)
        yield interaction
        await interaction.finish("user_closed")

    async def run(self, task, **_):
        interaction = self.episode.open(self.name)
        await interaction.turn()
        return await interaction.finish("agent_completed")


class Seats:
    def __init__(self, episode: "Episode"):
        self._episode = episode

    def __getattr__(self, name: str) -> Seat:
        if name.startswith("_"):
            raise AttributeError(name)
        return Seat(self._episode, name)


class Episode:
    """One episode in flight: the environment's `run` on its own task, paused at each policy turn."""

    def __init__(self, bridge: "Bridge", task):
        self.bridge, self.task = bridge, task
        self.tools = Tools(bridge.env, task)
        self.traces: list = []
        self.seat: str | None = None
        self.events: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()
        self.runner: asyncio.Task | None = None

    def open(self, seat: str) -> Interaction:
        if self.seat is not None and seat != self.seat:
            raise BridgeError(f"the environment opened seats {self.seat!r} and {seat!r}: only one seat, the policy, "
                              "is supported")
        self.seat = seat
        return Interaction(self)

    async def ask_policy(self, new_messages: list[dict]):
        await self.events.put({"event": "turn", "messages": new_messages, "tools": self.tools.schemas})
        return await self.replies.get()

    async def run(self) -> None:
        try:
            await self.tools.start(self.task)
            await self.bridge.env.run(self.task, Seats(self))
            if not self.traces:
                raise BridgeError("the environment's run ended without a turn of the policy")
            episode = vf.Episode(env=vf.EnvInfo(id=self.bridge.env_id),
                                 task=vf.TraceTask(type=type(self.task).__name__, data=self.task.data,
                                                   key=self.task.key, hash=self.task.hash),
                                 traces=self.traces)
            await self.bridge.env.finalize(self.task, episode)
            trace = self.traces[-1]
            await self.events.put({
                "event": "finished", "reward": float(trace.reward or 0.0), "stop": trace.stop_condition,
                "rewards": {k: None if r is None else [r.score, r.weight] for k, r in trace.rewards.items()},
                "metrics": {k: float(v) for k, v in (trace.metrics or {}).items() if isinstance(v, (int, float))},
                "errors": [str(e) for e in (trace.errors or [])]})
        except Exception as exc:  # noqa: BLE001 - the policy side gets it as the request's error
            await self.events.put({"event": "error", "error": _one_line(exc)})


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, BridgeError):
        return str(exc)
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:2000]


class Bridge:
    def __init__(self):
        self.env = None
        self.env_id = ""
        self.tasks: list = []
        self.episodes: dict[str, Episode] = {}

    async def load(self, env: str, taskset_args: dict, env_args: dict, import_paths: list[str]) -> dict:
        for path in reversed(import_paths):
            if path not in sys.path:
                sys.path.insert(0, path)
        config = vf.resolve_env_config({"taskset": {"id": env, **taskset_args}, **env_args})
        self.env, self.env_id = vf.load_environment(config), env
        self.tasks = list(self.env.taskset)
        if not self.tasks:
            raise BridgeError(f"verifiers environment {env!r}: its taskset has no tasks")
        for task in self.tasks[:1]:
            _check_task(task)
        return {"verifiers": verifiers.__version__, "env": type(self.env).__name__,
                "taskset": type(self.env.taskset).__name__,
                "rows": [{"index": i, "key": str(task.key), "messages": _initial_messages(task)}
                         for i, task in enumerate(self.tasks)]}

    async def event(self, episode: Episode) -> dict:
        event = await episode.events.get()
        if event["event"] == "error":
            raise BridgeError(event["error"])
        return event

    async def start(self, episode: str, index: int) -> dict:
        if self.env is None:
            raise BridgeError("no environment loaded")
        if not 0 <= index < len(self.tasks):
            raise BridgeError(f"row {index} out of range (the taskset has {len(self.tasks)})")
        run = self.episodes[episode] = Episode(self, self.tasks[index])
        run.runner = asyncio.ensure_future(run.run())
        return await self.event(run)

    async def step(self, episode: str, message: dict, last: bool) -> dict:
        run = self.episodes[episode]
        await run.replies.put((message, bool(last)))
        return await self.event(run)

    async def close(self, episode: str) -> dict:
        run = self.episodes.pop(episode, None)
        if run is not None and run.runner is not None and not run.runner.done():
            run.runner.cancel()
        return {}


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue = asyncio.Queue()
    bridge = Bridge()

    def read() -> None:  # stdin on a thread: the event loop keeps running tools and episodes meanwhile
        for line in sys.stdin:
            loop.call_soon_threadsafe(requests.put_nowait, line)
        loop.call_soon_threadsafe(requests.put_nowait, None)

    threading.Thread(target=read, daemon=True).start()

    async def handle(request: dict) -> None:
        try:
            op = request.pop("op")
            rid = request.pop("id")
        except KeyError as exc:
            _reply({"id": None, "ok": False, "error": f"request without {exc}"})
            return
        try:
            handler = {"load": bridge.load, "start": bridge.start, "step": bridge.step, "close": bridge.close}.get(op)
            if handler is None:
                raise BridgeError(f"unknown op {op!r}")
            _reply({"id": rid, "ok": True, **(await handler(**request))})
        except Exception as exc:  # noqa: BLE001 - every failure goes back as one line
            if op != "load" and not isinstance(exc, BridgeError):  # an environment's own bug: its traceback helps
                traceback.print_exc(file=sys.stderr)
            _reply({"id": rid, "ok": False, "error": _one_line(exc)})

    pending: set = set()
    while (line := await requests.get()) is not None:
        if line.strip():
            task = asyncio.ensure_future(handle(json.loads(line)))
            pending.add(task)
            task.add_done_callback(pending.discard)


if __name__ == "__main__":
    sys.stdout = sys.stderr
    asyncio.run(_serve())
