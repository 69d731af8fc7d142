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

import concurrent.futures
import dataclasses
import json
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Sequence

import httpx
import openai

from megatron_rl.controller.episodes import EpisodeRuns, Sample
from megatron_rl.data.prompts import Prompt, message_text
from megatron_rl.data.tokenizer import ChatTokenizer
from megatron_rl.recipes.agent.episodes import Trajectory, TurnRenderer
from megatron_rl.rewards.registry import RewardResult
from megatron_rl.rollout.server import RolloutServer
from megatron_rl.types import Completion

log = logging.getLogger(__name__)

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
    """The trajectory state of one agent run (the transport's memory between the agent's requests).

    `defaults`: completions fields used where the agent's request leaves them out (the run's `stop`);
    `forced`: fields that replace the agent's own (a training run's temperature, top_p and top_k: every
    sample of a group must come from the sampling the loss assumes); `seed`: request k gets seed
    (seed * 31 + k) mod 2^31, whatever the agent asked (a group's episodes differ, a resumed run repeats)."""

    def __init__(self, tokenizer: ChatTokenizer, *, default_max_tokens: int = 256,
                 defaults: dict[str, Any] | None = None, forced: dict[str, Any] | None = None,
                 seed: int | None = None):
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.defaults = {k: v for k, v in (defaults or {}).items() if v is not None}
        self.forced = {k: v for k, v in (forced or {}).items() if v is not None}
        self.seed = seed
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
        out.update(self.defaults)
        out.update({k: body[k] for k in _PASSED_THROUGH if body.get(k) is not None})
        out.update(self.forced)
        if self.seed is not None:
            out["seed"] = (self.seed * 31 + len(self.turns)) % (2 ** 31)
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
    run_id: str = ""
    """The run's id in a training run ('<group request id>-e<k>'; the prompt id when empty)."""
    error: str | None = None
    """Why the agent's code raised (a training run scores such an episode 0)."""

    def samples(self) -> list[Sample]:
        """One Sample per segment, each with the run's reward (the trainer's rows)."""
        out = []
        for index, segment in enumerate(self.segments):
            turns = [t for t in self.turns if t.segment == index]
            finish = turns[-1].completion.finish_reason if turns else "length"
            completion = segment.completion(f"{self.run_id or self.prompt.prompt_id}-seg{index}",
                                            self.prompt.prompt_id, finish)
            out.append(Sample(completion, turns[-1].text if turns else "",
                              RewardResult(self.reward, correct=self.reward >= 1.0)))
        return out


AgentFunction = Callable[[openai.OpenAI, str, Prompt], Any]
"""agent(client, model, prompt) -> its reward (a number) or its final answer (text, graded by `grade`)."""


def run_openai_agent(agent: AgentFunction, prompt: Prompt, *, base_url: str, tokenizer: ChatTokenizer,
                     model: str = "default", api_key: str = "unused", grade: Callable[[str, Prompt], float] | None = None,
                     default_max_tokens: int = 256, timeout: float = 600.0, defaults: dict[str, Any] | None = None,
                     forced: dict[str, Any] | None = None, seed: int | None = None,
                     run_id: str = "", errors_score_zero: bool = False) -> OpenAIAgentRun:
    """Run `agent` on `prompt` against the OpenAI endpoint at `base_url` (ours: `megatron-rl serve` or a
    RolloutServer over the run's engine), token-exact; `tokenizer` is the served model's. `defaults`,
    `forced` and `seed` shape its requests (AgentSession). `errors_score_zero`: an exception of the agent
    (its own bug, or a request the server refused, e.g. a conversation past the context) gives a run with
    the segments sampled so far, reward 0 and `error` set, instead of propagating."""
    session = AgentSession(tokenizer, default_max_tokens=default_max_tokens, defaults=defaults, forced=forced,
                           seed=seed)
    http = httpx.Client(transport=TokenExactTransport(session), timeout=timeout)
    try:
        client = openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http, max_retries=0)
        result = agent(client, model, prompt)
    except Exception as exc:
        if not errors_score_zero:
            raise
        final = session.turns[-1].text if session.turns else ""
        return OpenAIAgentRun(prompt, session.segments, session.turns, 0.0, final, run_id,
                              error=f"{type(exc).__name__}: {exc}")
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
    return OpenAIAgentRun(prompt, session.segments, session.turns, reward, final, run_id)


class _AgentRunInFlight:
    """One episode of an OpenAI-client agent, run on the producer's thread pool."""

    def __init__(self, owner: "OpenAIAgentEpisodes", prompt: Prompt, run_id: str, seed: int | None,
                 forced: dict[str, Any]):
        self.owner, self.prompt, self.run_id, self.seed, self.forced = owner, prompt, run_id, seed, forced
        self.future: Future = Future()

    def start(self) -> None:
        self.owner.pool.submit(self._run)

    def _run(self) -> None:
        o = self.owner
        try:
            run = run_openai_agent(o.agent, self.prompt, base_url=o.base_url, tokenizer=o.tokenizer, model=o.model_name,
                                   grade=o.grade, default_max_tokens=o.max_tokens, defaults=o.defaults,
                                   forced=self.forced, seed=self.seed, run_id=self.run_id, errors_score_zero=True)
            self.future.set_result(run)
        except BaseException as exc:  # noqa: BLE001 - grading failed: surfaces in collect()
            self.future.set_exception(exc)


