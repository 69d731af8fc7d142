"""What the two HTTP APIs of `megatron-rl serve` share (rollout/sglang_api.py: SGLang's native API;
rollout/openai_api.py: OpenAI's /v1): OpenAI-shaped errors, request bodies read under a size cap
before anything parses them, the bridge from asyncio handlers to the engine's continuous batch
(a cap on queued tokens, abort when the client goes away, per-token streaming), prompt log-probs,
and the text of a completion with its stop string or stop token trimmed. docs/serving.md.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Protocol

import torch
from starlette.requests import ClientDisconnect, Request

from megatron_rl.rollout.engine import GenerateRequest, RequestError
from megatron_rl.types import Completion

log = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as OpenAI's error object: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, str(self), self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"), "param": param,
                      "code": code}, "object": "error"}


def bad_request(field: str, message: str) -> APIError:
    return APIError(400, f"field '{field}' {message}", param=field)


@dataclasses.dataclass
class ServerLimits:
    """Bounds that keep one client from starving or exhausting the server (CLI flags of `serve`)."""

    max_body_bytes: int = 8 << 20
    """Largest JSON request body; larger ones get 413 before a byte of them is parsed or tokenized."""
    max_weights_bytes: int = 64 << 30
    """Largest raw safetensors body of /update_weights_from_tensor."""
    max_n: int = 64
    """Most samples one request may ask for (OpenAI's / SGLang's `n`)."""
    max_queued_tokens: int = 0
    """Most tokens (prompt + allowed new tokens, per sample) admitted at once over all requests;
    past it a request gets 429. 0: 16 x the engine's slots x its context."""
    max_top_logprobs: int = 20
    """Most alternatives per position in top log-probs (OpenAI's limit is 20)."""


