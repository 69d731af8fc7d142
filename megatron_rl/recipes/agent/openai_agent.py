"""Train agents written against the OpenAI API: run an agent function with the official `openai` client
against our server (rollout/server.py) and collect its turns as token-exact trajectories.

    run = run_openai_agent(agent, prompt, base_url="http://127.0.0.1:30000/v1", tokenizer=tokenizer)
    run.samples()     # one Sample per trajectory segment: sampled ids, behaviour log-probs, versions

`agent(client, model, prompt)` is ordinary agent code: it calls `client.chat.completions.create(messages=...)`,
appends the assistant's reply and its tool results to `messages`, and calls again. The client it gets
sends every chat request through `TokenExactTransport`, which turns it into a `/v1/completions` request
whose prompt is token ids: the previous turn's prompt, the ids the engine sampled, and the ids of only the
messages the agent added (episodes.py's `TurnRenderer`), with `return_token_ids` so the reply carries
the sampled ids, their behaviour log-probs and weight versions. The agent sees an ordinary chat
completion. When the agent's messages do not extend the previous request (it rewrote or dropped
history), a new trajectory segment starts from a fresh render of its messages.

Supported chat fields: model, messages (text content), tools (rendered by templates that take them),
max_tokens / max_completion_tokens, temperature, top_p, seed, stop, n = 1, user, and the extensions
top_k, min_p, stop_token_ids, ignore_eos, return_token_ids; anything else is refused with an OpenAI
error object naming the field (the client raises BadRequestError).
"""
from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any, Callable

import httpx
import openai

from megatron_rl.controller.episodes import Sample
from megatron_rl.data.prompts import Prompt, message_text
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.recipes.agent.episodes import Trajectory, TurnRenderer
from megatron_rl.rewards.registry import RewardResult
from megatron_rl.types import Completion

_PASSED_THROUGH = ("temperature", "top_p", "seed", "stop", "user", "top_k", "min_p", "stop_token_ids", "ignore_eos")
_ACCEPTED = {"model", "messages", "tools", "max_tokens", "max_completion_tokens", "n", "return_token_ids",
             "stream", *_PASSED_THROUGH}


class AgentRequestError(ValueError):
    """A chat request the token-exact transport cannot serve; `field` names the request field."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass
class OpenAITurn:
    """One chat request of the agent, as the engine served it."""

    completion: Completion
    """Prompt ids sent (the trajectory so far), sampled ids, behaviour log-probs, weight versions."""
    text: str
    """The assistant content the agent received."""
    segment: int
    """Index of the trajectory segment it belongs to."""


class AgentSession:
    """The trajectory state of one agent run (the transport's memory between the agent's requests)."""

    def __init__(self, tokenizer: ChatTokenizer, *, default_max_tokens: int = 256):
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.segments: list[Trajectory] = []
        self.turns: list[OpenAITurn] = []
        self.renderer: TurnRenderer | None = None
        self._sent: list[int] = []
        self.lock = threading.Lock()

    def completion_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The /v1/completions body (token-id prompt) for the agent's chat request `body`."""
        unknown = sorted(set(body) - _ACCEPTED)
        if unknown:
            raise AgentRequestError(f"'{unknown[0]}' is not supported by the token-exact agent transport", unknown[0])
        if body.get("n") not in (None, 1):
            raise AgentRequestError("only n=1: each request continues one trajectory", "n")
        if body.get("stream"):
            raise AgentRequestError("stream=true is not supported by the token-exact agent transport", "stream")
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise AgentRequestError("must be a non-empty list of messages", "messages")
        messages = [_plain(m, i) for i, m in enumerate(raw)]
        tools = body.get("tools")
        ids = self._continue(messages) if self.renderer is not None and tools == self.renderer.tools else None
        if ids is None:  # a new segment: the agent's messages do not extend the previous request
            self.renderer = TurnRenderer(self.tokenizer, messages, tools)
            self.segments.append(Trajectory(self.renderer.prompt_ids()))
            ids = self.segments[-1].prompt_ids
        else:
            self.segments[-1].add_environment(ids)
            ids = self.segments[-1].next_prompt()
        self._sent = ids
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) or self.default_max_tokens
        out = {"model": body.get("model"), "prompt": ids, "max_tokens": max_tokens, "n": 1, "return_token_ids": True}
        out.update({k: body[k] for k in _PASSED_THROUGH if body.get(k) is not None})
        return out

    def _continue(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """Ids of what the agent appended after the last reply, or None when it does not extend it."""
        previous = self.renderer.messages
        n = len(previous)
        if len(messages) < n + 2 or [_key(m) for m in messages[:n]] != [_key(m) for m in previous]:
            return None
        reply = messages[n]
        last = self.turns[-1]
        if reply["role"] != "assistant" or reply.get("content", "") != last.text:
            return None
        return self.renderer.next_ids(last.completion.output_ids, last.text, messages[n + 1:])

    def chat_response(self, data: dict[str, Any]) -> dict[str, Any]:
        """Record the completions response `data` and turn it into the chat completion the agent gets."""
        (choice,) = data["choices"]
        if choice.get("prompt_token_ids") != self._sent:
            raise AgentRequestError("the server did not serve the token-id prompt it was sent", "prompt")
        ids = list(choice["token_ids"])
        versions = [0] * len(ids)
        for span in choice["weight_versions"]:
            versions[span["start"]:span["end"]] = [span["version"]] * (span["end"] - span["start"])
        logprobs = [float("-inf") if x is None else float(x) for x in choice["token_logprobs"]]
        completion = Completion(request_id=data["id"], prompt_ids=list(self._sent), output_ids=ids,
                                output_logprobs=logprobs, weight_versions=versions,
                                finish_reason=choice["finish_reason"])
        self.segments[-1].add_sampled(completion)
        text = choice["text"]
        self.turns.append(OpenAITurn(completion, text, len(self.segments) - 1))
        return {"id": data["id"], "object": "chat.completion", "created": data["created"], "model": data["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": choice["finish_reason"]}],
                "usage": data.get("usage")}