class OpenAIAgentEpisodes(EpisodeRuns):
    """Episode producer (controller/episodes.py's interface) for agents written against the OpenAI API:
    it serves the policy's engine on a loopback port (rollout/server.py) and runs `samples_per_prompt`
    episodes of `agent(client, model, prompt)` per prompt on a thread pool, each with the official client
    through `TokenExactTransport`. Every trajectory segment of an episode is a sample with the episode's
    reward (an agent that never rewrites its history gives one). An agent that raises ends its episode
    with reward 0 (counted as `agent_errors`, its first message logged); a group whose every episode
    raised before sampling anything re-raises, since that is a bug in the agent, not a bad episode.

    The run's sampling is forced onto every request (temperature, top_p, top_k; the seed derived from
    the group's), `stop` and `max_tokens` are defaults the agent may override."""

    keeps_in_flight_samples = False
    engines: ClassVar[list] = []
    """None to hold: the agent's requests arrive over HTTP and its engine steps in its own thread, so a
    synchronous run's batches depend on request timing (bit-exact replay is not promised here)."""

    def __init__(self, engine, tokenizer: ChatTokenizer, agent: AgentFunction, *, grade: Callable[[str, Prompt], float],
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, stop: Sequence[str] | None = None,
                 max_tokens: int = 256, samples_per_prompt: int = 1, concurrency: int = 64,
                 model_name: str = "policy", record_path: str | None = None):
        self.tokenizer, self.agent, self.grade = tokenizer, agent, grade
        self.samples_per_prompt = samples_per_prompt
        self.model_name, self.max_tokens, self.record_path = model_name, max_tokens, record_path
        self.forced = {"temperature": temperature, "top_p": top_p, "top_k": None if top_k in (-1, 0) else top_k}
        self.defaults = {"stop": list(stop) if stop else None}
        self.server = RolloutServer(engine, port=0, tokenizer=tokenizer, model_name=model_name).start()
        self.base_url = self.server.url + "/v1"
        self.pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="openai-agent")
        self.reward_time = 0.0
        self.generated_samples = 0
        self.step = 0
        self._counts: dict[str, float] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    def episode_run(self, prompt: Prompt, run_id: str, seed: int | None) -> _AgentRunInFlight:
        return _AgentRunInFlight(self, prompt, run_id, seed, self.forced)

    def collect(self, prompt: Prompt, futures: Sequence[Future]) -> list[Sample]:
        runs = self._finished(prompt, futures, tag=f"step {self.step + 1}")
        self.generated_samples += len(runs)
        if self.record_path:
            with open(self.record_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(openai_run_record(run, step=self.step + 1)) + "\n" for run in runs)
        for run in runs:
            count_openai_run(self._counts, run)
        return [sample for run in runs for sample in run.samples()]

    def _finished(self, prompt: Prompt, futures: Sequence[Future], *, tag: str) -> list[OpenAIAgentRun]:
        runs = [future.result() for future in futures]
        errors = [run.error for run in runs if run.error]
        if errors:
            self._counts["agent_errors"] = self._counts.get("agent_errors", 0.0) + len(errors)
            log.warning("%s: %d of %d agent episodes of prompt %s raised; first: %s", tag, len(errors),
                        len(runs), prompt.prompt_id, errors[0])
            if not any(run.segments for run in runs):
                raise RuntimeError(f"{tag}: every agent episode of prompt {prompt.prompt_id} raised before "
                                   f"sampling anything (a bug in the agent?); first: {errors[0]}")
        return runs

    def play(self, prompts: Sequence[Prompt], *, tag: str, forced: dict[str, Any] | None = None) -> list[OpenAIAgentRun]:
        """One episode per prompt now, outside the training stream (evaluation: `forced` sampling, e.g.
        temperature 0), all at once on the pool."""
        flights = [_AgentRunInFlight(self, p, f"{tag}-{i}", None, {**self.forced, **(forced or {})})
                   for i, p in enumerate(prompts)]
        for flight in flights:
            flight.start()
        return [run for flight, p in zip(flights, prompts) for run in self._finished(p, [flight.future], tag=tag)]

    def pop_metrics(self) -> dict[str, float]:
        counts, self._counts = self._counts, {}
        return {f"agent/{k}": v for k, v in openai_run_metrics(counts).items()}

    def close(self) -> None:
        """Stop serving and drop episodes not yet started (those running finish on their own)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.server.shutdown()


def count_openai_run(counts: dict[str, float], run: OpenAIAgentRun) -> None:
    """Add one agent episode to running counts (`openai_run_metrics` turns them into rates)."""
    for key, value in (("episodes", 1), ("requests", len(run.turns)), ("segments", len(run.segments)),
                       ("reward", run.reward), ("correct", float(run.reward >= 1.0)),
                       ("sampled_tokens", sum(s.sampled_tokens for s in run.segments)),
                       ("environment_tokens", sum(s.environment_tokens for s in run.segments))):
        counts[key] = counts.get(key, 0.0) + value


def openai_run_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Per-episode means of counts gathered by `count_openai_run`."""
    n = max(counts.get("episodes", 0.0), 1.0)
    return {"episodes": counts.get("episodes", 0.0), "turns_per_episode": counts.get("requests", 0.0) / n,
            "segments_per_episode": counts.get("segments", 0.0) / n, "episode_reward": counts.get("reward", 0.0) / n,
            "accuracy": counts.get("correct", 0.0) / n, "agent_errors": counts.get("agent_errors", 0.0),
            "sampled_tokens": counts.get("sampled_tokens", 0.0),
            "environment_tokens": counts.get("environment_tokens", 0.0)}


def openai_run_record(run: OpenAIAgentRun, step: int | None = None) -> dict[str, Any]:
    """A JSON-able record of an agent episode: each request's reply, tokens and weight versions."""
    turns = [{"text": t.text, "segment": t.segment, "tokens": len(t.completion.output_ids),
              "versions": sorted(set(t.completion.weight_versions))} for t in run.turns]
    return {"prompt_id": run.prompt.prompt_id, **({"step": step} if step is not None else {}), "reward": run.reward,
            "segments": len(run.segments), "error": run.error, "turns": turns}
