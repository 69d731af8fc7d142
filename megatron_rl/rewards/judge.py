"""An LLM judge as the reward: any OpenAI-compatible chat endpoint (`megatron-rl serve`, vLLM, a hosted API)
grades each response against a rubric, and the last `Score: N` of its reply, divided by `max_score`, is the
reward (`reward.name: judge`).

    reward:
      name: judge
      kwargs: {url: http://judge-host:8000/v1, model: my-judge, max_score: 10, concurrency: 16}

The rubric is a Python format string over {question}, {reference} (the prompt's answer, or "(none)"),
{response} and {max_score}. A batch of responses is judged concurrently (`concurrency` requests in flight),
each request with a timeout and retried with exponential back-off on connection errors, timeouts, 429 and
5xx (not on other 4xx: a bad request stays bad). Replies are cached per (rubric text) in the process, so a
response judged again (re-evaluation, a resumed step) costs nothing. A reply without a score, or a request
that failed after its retries, is a reward error for that sample (counted, left out of training), never
a silent 0. The API key, when the endpoint needs one, is read from the environment variable `api_key_env`.
"""
from __future__ import annotations

import collections
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from megatron_rl.rewards.registry import RewardResult

DEFAULT_RUBRIC = (
    "You are grading a response to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer (may be empty):\n{reference}\n\n"
    "Response:\n{response}\n\n"
    "Judge whether the response answers the question correctly and helpfully. Think briefly, then end your "
    "reply with a line `Score: N`, where N is an integer from 0 (worst) to {max_score} (best).")
SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
RETRY_STATUS = {408, 409, 429, 500, 502, 503, 504}
CACHE_SIZE = 65536


class JudgeError(RuntimeError):
    """The judge could not give a score (unreachable after retries, an error reply, no score in its reply)."""


class JudgeClient:
    """Chat completions at one endpoint with retries, a bounded concurrency and a reply cache."""

    def __init__(self, url: str, model: str, *, api_key: str | None, timeout_s: float, retries: int,
                 concurrency: int, max_tokens: int):
        url = url.rstrip("/")
        self.url = url if url.endswith("/v1") else url + "/v1"
        self.model, self.api_key, self.timeout_s, self.retries = model, api_key, timeout_s, retries
        self.max_tokens = max_tokens
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="judge")
        self.cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.requests = 0

    def ask(self, text: str) -> str:
        with self.lock:
            if text in self.cache:
                self.cache.move_to_end(text)
                return self.cache[text]
        reply = self._post(text)
        with self.lock:
            self.cache[text] = reply
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        return reply

    def _post(self, text: str) -> str:
        body = {"messages": [{"role": "user", "content": text}], "temperature": 0.0, "max_tokens": self.max_tokens}
        if self.model:
            body["model"] = self.model
        request = urllib.request.Request(self.url + "/chat/completions", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        for attempt in range(self.retries + 1):
            with self.lock:
                self.requests += 1
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    reply = json.loads(response.read())
                return reply["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as exc:
                if exc.code not in RETRY_STATUS or attempt == self.retries:
                    raise JudgeError(f"judge {self.url} answered HTTP {exc.code}: {exc.read()[:200]!r}") from None
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                if attempt == self.retries:
                    raise JudgeError(f"judge {self.url} unreachable after {self.retries + 1} attempts: {exc}") from None
            except (KeyError, IndexError, TypeError, ValueError) as exc:
                raise JudgeError(f"judge {self.url} sent a reply that is not a chat completion: {exc}") from None
            time.sleep(min(0.5 * 2 ** attempt, 8.0))
        raise AssertionError("unreachable")


_CLIENTS: dict[tuple, JudgeClient] = {}
_CLIENTS_LOCK = threading.Lock()


def judge_client(url: str, model: str = "", *, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 120.0,
                 retries: int = 3, concurrency: int = 8, max_tokens: int = 512) -> JudgeClient:
    """The process's client for these settings (one pool and one cache per endpoint and options)."""
    if not url:
        raise ValueError("reward judge needs reward.kwargs.url (an OpenAI-compatible base URL)")
    if not (0 < timeout_s <= 3600 and 0 <= retries <= 20 and 1 <= concurrency <= 1024 and 1 <= max_tokens):
        raise ValueError("reward judge: timeout_s in (0, 3600], retries in [0, 20], concurrency in [1, 1024], "
                         "max_tokens >= 1")
    key = (url, model, api_key_env, timeout_s, retries, concurrency, max_tokens)
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = JudgeClient(url, model, api_key=os.environ.get(api_key_env), timeout_s=timeout_s,
                                        retries=retries, concurrency=concurrency, max_tokens=max_tokens)
        return _CLIENTS[key]


def _options(kwargs: dict[str, Any]) -> tuple[JudgeClient, str, float]:
    kwargs = dict(kwargs)
    kwargs.pop("extract", None)
    rubric = kwargs.pop("rubric", DEFAULT_RUBRIC)
    max_score = float(kwargs.pop("max_score", 10))
    if max_score <= 0:
        raise ValueError(f"reward judge: max_score must be > 0, got {max_score}")
    return judge_client(**kwargs), rubric, max_score


def _score(reply: str, max_score: float) -> RewardResult:
    found = SCORE.findall(reply)
    if not found:
        raise JudgeError(f"no 'Score: N' in the judge's reply {reply[-200:]!r}")
    value = float(found[-1])
    if not 0 <= value <= max_score:
        raise JudgeError(f"the judge's score {value:g} is outside [0, {max_score:g}]")
    return RewardResult(reward=value / max_score, extracted=found[-1])


def _text(rubric: str, response: str, prompt: Any, max_score: float) -> str:
    reference = getattr(prompt, "answer", None)
    return rubric.format(question=getattr(prompt, "question", ""), reference=reference if reference else "(none)",
                         response=response, max_score=f"{max_score:g}")


def judge_reward(response: str, prompt: Any, **kwargs: Any) -> RewardResult:
    """One response graded by the judge (module docstring); the reward in [0, 1]."""
    client, rubric, max_score = _options(kwargs)
    return _score(client.ask(_text(rubric, response, prompt, max_score)), max_score)


def judge_batch(responses: Sequence[str], prompts: Sequence[Any], **kwargs: Any) -> list[RewardResult | Exception]:
    """A batch graded concurrently; a failed sample is its exception (the caller counts it as a reward error)."""
    client, rubric, max_score = _options(kwargs)
    futures = [client.pool.submit(client.ask, _text(rubric, r, p, max_score)) for r, p in zip(responses, prompts)]
    results: list[RewardResult | Exception] = []
    for future in futures:
        try:
            results.append(_score(future.result(), max_score))
        except Exception as exc:  # noqa: BLE001 - one sample's failure is that sample's reward error
            results.append(exc)
    return results


judge_reward.score_batch = judge_batch  # type: ignore[attr-defined]