def _plain(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise AgentRequestError(f"message {index} must be an object with a 'role'", "messages")
    out = dict(message)
    if out.get("content") is not None:
        try:
            out["content"] = message_text(out["content"], "chat request", f"messages[{index}].content")
        except ValueError as exc:
            raise AgentRequestError(str(exc), "messages") from None
    elif "tool_calls" not in out:
        out["content"] = ""
    return out


def _key(message: dict[str, Any]) -> tuple:
    return message["role"], message.get("content") or "", json.dumps(message.get("tool_calls"), sort_keys=True)


class TokenExactTransport(httpx.BaseTransport):
    """An httpx transport that serves chat completions as token-id completions (see the module docstring)
    and passes every other request through unchanged."""

    def __init__(self, session: AgentSession, inner: httpx.BaseTransport | None = None):
        self.session = session
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
            return self.inner.handle_request(request)
        with self.session.lock:  # one trajectory: the agent's requests are served one at a time
            try:
                body = self.session.completion_body(json.loads(request.read()))
            except AgentRequestError as exc:
                return _error(400, str(exc), exc.field)
            except json.JSONDecodeError as exc:
                return _error(400, f"malformed JSON: {exc}", None)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length", "content-type")}
            url = request.url.copy_with(path=request.url.path[:-len("/chat/completions")] + "/completions")
            response = self.inner.handle_request(httpx.Request("POST", url, headers=headers, json=body,
                                                               extensions=request.extensions))
            response.read()
            if response.status_code != 200:
                return httpx.Response(response.status_code, headers={"content-type": "application/json"},
                                      content=response.content)
            try:
                chat = self.session.chat_response(response.json())
            except AgentRequestError as exc:
                return _error(500, str(exc), exc.field)
            return httpx.Response(200, json=chat)

    def close(self) -> None:
        self.inner.close()


def _error(status: int, message: str, field: str | None) -> httpx.Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return httpx.Response(status, json={"error": {"message": message, "type": kind, "param": field, "code": None}})


@dataclasses.dataclass
class OpenAIAgentRun:
    """The result of one agent run: its trajectory segments, turns and reward."""

    prompt: Prompt
    segments: list[Trajectory]
    turns: list[OpenAITurn]
    reward: float
    final_text: str

    def samples(self) -> list[Sample]:
        """One Sample per segment, each with the run's reward (the trainer's rows)."""
        out = []
        for index, segment in enumerate(self.segments):
            turns = [t for t in self.turns if t.segment == index]
            finish = turns[-1].completion.finish_reason if turns else "length"
            completion = segment.completion(f"{self.prompt.prompt_id}-seg{index}", self.prompt.prompt_id, finish)
            out.append(Sample(completion, turns[-1].text if turns else "",
                              RewardResult(self.reward, correct=self.reward >= 1.0)))
        return out


AgentFunction = Callable[[openai.OpenAI, str, Prompt], Any]
"""agent(client, model, prompt) -> its reward (a number) or its final answer (text, graded by `grade`)."""


def run_openai_agent(agent: AgentFunction, prompt: Prompt, *, base_url: str, tokenizer: ChatTokenizer,
                     model: str = "default", api_key: str = "unused", grade: Callable[[str, Prompt], float] | None = None,
                     default_max_tokens: int = 256, timeout: float = 600.0) -> OpenAIAgentRun:
    """Run `agent` on `prompt` against the OpenAI endpoint at `base_url` (ours: `megatron-rl serve` or a
    RolloutServer over the run's engine), token-exact; `tokenizer` is the served model's."""
    session = AgentSession(tokenizer, default_max_tokens=default_max_tokens)
    http = httpx.Client(transport=TokenExactTransport(session), timeout=timeout)
    try:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0)
        result = agent(client, model, prompt)
    finally:
        http.close()
    final = session.turns[-1].text if session.turns else ""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        reward = float(result)
    else:
        if grade is None:
            raise ValueError("the agent returned its answer, not a reward: pass grade=")
        text = final if result is None else str(result)
        reward = grade(text, prompt)
    return OpenAIAgentRun(prompt, session.segments, session.turns, reward, final)
