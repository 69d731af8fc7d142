"""The verifiers library's own evaluation loop on scripted completions: the reference of
tests/test_agent_environments.py. Run with the interpreter that has verifiers (not the project's):

    python tests/verifiers_library_loop.py ENV_ID '{"taskset": {...}, "seat": "agent", "max_turns": 4}'

It serves a scripted policy as an OpenAI-compatible `/v1/chat/completions` (streaming, as the library's
interception proxy asks) on loopback, runs every row of the environment through `Env.run_slot` with the
library's null harness in a subprocess runtime (its tools as MCP servers, its scoring, its finalize),
and prints one JSON line: for each row, the reward, the reward terms, the metrics, the stop condition and
the assistant messages the policy sampled. One workaround, of the library's internals: the null harness's
chat program would be installed by `uv` from the network; its interpreter cache is filled with this
interpreter, which has all the program needs.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def scripted_reply(messages: list[dict], tools: list[dict]) -> dict:
    """The policy: products (vf-calculator) by the question's numbers, guesses by bisection."""
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    if "Guess the secret" in str(system):
        low, high, last = 1, 100, None
        for m in messages:
            if m["role"] == "assistant":
                last = int(m["content"])
            elif m["role"] == "user" and last is not None:
                low, high = (last + 1, high) if m["content"] == "higher" else (low, last - 1) if m["content"] == "lower" \
                    else (low, high)
        return {"role": "assistant", "content": str((low + high) // 2)}
    question = [m["content"] for m in messages if m["role"] == "user"][-1]
    a, b = map(int, re.findall(r"\d+", question)[:2])
    called = messages[-1]["role"] == "tool"
    kind = (a + b) % 3
    if kind == 2:  # answers alone, right
        return {"role": "assistant", "content": f"The answer is {a * b}."}
    if not called:
        arguments = json.dumps({"expression": f"{a} * {b}"})
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_" + uuid.uuid4().hex[:8], "type": "function",
             "function": {"name": "calculator", "arguments": arguments}}]}
    return {"role": "assistant", "content": f"The answer is {a * b + kind}."}  # kind 1: wrong after the call


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        message = scripted_reply(body["messages"], body.get("tools") or [])
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        base = {"id": "chatcmpl-" + uuid.uuid4().hex[:8], "created": int(time.time()), "model": body.get("model")}
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        delta = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        for chunk in ({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                      {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}):
            self.wfile.write(b"data: " + json.dumps({**base, "object": "chat.completion.chunk", **chunk}).encode()
                             + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def use_this_interpreter_for_the_chat_program() -> None:
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    SubprocessRuntime._interpreters[str(path)] = sys.executable


async def main(env_id: str, options: dict) -> None:
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    os.environ["SCRIPTED_API_KEY"] = "local"
    use_this_interpreter_for_the_chat_program()
    seat = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": options.get("max_turns", 8)}
    config = vf.resolve_env_config({"taskset": {"id": env_id, **options.get("taskset", {})},
                                    options.get("seat", "agent"): seat, **options.get("env", {})})
    env = vf.load_environment(config)
    context = vf.ModelContext(model="scripted", client=vf.EvalClientConfig(
        base_url=f"http://127.0.0.1:{server.server_port}/v1", api_key_var="SCRIPTED_API_KEY"),
        sampling=vf.SamplingConfig(temperature=0.0, max_tokens=64))
    async with env.serving():
        episodes = await asyncio.gather(*(env.run_slot(slot, context) for task in env.taskset
                                          for slot in env.slots(task, 1)))
    rows = []
    for episode in episodes:
        trace = episode.traces[-1]
        rows.append({"key": str(trace.task.key), "reward": trace.reward, "stop": trace.stop_condition,
                     "rewards": {k: None if r is None else [r.score, r.weight] for k, r in trace.rewards.items()},
                     "metrics": {k: float(v) for k, v in (trace.metrics or {}).items()},
                     "errors": [str(e) for e in trace.errors or []],
                     "assistant": [message_to_wire(node.message) for node in trace.nodes if node.sampled]})
    print(json.dumps(rows))


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}))