def checked_int(value: Any, field: str, *, low: int | None = None, high: int | None = None,
                default: Any = None) -> Any:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(field, f"must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise bad_request(field, f"must be in {bounds}, got {value}")
    return value


def checked_bool(value: Any, field: str, default: bool = False) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(field, f"must be true or false, got {value!r}")
    return value


def checked_token_ids(value: Any, field: str, vocab_size: int | None) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(field, "must be a list of integer token ids")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in value):
        raise bad_request(field, f"holds a token id outside the vocabulary [0, {vocab_size})")
    return value


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` (from Content-Length before
    reading, else while streaming it in), so an oversized body is never held whole or parsed."""
    length = request.headers.get("content-length")
    if length is not None:
        try:
            size = int(length)
        except ValueError:
            raise APIError(400, f"invalid Content-Length {length!r}") from None
        if size > limit:
            if size <= _DRAIN_BYTES:
                await _discard(request)
            raise APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes")
    chunks, total = [], 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                await _discard(request)
                raise APIError(413, f"request body exceeds the limit of {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        log.info("%s: the client left while sending its body (%d bytes received)", request.url.path, total)
        raise ClientGone() from None
    return b"".join(chunks)


# An oversized body up to this size is received and dropped chunk by chunk before the 413 goes out, so
# that the client, still uploading, reads the answer instead of a connection reset; beyond it the
# connection is closed at once.
_DRAIN_BYTES = 256 << 20


async def _discard(request: Request) -> None:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > _DRAIN_BYTES:
            return


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    body = await read_body(request, limit)
    if not body:
        return {}
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    field = _field_with_invalid_text(data)
    if field is not None:
        raise APIError(400, f"field {field!r} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                            "pair): not valid text", param=field)
    return data


def _field_with_invalid_text(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first key or string that is not valid Unicode text (JSON
    allows lone surrogate escapes; no tokenizer can encode them), or None. The path itself is made
    printable (a bad key is shown escaped)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = key.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(key, str) else str(key)
            where = f"{path}.{name}" if path else name
            found = (where if name != key else None) or _field_with_invalid_text(item, where)
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _field_with_invalid_text(item, f"{path}[{index}]")
            if found:
                return found
    return None


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """Refuse a weight update holding NaN or infinity (it would silently poison every later sample)."""
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise APIError(400, f"tensor {name!r} holds non-finite values (NaN or inf); update refused",
                           param=name)


class ServedModel(Protocol):
    """What the API routes read from the server that mounts them (RolloutServer): the engine, its
    tokenizer, the model's names, the request bounds and the engine bridge."""

    engine: Any
    tokenizer: Any
    model_name: str
    model_path: str | None
    tool_call_parser: str  # openai_tools.PARSERS
    started_at: int
    limits: ServerLimits
    bridge: "EngineBridge"

    @property
    def address(self) -> tuple[str, int]: ...


class ClientGone(Exception):
    """The HTTP client disconnected; its requests were aborted."""


def client_key(http: Request, user: Any = None) -> str:
    """Who a request is from, for fair admission: the OpenAI `user` field where the client names its end
    user, else its API key (hashed), else its address."""
    if isinstance(user, str) and user:
        return f"user:{user}"
    authorization = http.headers.get("authorization")
    if authorization:
        return "key:" + hashlib.sha256(authorization.encode("utf-8", "replace")).hexdigest()[:16]
    return f"host:{http.client.host if http.client else '?'}"


class FairAdmission:
    """Admission to the engine in turns across clients: at most `capacity` samples run (or wait in the
    engine's own queue) at once; past that, each client's requests wait in a queue of their own and a
    freed place goes to the next client in round-robin order, so one client's backlog delays another's
    request by at most one turn, not by the backlog. Lives on the server's event loop (not thread-safe)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.running = 0
        self.waiting: dict[str, collections.deque] = {}
        self.turns: collections.deque[str] = collections.deque()  # clients with waiting requests, in turn

    async def admit(self, client: str, samples: int, http: Request | None = None) -> None:
        """Wait for this request's turn (checking every 0.5 s that its client is still there)."""
        if self.running < self.capacity and not self.turns:
            self.running += samples
            return
        turn = asyncio.get_running_loop().create_future()
        if client not in self.waiting:
            self.waiting[client] = collections.deque()
            self.turns.append(client)
        self.waiting[client].append((turn, samples))
        self._dispatch()  # a free place held back only by turns given up since
        try:
            while not turn.done():
                await asyncio.wait([turn], timeout=0.5)
                if not turn.done() and http is not None and await http.is_disconnected():
                    raise ClientGone()
        except BaseException:
            if turn.done() and not turn.cancelled():  # admitted, but its caller is gone: hand the place on
                self.release(samples)
            else:
                turn.cancel()  # skipped when its turn comes
                self._dispatch()
            raise

    def release(self, samples: int) -> None:
        self.running -= samples
        self._dispatch()

    def _dispatch(self) -> None:
        """Give free places to the waiting requests, one client at a time, in turn."""
        while self.turns and self.running < self.capacity:
            client = self.turns.popleft()
            queue = self.waiting[client]
            turn, needed = queue.popleft()
            if queue:
                self.turns.append(client)
            else:
                del self.waiting[client]
            if turn.cancelled():
                continue
            self.running += needed
            turn.set_result(None)

    @contextlib.asynccontextmanager
    async def place(self, client: str, samples: int, http: Request | None = None):
        await self.admit(client, samples, http)
        try:
            yield
        finally:
            self.release(samples)


class EngineBridge:
    """Runs requests from asyncio handlers on the engine: every endpoint's requests join the same
    continuous batch. Each call reserves its worst-case token count against `max_queued_tokens`."""

    def __init__(self, engine: Any, limits: ServerLimits):
        self.engine = engine
        self.limits = limits
        health = engine.health()
        self.max_seq_len = int(health.get("max_seq_len") or getattr(engine, "max_seq_len", 0) or 0)
        slots = int(health.get("max_batch_size") or 32)
        self.max_queued_tokens = limits.max_queued_tokens or 16 * slots * max(self.max_seq_len, 1)
        # twice the slots: the engine always has the next sequences queued when one ends
        self.admission = FairAdmission(2 * slots)
        self._queued = 0
        self._lock = threading.Lock()
        self.streams_tokens = "on_token" in inspect.signature(engine.submit).parameters
        self.scores_prompts = hasattr(engine, "forward_logits")
        arch = getattr(engine, "arch", None)
        self.vocab_size = getattr(arch, "vocab_size", None)

    def cost(self, requests: Sequence[GenerateRequest]) -> int:
        total = 0
        for r in requests:
            budget = r.sampling.max_new_tokens
            if self.max_seq_len:
                budget = min(budget, max(self.max_seq_len - len(r.prompt_ids), 0))
            total += (len(r.prompt_ids) + budget) * r.sampling.n
        return total

    @contextlib.contextmanager
    def reserve(self, requests: Sequence[GenerateRequest]) -> Iterator[None]:
        tokens = self.cost(requests)
        with self._lock:
            if self._queued and self._queued + tokens > self.max_queued_tokens:
                raise APIError(429, f"server busy: {self._queued} tokens queued, this request needs {tokens} "
                                    f"(limit {self.max_queued_tokens}); retry later", code="queue_full")
            if tokens > self.max_queued_tokens:
                raise APIError(400, f"request needs {tokens} tokens, more than the server ever queues "
                                    f"({self.max_queued_tokens}); lower n or max_tokens", param="n")
            self._queued += tokens
        try:
            yield
        finally:
            with self._lock:
                self._queued -= tokens

    @property
    def queued_tokens(self) -> int:
        return self._queued

    def _submit(self, requests: Sequence[GenerateRequest], on_token: Any = None) -> list:
        try:
            if on_token is not None and self.streams_tokens:
                return self.engine.submit(list(requests), on_token=on_token)
            return self.engine.submit(list(requests))
        except RequestError as exc:
            raise APIError(400, str(exc), param=exc.field) from None

    async def generate(self, requests: Sequence[GenerateRequest], http: Request, client: str | None = None
                       ) -> list[Completion]:
        """All samples of `requests`, admitted in `client`'s turn (FairAdmission; by default the client is
        told by its API key or address); aborted in the engine if the client disconnects meanwhile."""
        samples = sum(r.sampling.n for r in requests)
        with self.reserve(requests):
            async with self.admission.place(client or client_key(http), samples, http):
                return await self._generate(requests, http)

    async def _generate(self, requests: Sequence[GenerateRequest], http: Request) -> list[Completion]:
        futures = [asyncio.wrap_future(f) for f in self._submit(requests)]
        ids = [r.request_id for r in requests]
        try:
            while True:
                _, pending = await asyncio.wait(futures, timeout=0.5)
                if not pending:
                    break
                if await http.is_disconnected():
                    self.engine.abort(ids)
                    raise ClientGone()
        except asyncio.CancelledError:
            self.engine.abort(ids)
            raise
        return [f.result() for f in futures]

    async def stream(self, requests: Sequence[GenerateRequest], client: str) -> AsyncIterator[tuple]:
        """Events ("token", sample, token_id, logprob, version) as tokens are sampled, then
        ("done", sample, completion) per sample (sample = index in request then sample order), once
        admitted in `client`'s turn. Leaving the iteration early (the client went away) aborts what is
        still running."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        index = {sid: i for i, sid in enumerate(sid for r in requests for sid in r.sample_ids())}

        def post(item: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def on_token(sample_id: str, token: int, logprob: float, version: int) -> None:
            post(("token", index[sample_id], token, logprob, version))

        with self.reserve(requests):
            async with self.admission.place(client, sum(r.sampling.n for r in requests)):
                futures = self._submit(requests, on_token)
                for i, future in enumerate(futures):
                    future.add_done_callback(lambda f, i=i: post(("done", i, f)))
                remaining = len(futures)
                try:
                    while remaining:
                        event = await queue.get()
                        if event[0] == "done":
                            remaining -= 1
                            event = ("done", event[1], event[2].result())
                        yield event
                finally:
                    if remaining:
                        self.engine.abort([r.request_id for r in requests])

    async def token_logprobs(self, ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per position of `ids`: (log p(ids[i] | ids[:i]), top-`top` (token, logprob) alternatives),
        None at position 0. Computed by one extra forward pass of the engine (its own weights, raw
        temperature-1 policy), serialised with its steps."""
        if not self.scores_prompts:
            raise APIError(400, "prompt log-probs and top log-probs need the native engine", param="logprobs")
        logits = await asyncio.to_thread(self.engine.forward_logits, ids)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = torch.tensor(ids[1:], dtype=torch.long)
        chosen = logprobs[:-1].gather(1, target[:, None]).squeeze(1).tolist() if len(ids) > 1 else []
        if top > 0:
            values, tokens = logprobs[:-1].topk(top, dim=-1)
            alternatives = [list(zip(t, v)) for t, v in zip(tokens.tolist(), values.tolist())]
        else:
            alternatives = [[] for _ in chosen]
        return [None] + [(lp, alt) for lp, alt in zip(chosen, alternatives)]


def version_spans(versions: list[int]) -> list[dict[str, int]]:
    """Per-token versions -> SGLang's [{version, start, end}] spans."""
    spans: list[dict[str, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def output_text(c: Completion, tokenizer: Any, stop: Sequence[str] | None, *, skip_special_tokens: bool = True,
                trim_stop: bool = True) -> tuple[str | None, int | str | None]:
    """(text, matched) of a completion, as SGLang and OpenAI report it: when a stop string ended it, the
    text ends before that string (matched: the string); when a stop token did, the text leaves that
    token out (matched: its id). `trim_stop=False` (SGLang's no_stop_trim) keeps them in the text."""
    ids = c.output_ids
    if tokenizer is None:
        return None, (ids[-1] if c.finish_reason == "stop" and ids else None)
    if c.finish_reason != "stop" or not ids:
        return decode(tokenizer, ids, skip_special_tokens), None
    full = decode(tokenizer, ids, skip_special_tokens)
    hits = [(full.find(s), s) for s in (stop or ()) if s in full]
    if hits:
        position, string = min(hits)
        return (full[:position] if trim_stop else full), string
    return (decode(tokenizer, ids[:-1], skip_special_tokens) if trim_stop else full), ids[-1]


class TextStream:
    """Incremental text of one sample while it streams: emits only text that cannot still change
    (no partial UTF-8 character at the end, nothing that may be the start of a stop string)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] | None, skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.skip = tokenizer, list(stop or ()), skip_special_tokens
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        text = decode(self.tokenizer, self.ids, self.skip)
        safe = len(text)
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1  # an incomplete multi-byte character
        if self.stop:
            hold = max(len(s) for s in self.stop) - 1
            safe = min(safe, max(len(text) - hold, self.sent))
            for s in self.stop:  # a stop string completed by this token: nothing from it on is text
                found = text.find(s)
                if found >= 0:
                    safe = min(safe, max(found, self.sent))
        piece = text[self.sent:safe]
        self.sent = max(self.sent, safe)
        return piece

    def finish(self, final_text: str | None) -> str:
        """The rest of the final (stop-trimmed) text not yet sent."""
        if final_text is None:
            return ""
        rest = final_text[self.sent:] if len(final_text) > self.sent else ""
        self.sent = max(self.sent, len(final_text))
        return rest


def finite_or_none(value: float | None) -> float | None:
    """JSON has no -inf: a log-prob of an impossible token is reported as a very large negative number."""
    if value is None:
        return None
    return value if math.isfinite(value) else -9999.0


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (GPT-2's scheme, used by SmolLM2,
    Llama 3, Qwen): printable Latin-1 bytes stand for themselves, the rest for 256 + n in order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def token_piece(tokenizer: Any, token: int) -> tuple[str, bytes]:
    """(text, bytes) of one token for log-prob listings. A token that is part of a multi-byte character
    has no text of its own: it is named "bytes:\\xNN..." as OpenAI does, so distinct tokens keep
    distinct names."""
    if tokenizer is None:
        return f"token_id:{token}", b""
    text = tokenizer.token_text(token)
    if "\ufffd" not in text:
        return text, text.encode("utf-8")
    backend = getattr(tokenizer, "hf_tokenizer", None)
    raw = backend.convert_ids_to_tokens(token) if backend is not None else None
    if isinstance(raw, str) and raw and all(ch in _BYTE_LEVEL for ch in raw):
        data = bytes(_BYTE_LEVEL[ch] for ch in raw)
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data
    return f"token_id:{token}", text.encode("utf-8")
