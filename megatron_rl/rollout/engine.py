"""The `RolloutEngine` interface every rollout backend satisfies, and its request types.

Modelled on SGLang's offline `Engine` (`sglang/srt/entrypoints/engine.py`): generation from token ids
with per-request sampling parameters, log-probs of the sampled tokens, weight updates from named
tensors in HF layout with a version number, pause / resume, abort, flush_cache, health.

Implementations: `NativeEngine` (rollout/native/, plain PyTorch, CPU or GPU), `SGLangEngine`
(rollout/sglang_engine.py, an adapter over `sglang.Engine`), `HTTPEngine` (rollout/client.py, a client
of `megatron-rl serve` or of an SGLang server). One contract suite (tests/test_rollout_contract.py)
runs against each.

Log-probs. Every engine returns, for each generated token y_t, `log softmax(z_t)[y_t]` where z_t are the
model's raw fp32 logits: temperature 1, no top-k / top-p truncation, whatever the request's sampling
parameters were. At temperature 1 without truncation that is exactly log mu(y_t), the behaviour
policy's log-prob that off-policy corrections (PPO ratio, AIPO, TIS) divide by. At other temperatures
or with truncation the token was drawn from softmax(z_t / T) restricted to the kept set, yet we still
return the raw-policy value, because (1) the trainer's pi_theta is the raw policy of the same network,
so raw-vs-raw is the only comparison in which train/rollout mismatch measures engine numerics and
staleness rather than the sampling transform, and (2) the truncated distribution's log-prob is not a
quantity any loss in this project divides by. Runs that need unbiased importance weights sample at
temperature 1 without truncation (the default SamplingParams).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from concurrent.futures import Future
from typing import Any, Iterable, Mapping, Protocol, Sequence, Union, runtime_checkable

import torch

from megatron_rl.config import require
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.types import Completion


class RequestError(ValueError):
    """A request is invalid. `field` names the offending request field (e.g. 'sampling.top_p')."""

    def __init__(self, message: str, field: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.field = field
        self.request_id = request_id


# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): at 1e-5 a logit gap of 1e-3 is already a
# factor e^100, so the distribution is one-hot to float32 precision, and much smaller ones (1e-300) become 0
# or subnormal in float32 and turn logits / T into inf and NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    """How to sample one request (SGLang's `sampling_params` names, except `seed` = `sampling_seed`)."""

    max_new_tokens: int = 128
    """Most tokens to generate; the response also ends when the context (engine max_seq_len) is full."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax of the raw logits), and so does any temperature below
    GREEDY_BELOW_TEMPERATURE (dividing float32 logits by it would overflow or lose every digit)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) keeps the whole vocabulary."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1]."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the response (included in output_ids), in addition to the tokenizer's eos."""
    stop: list[str] | None = None
    """Strings that end the response once the decoded output contains one (needs an engine tokenizer).
    The tokens up to and including the one completing the string are kept."""
    ignore_eos: bool = False
    """Do not stop at the tokenizer's eos token (explicit stop_token_ids still stop)."""
    n: int = 1
    """Independent samples of this prompt; they share a group id and get ids '<request_id>-<k>'."""
    seed: int | None = None
    """Seed of this request's private random generator: the same seed gives the same samples whatever
    else the engine is running. None draws a fresh seed."""

    @classmethod
    def for_rollouts(cls, config: RolloutConfig, seed: int | None) -> "SamplingParams":
        """Training rollouts' sampling (`rollout:` section): n = samples_per_prompt, with `seed`."""
        return cls(max_new_tokens=config.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                   top_k=config.top_k, n=config.samples_per_prompt, seed=seed, stop=list(config.stop) or None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.top_k == 0:
            self.top_k = -1
        require(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens",
                f"must be an integer >= 1, got {self.max_new_tokens!r}")
        require(_is_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        require(_is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                f"must be -1 (disabled) or >= 1, got {self.top_k!r}")
        require(_is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        require(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**63), "seed",
                f"must be a 64-bit integer or null, got {self.seed!r}")
        require(self.stop is None or all(isinstance(s, str) and s for s in self.stop), "stop",
                "must be a list of non-empty strings")
        require(self.stop_token_ids is None or all(t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    # --- SGLang's wire format -----------------------------------------------------------------------
    _SGLANG_NAMES = {"sampling_seed": "seed"}
    _IGNORED_SGLANG = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
                       "stream_interval", "min_new_tokens", "frequency_penalty", "presence_penalty",
                       "repetition_penalty"}

    @classmethod
    def from_sglang(cls, params: Mapping[str, Any] | None) -> "SamplingParams":
        """Build from an SGLang `sampling_params` dict (None values mean the default, as in SGLang).
        Unknown keys raise; penalties other than their neutral values are rejected (not implemented)."""
        if params is None:
            return cls()
        if not isinstance(params, Mapping):
            raise RequestError(f"sampling_params must be an object, got {type(params).__name__}",
                               field="sampling_params")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        neutral = {"min_new_tokens": 0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                   "repetition_penalty": 1.0}
        for key, value in params.items():
            if value is None:
                continue
            name = cls._SGLANG_NAMES.get(key, key)
            if key in cls._IGNORED_SGLANG:
                if key in neutral and value != neutral[key]:
                    raise RequestError(f"sampling_params.{key}={value!r} is not supported by this engine",
                                       field=f"sampling_params.{key}")
                continue
            if name not in fields:
                raise RequestError(f"unknown sampling parameter {key!r}", field=f"sampling_params.{key}")
            kwargs[name] = value
        try:
            return cls(**kwargs)
        except ValueError as exc:
            field = getattr(exc, "field", None)
            raise RequestError(str(exc).replace("field '", "field 'sampling_params.", 1),
                               field=f"sampling_params.{field}" if field else "sampling_params") from None

    def to_sglang(self) -> dict[str, Any]:
        """The SGLang `sampling_params` dict for these settings (one sample: n is sent separately)."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                               "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                               "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.n != 1:
            out["n"] = self.n
        return out


@dataclasses.dataclass
class GenerateRequest:
    """One prompt to complete (n samples of it)."""

    request_id: str
    """Unique id; samples of an n > 1 request get '<request_id>-<k>'."""
    prompt_ids: list[int]
    """Prompt token ids, length P >= 1 (the chat template already applied)."""
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    """Sampling parameters."""
    group_id: str = ""
    """Group id copied into each Completion (defaults to request_id)."""

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.request_id

    def sample_ids(self) -> list[str]:
        n = self.sampling.n
        return [self.request_id] if n == 1 else [f"{self.request_id}-{k}" for k in range(n)]


RequestLike = Union[GenerateRequest, Sequence[int]]
NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]],
                     Iterable[Mapping[str, torch.Tensor]]]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the generator executor needs from a rollout backend. All methods are thread-safe."""

    def generate(self, requests: Sequence[RequestLike]) -> list[Completion]:
        """Complete every request (blocking); one Completion per sample, in request order then sample
        order. Invalid requests raise RequestError (a ValueError naming the field) before any work."""
        ...

    def submit(self, requests: Sequence[RequestLike]) -> list[Future]:
        """Queue requests without blocking; one Future[Completion] per sample. Requests join the
        running batch as slots free, so a caller that keeps submitting keeps the batch full."""
        ...

    def wait(self, futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
        """Results of submitted futures, in order. An engine that computes in this process may run its
        steps on the calling thread meanwhile (faster than handing them to a background thread)."""
        ...

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Load HF-named tensors (a dict, (name, tensor) pairs, or an iterable of dict buckets) and set
        the weight version. Applied between two decoding steps, atomically with respect to them."""
        ...

    def pause(self) -> None:
        """Stop stepping; running requests keep their state, new requests queue."""
        ...

    def resume(self) -> None:
        """Continue after pause()."""
        ...

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """End the given requests (ids or parent ids of n > 1 requests; None = all) with finish_reason
        'abort' and the tokens generated so far."""
        ...

    def flush_cache(self) -> bool:
        """Drop cached KV state; False (nothing done) while requests are running."""
        ...

    def health(self) -> dict[str, Any]:
        """{'ok': bool, 'version': int, 'running': int, 'waiting': int, 'paused': bool, ...}."""
        ...

    @property
    def version(self) -> int:
        """The weight version new tokens are generated with."""
        ...

    def close(self) -> None:
        """Release the engine (threads, memory, processes)."""
        ...


def as_request(item: RequestLike, index: int) -> GenerateRequest:
    """Accept plain token-id lists next to GenerateRequest (default sampling, id 'req-<index>')."""
    if isinstance(item, GenerateRequest):
        return item
    if isinstance(item, (list, tuple)) or (isinstance(item, torch.Tensor) and item.dim() == 1):
        return GenerateRequest(request_id=f"req-{index}", prompt_ids=[int(t) for t in item])
    raise RequestError(f"request {index}: expected a GenerateRequest or a list of token ids, "
                       f"got {type(item).__name__}", field="prompt_ids")


def as_requests(requests: Sequence[RequestLike] | GenerateRequest) -> list[GenerateRequest]:
    """One request or a sequence of request-likes, as GenerateRequests (see `as_request`)."""
    if isinstance(requests, GenerateRequest):
        return [requests]
    return [as_request(item, i) for i, item in enumerate(requests)]


def submit_each(requests: Sequence[RequestLike] | GenerateRequest, launch) -> list[Future]:
    """One Future per sample, for engines that serve a request as a whole: `launch(request)` returns a
    future of the request's n completions, which are fanned out to the samples' futures."""
    futures: list[Future] = []
    for request in as_requests(requests):
        samples = [Future() for _ in range(request.sampling.n)]
        futures.extend(samples)
        launch(request).add_done_callback(lambda done, samples=samples: fan_out_samples(done, samples))
    return futures


def validate_request(request: GenerateRequest, *, vocab_size: int, max_seq_len: int,
                     has_tokenizer: bool = True) -> None:
    """Checks shared by every engine; raise RequestError naming the request and the field."""
    rid = request.request_id

    def fail(field: str, message: str) -> None:
        raise RequestError(f"request {rid!r}: field '{field}': {message}", field=field, request_id=rid)

    if not isinstance(rid, str) or not rid:
        fail("request_id", "must be a non-empty string")
    if not isinstance(request.sampling, SamplingParams):
        fail("sampling", f"must be SamplingParams, got {type(request.sampling).__name__}")
    ids = request.prompt_ids
    if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
        fail("prompt_ids", "must be a list of integer token ids")
    if len(ids) == 0:
        fail("prompt_ids", "is empty (a prompt needs at least one token)")
    if len(ids) >= max_seq_len:
        fail("prompt_ids", f"has {len(ids)} tokens but the context holds {max_seq_len} "
                           f"(prompt plus at least one generated token)")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        fail("prompt_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if request.sampling.stop_token_ids and any(t >= vocab_size for t in request.sampling.stop_token_ids):
        fail("sampling.stop_token_ids", f"token ids must be < vocab size {vocab_size}")
    if request.sampling.stop and not has_tokenizer:
        fail("sampling.stop", "stop strings need an engine built with a tokenizer")


def iter_named_tensors(named_tensors: NamedTensors) -> Iterable[tuple[str, torch.Tensor]]:
    """Flatten a dict, an iterable of (name, tensor) pairs or an iterable of dict buckets."""
    if isinstance(named_tensors, Mapping):
        yield from named_tensors.items()
        return
    for item in named_tensors:
        if isinstance(item, Mapping):
            yield from item.items()
        elif isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            yield item[0], item[1]
        else:
            raise ValueError("update_weights: expected a dict of tensors, (name, tensor) pairs or "
                             f"dict buckets; got an item of type {type(item).__name__}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def wait_all(futures: Sequence[Future], timeout: float | None = None) -> list[Completion]:
    """`RolloutEngine.wait` for engines whose futures are resolved by another thread or process."""
    return [f.result(timeout=timeout) for f in futures]


def fan_out_samples(call: Any, samples: list[Future]) -> None:
    """Resolve the per-sample futures of one request from the future of its whole call (its result
    is the request's list of completions, in sample order; an error fails every sample)."""
    error = call.exception()
    if error is not None:
        for future in samples:
            future.set_exception(error)
        return
    for future, completion in zip(samples, call.result()):
        future.set_result(completion)


def caller_driven(*engines: Any) -> contextlib.ExitStack:
    """While open, in-process engines run steps only in threads that wait on their results, never
    in its background thread. Requests submitted one by one (WaltzRL's episodes, each turn from the
    previous turn's callback) then share batches by the order of submission alone, not by thread
    timing, and since a row's last bits depend on its batch, a synchronous run is reproducible bit
    for bit (a resumed run ends with the weights of an uninterrupted one). Engines that compute
    elsewhere (servers, generator processes) batch as requests arrive: a no-op for them."""
    stack = contextlib.ExitStack()
    for engine in engines:
        hold = getattr(engine, "caller_driven", None)
        if hold is not None:
            stack.enter_context(hold())
    return stack
