"""The scheduler of the native engine: what one step computes on the per-slot KV cache (kv_cache.py).

Slots. A running sequence owns one slot; slots in use are kept dense at [0, n_running) by moving the
last sequence into a freed slot, so the decode rows' cache is a strided view, not a gather.

Scheduling (one step = one forward pass): every running sequence that has finished its prompt feeds
its last sampled token (decode), and sequences still in their prompt contribute the next chunk of it
(chunked prefill) up to `max_prefill_tokens` per step, all packed into one [N, hidden] batch. Waiting
requests take slots as soon as finished ones free them (continuous batching), so a caller that keeps
submitting keeps the batch full. A new request whose prompt shares a prefix with a running one
(n samples of a prompt, a common system prompt) copies that prefix's K/V instead of recomputing it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent.futures import Future

import torch

from megatron_rl.rollout.engine import SamplingParams
from megatron_rl.rollout.native.model import _Batch
from megatron_rl.rollout.native.moe import routing_record, store_routing
from megatron_rl.rollout.native.sampling import sample_tokens
from megatron_rl.types import Completion

log = logging.getLogger(__name__)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit` (list slices compare in C)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclasses.dataclass
class _Plan:
    """What one step computes: decode rows, prompt chunks (seq, start, length), prefix copies
    (seq, donor, length) done first, and the weights epoch it was planned under."""

    decode: list["_Seq"]
    chunks: list[tuple["_Seq", int, int]]
    copies: list[tuple["_Seq", "_Seq", int]]
    epoch: int


class _Seq:
    """One sample in flight (owned by the step thread once admitted)."""

    def __init__(self, sample_id: str, parent_id: str, group_id: str, prompt: list[int],
                 params: SamplingParams, seed: int, stop_ids: frozenset[int], future: Future):
        self.sample_id, self.parent_id, self.group_id = sample_id, parent_id, group_id
        self.prompt, self.params, self.seed, self.stop_ids, self.future = prompt, params, seed, stop_ids, future
        self.output: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.prefilled = 0
        self.slot = -1
        self.generator: torch.Generator | None = None
        self.aborted = False
        self.finish: str | BaseException | None = None
        self.donor: _Seq | None = None      # running sequence whose prompt-prefix K/V we will copy
        self.share_len = 0
        self.kv_epoch: int | None = None     # weights epoch of our prompt K/V (-1: mixed)
        self.on_token = None                 # streaming listener (sample_id, token, logprob, version)
        self.routing = None                  # MoE routing record buffer (moe.py), when recording

    def completion(self) -> Completion:
        return Completion(request_id=self.sample_id, prompt_ids=list(self.prompt), output_ids=self.output,
                          output_logprobs=self.logprobs, weight_versions=self.versions,
                          finish_reason=self.finish or "abort", group_id=self.group_id,
                          routed_experts=routing_record(self))


class _Scheduler:
    """The step half of `NativeEngine` (a mixin: engine.py holds the state these methods use, set up in
    `NativeEngine.__init__`, and the threads that call `_step_once`). Methods run on the driver thread;
    those that touch the shared queues are called with `_cv` held."""

    def _step_once(self) -> bool:
        """One scheduling step (the caller holds the driver lock). False when nothing could be done."""
        weights = self.weights
        if weights is not None and weights.packing_pending:
            # Adopted weights are re-packed before any step (a step on a partly re-packed model would round
            # differently, so numerics would depend on timing), a few layers at a time, so that a weight
            # update waits for one chunk, not for the whole model (`bench sync`: engine load 0.47 -> 0.05 s).
            with self._cv:
                update_waiting = bool(self._hold)
            if not update_waiting:
                with self._model_lock:
                    if self.core_share is not None:
                        with self.core_share.working():  # on this side's share while the trainer trains
                            weights.pack_pending(limit=4)
                    else:
                        weights.pack_pending(limit=4)
                return True
        started = time.perf_counter()
        finished: list[_Seq] = []
        with self._cv:
            finished += self._reap_aborted()
            plan = None
            if self._can_step() and not self._closing:
                self._admit()
                plan = self._plan()
        self._resolve(finished)
        if self.core_share is not None:
            self.core_share.set_busy(plan is not None)
        if plan is None:
            return bool(finished)
        with self._model_lock:
            with self._cv:
                # an update, pause or close since planning: re-plan (planning has no side effects)
                runnable = not (self._paused or self._hold or self._closing) and self._epoch == plan.epoch
                version = self._version
            if not runnable or self.weights.packing_pending:  # weights adopted since the check above
                return True
            try:
                if self.core_share is not None:
                    self._stats[f"steps_on_{self.core_share.apply()}_threads"] += 1
                tokens, logprobs = self._execute(plan)
                error = None
            except Exception as exc:  # a bug or out-of-memory: fail this step's requests, keep serving
                log.exception("native engine step failed")
                error = exc
        with self._cv:
            if error is not None:
                self._last_error = f"{type(error).__name__}: {error}"
                finished = self._fail(plan.decode + [c[0] for c in plan.chunks], error)
            else:
                finished = self._apply(plan, tokens, logprobs, version)
        self._resolve(finished)
        if error is None and not plan.chunks and not plan.copies:
            # pure decode steps, planning to delivery: the phase a decode roofline describes
            self._stats["decode_steps"] += 1
            self._stats["decode_tokens"] += len(plan.decode)
            self._stats["decode_seconds"] += time.perf_counter() - started
        return True

    def _resolve(self, seqs: list[_Seq]) -> None:
        for seq in seqs:
            if isinstance(seq.finish, BaseException):
                if not seq.future.done():
                    seq.future.set_exception(seq.finish)
            elif not seq.future.done():
                seq.future.set_result(seq.completion())

    def _reap_aborted(self) -> list[_Seq]:
        if not self._abort_pending:
            return []
        self._abort_pending = False
        done = [s for s in self._waiting if s.aborted]
        if done:
            self._waiting = collections.deque(s for s in self._waiting if not s.aborted)
        running = [s for s in self._running if s.aborted]
        self._release(running)
        for seq in done + running:
            seq.finish = "abort"
        self._stats["aborted"] += len(done) + len(running)
        return done + running

    def _admit(self) -> None:
        min_share = self.config.prefix_sharing_min_tokens
        while self._waiting and len(self._running) < self.kv_cache.slots:
            seq = self._waiting.popleft()
            if not seq.future.set_running_or_notify_cancel():
                continue  # the caller cancelled the future while it waited
            seq.slot = len(self._running)
            seq.generator = None
            if not seq.params.greedy:
                seq.generator = torch.Generator(device=self.device)
                seq.generator.manual_seed(seq.seed)
            if min_share:
                # the running sequence sharing the longest prompt prefix (the last prompt token is
                # always computed by the sequence itself: its logits give the first sample)
                best, best_len = None, min_share - 1
                limit = len(seq.prompt) - 1
                for other in self._running:
                    if other.donor is not None or (other.kv_epoch is not None and other.kv_epoch != self._epoch):
                        continue  # no chains of waiting sequences; no prefixes of older weights
                    if self._prompt_rope_len(other) != self._prompt_rope_len(seq):
                        continue  # dynamic RoPE: its prompt was rotated with other frequencies
                    length = _common_prefix(seq.prompt, other.prompt, limit)
                    if length > best_len:
                        best, best_len = other, length
                if best is not None:
                    seq.donor, seq.share_len = best, best_len
            self._running.append(seq)

    def _prompt_rope_len(self, seq: _Seq) -> int:
        """The length whose dynamic-RoPE frequencies rotate `seq`'s prompt (0: not dynamic or within
        the plain range, where every prompt shares the same frequencies)."""
        base = self._dynamic_rope_base
        return 0 if base is None or len(seq.prompt) <= base else len(seq.prompt)

    def _plan(self) -> "_Plan | None":
        decode = [s for s in self._running if s.prefilled == len(s.prompt)]
        budget = self.config.max_prefill_tokens
        chunks, copies = [], []
        for seq in self._running:
            if budget <= 0:
                break
            if seq.prefilled >= len(seq.prompt):
                continue
            start = seq.prefilled
            donor = seq.donor
            if donor is not None:
                if donor.slot < 0 or donor.kv_epoch == -1 or (donor.kv_epoch is not None and donor.kv_epoch != self._epoch):
                    seq.donor = None  # the donor left or its prefix is stale: compute it ourselves
                elif not self.kv_cache.holds_window_before(donor.slot, seq.share_len):
                    seq.donor = None  # the donor has moved on past the window the prefix needs
                elif donor.prefilled >= seq.share_len and donor.kv_epoch == self._epoch:
                    copies.append((seq, donor, seq.share_len))
                    start = seq.share_len
                else:
                    continue  # wait a step for the donor to compute the shared prefix
            length = min(len(seq.prompt) - start, budget)
            chunks.append((seq, start, length))
            budget -= length
        if not decode and not chunks:
            return None
        return _Plan(decode, chunks, copies, self._epoch)

    def _execute(self, plan: "_Plan") -> tuple[list[int], list[float]]:
        decode, chunks = plan.decode, plan.chunks
        kv = self.kv_cache
        kv.ensure()
        for seq, donor, length in plan.copies:
            kv.copy_prefix(seq.slot, donor.slot, length)
        self._stats["shared_prefix_tokens"] += sum(length for _, _, length in plan.copies)
        dev = self.device
        tokens: list[int] = [s.output[-1] for s in decode]
        positions: list[int] = [len(s.prompt) + len(s.output) - 1 for s in decode]
        slots = [s.slot for s in decode]
        lens = [p + 1 for p in positions]
        logit_rows = list(range(len(decode)))
        # dynamic RoPE: prompt rows take the frequencies of the whole prompt's length (one forward in
        # transformers' generate), an answer token at position p those of length p + 1
        rope_lens = list(lens) if self._dynamic_rope_base is not None else None
        packed_chunks = []
        offset = len(decode)
        for seq, start, length in chunks:
            tokens.extend(seq.prompt[start:start + length])
            positions.extend(range(start, start + length))
            if rope_lens is not None:
                rope_lens.extend([len(seq.prompt)] * length)
            packed_chunks.append((offset, seq.slot, start, length))
            if start + length == len(seq.prompt):
                logit_rows.append(offset + length - 1)
            offset += length
        if decode:
            kv.cover_decode(decode, max(lens))  # no uninitialised memory where decode attention reads
        for seq, start, length in chunks:
            kv.mark_written(seq.slot, start + length)
        contiguous = slots == list(range(slots[0], slots[0] + len(slots))) if slots else False
        batch = _Batch(tokens=torch.tensor(tokens, device=dev), positions=torch.tensor(positions, device=dev),
                       dec_slots=torch.tensor(slots, dtype=torch.long, device=dev),
                       dec_lens=torch.tensor(lens, dtype=torch.long, device=dev),
                       dec_first_slot=slots[0] if contiguous else -1, chunks=packed_chunks,
                       logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=dev),
                       rope_lens=None if rope_lens is None else torch.tensor(rope_lens, dtype=torch.long, device=dev))
        record = self.config.record_routing and self.arch.is_moe
        if record:
            # dense layers among the MoE ones keep NO_RECORD (-1): no expert chosen there
            batch.routing = torch.full((len(tokens), self.arch.num_layers, self.arch.moe_top_k), -1, dtype=torch.int16)
        logits = self.model.forward(batch, kv, float_logits=False)  # (sample_tokens widens them)
        if kv.drops:  # sliding-window layers: give back keys no later query reads, nor a waiting prefix copy
            pinned: dict[int, int] = {}
            for seq in self._running:
                if seq.donor is not None and seq.donor.slot >= 0:
                    pinned[seq.donor.slot] = min(pinned.get(seq.donor.slot, seq.share_len), seq.share_len)
            for seq, position in zip(decode, positions):
                kv.drop_behind(seq.slot, min(position + 1, pinned.get(seq.slot, position + 1)))
            for seq, start, length in chunks:
                kv.drop_behind(seq.slot, min(start + length, pinned.get(seq.slot, start + length)))
        if record:
            store_routing(batch.routing, self.arch, self.max_seq_len, decode, chunks, plan.copies)
        sampling = decode + [seq for seq, start, length in chunks if start + length == len(seq.prompt)]
        self._stats["steps"] += 1
        if not sampling:
            return [], []
        toks, lps = sample_tokens(logits, [s.params for s in sampling], [s.generator for s in sampling],
                                  self.model.kernels)
        return toks.tolist(), lps.tolist()

    def _apply(self, plan: "_Plan", tokens: list[int], logprobs: list[float], version: int) -> list[_Seq]:
        for seq, donor, length in plan.copies:
            seq.donor = None
            seq.kv_epoch = plan.epoch
        for seq, start, length in plan.chunks:
            seq.prefilled = start + length
            if seq.kv_epoch is None:
                seq.kv_epoch = plan.epoch
            elif seq.kv_epoch != plan.epoch:
                seq.kv_epoch = -1  # prompt K/V from two weight versions: never share it
        sampling = plan.decode + [seq for seq, start, length in plan.chunks if start + length == len(seq.prompt)]
        finished = []
        for seq, token, logprob in zip(sampling, tokens, logprobs):
            if seq.aborted:
                continue  # reaped below with the tokens it had
            seq.output.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(version)
            if seq.on_token is not None:
                seq.on_token(seq.sample_id, token, logprob, version)
            reason = self._finish_reason(seq, token)
            if reason:
                seq.finish = reason
                finished.append(seq)
        self._stats["generated_tokens"] += len(tokens)
        self._release(finished)
        self._stats["completed"] += len(finished)
        return finished + self._reap_aborted()

    def _finish_reason(self, seq: _Seq, token: int) -> str | None:
        if token in seq.stop_ids:
            return "stop"
        if seq.params.stop and self.tokenizer is not None:
            longest = max(len(s) for s in seq.params.stop)
            tail = self.tokenizer.decode(seq.output[-(4 * longest + 4):])
            if any(s in tail for s in seq.params.stop):
                return "stop"
        if len(seq.output) >= seq.params.max_new_tokens or len(seq.prompt) + len(seq.output) >= self.max_seq_len:
            return "length"
        return None

    def _release(self, seqs: list[_Seq]) -> None:
        """Free the slots of `seqs`, moving the last running sequence into each hole (dense slots)."""
        for seq in sorted(seqs, key=lambda s: s.slot, reverse=True):
            hole = seq.slot
            last = self._running.pop()
            if last is not seq:
                # cache positions holding K/V: the prompt so far, plus every output token but the last
                used = last.prefilled + max(len(last.output) - 1, 0)
                if self.kv_cache.allocated and used:
                    self.kv_cache.copy_prefix(hole, last.slot, used)
                self._running[hole] = last
                last.slot = hole
            seq.slot = -1
        if seqs and not self._waiting:  # nobody waits for the freed slots: their memory goes back
            self.kv_cache.return_pages(range(len(self._running), self.kv_cache.slots))

    def _fail(self, seqs: list[_Seq], error: BaseException) -> list[_Seq]:
        seqs = [s for s in dict.fromkeys(seqs) if s.slot >= 0]
        self._release(seqs)
        for seq in seqs:
            seq.finish = RuntimeError(f"native engine step failed: {type(error).__name__}: {error}")
        return seqs
