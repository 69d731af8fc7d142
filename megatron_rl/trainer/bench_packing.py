"""`megatron-rl bench packing`: trainer tokens/s with sequence packing and token-budget micro-batches against
the padded path, on one length-skewed batch, in one process.

The batch: `rows` sequences whose lengths are log-normal around `median` tokens, clipped to [`min_len`,
`max_len`] (agent episodes and reasoning traces spread over two orders of magnitude); the loss reads each
row's last three quarters (the response). The padded side is the trainer's default path: rows sorted
longest first (as `controller/batching.py` builds them), `micro_batch_size` rows per micro-batch, each trimmed
after its last loss column. The packed side fills micro-batches of up to `budget` tokens. Both take the same
optimizer step (fp32, lr 0, so both see the same weights every step); steps alternate after a warm-up each and
each side reports its median. Also reported: the largest activation memory a micro-batch saves for backward
(bytes of the tensors autograd keeps, counted once per storage), and the largest log-prob, loss and gradient
differences between the two sides.
"""
from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.packing import row_extents
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch

log = logging.getLogger(__name__)

OPTIONS = ("model", "rows", "median", "min_len", "max_len", "micro_batch_size", "budget", "steps", "threads", "seed")


def skewed_batch(rows: int, median: int, min_len: int, max_len: int, vocab: int, seed: int) -> TrainBatch:
    """Rows of log-normal lengths (sigma 1) around `median`, clipped, longest first; loss on the last 3/4."""
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randn(rows, generator=g) + math.log(median)).exp().round().clamp(min_len, max_len).long()
    lengths = lengths.sort(descending=True).values.tolist()
    width = lengths[0]
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    mask = torch.zeros(rows, width)
    for r, n in enumerate(lengths):
        mask[r, n // 4:n] = 1.0
    return TrainBatch(tokens=tokens, loss_mask=mask)


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward during a forward (each storage once), the weights'
    own storages left out."""

    def __init__(self, module: torch.nn.Module):
        self.storages: dict[int, int] = {}
        self.weights = {p.untyped_storage().data_ptr() for p in module.parameters()}

    def __enter__(self):
        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.weights:
                self.storages[storage.data_ptr()] = storage.nbytes()
            return t
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def bench_packing(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"bench packing: unknown option(s) {unknown} (known: {', '.join(OPTIONS)})")
    rows, median = int(options.get("rows", 32)), int(options.get("median", 128))
    min_len, max_len = int(options.get("min_len", 32)), int(options.get("max_len", 2048))
    micro, budget = int(options.get("micro_batch_size", 4)), int(options.get("budget", 4096))
    steps, threads, seed = int(options.get("steps", 2)), int(options.get("threads", 2)), int(options.get("seed", 0))
    if min(rows, median, min_len, micro, budget, steps, threads) < 1 or not min_len <= median <= max_len:
        raise ConfigError("bench packing: sizes must be >= 1 and min_len <= median <= max_len")
    if rows % micro:
        raise ConfigError(f"bench packing: rows={rows} must be a multiple of micro_batch_size={micro} (the padded side "
                          f"takes whole micro-batches)")
    torch.set_num_threads(threads)
    model = load_pretrained(str(options.get("model", "smollm2-135m")))
    batch = skewed_batch(rows, median, min_len, max_len, model.arch.vocab_size, seed)
    real_tokens = int(row_extents(batch).sum())
    normalizer = batch.loss_mask.sum()

    def trainer(**packing) -> MegatronTrainer:
        config = TrainerConfig(micro_batch_size=micro, lr=0.0, precision="fp32", **packing)
        return MegatronTrainer(model.arch, config, hf_state=model.state)

    sides = {"padded": trainer(), "packed": trainer(sequence_packing=True, max_tokens_per_micro_batch=budget)}
    padded_micro = sides["padded"]._micro_batches(batch, True)[0]
    micro_batches = {"padded": len(padded_micro), "packed": len(sides["packed"]._micro_batches(batch, True)[0])}
    computed = {"padded": sum(mb.batch_size * (mb.seq_length - 1) for mb in padded_micro), "packed": real_tokens}
    saved = {}

    def loss_fn(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask).sum() / normalizer, {}

    def step(name):
        return sides[name].train_step(batch, loss_fn)

    # untimed: activation memory per micro-batch, and the two sides' results on the same weights
    results = {}
    for name, side in sides.items():
        peaks = []
        original = side._run_schedule

        def measured(micro_list, on_hidden, forward_only, packed=False, original=original):
            def head(hidden, tokens, mb):
                peaks.append(counter.total)
                counter.storages.clear()
                return on_hidden(hidden, tokens, mb)
            return original(micro_list, head, forward_only, packed)

        side._run_schedule = measured
        with _SavedBytes(side.model) as counter:
            metrics = step(name)
        side._run_schedule = original
        saved[name] = max(peaks)
        grads = {n: p.main_grad.clone() for n, p in side.model.named_parameters()}
        results[name] = (side.compute_logprobs(batch) * batch.loss_mask, metrics["train/loss"], grads)
    (lp0, loss0, grads0), (lp1, loss1, grads1) = results["padded"], results["packed"]
    logprob_diff = float((lp1 - lp0).abs().max())
    grad_diff = max(float((grads1[n] - grads0[n]).abs().max()) for n in grads0)
    grad_scale = max(float(g.abs().max()) for g in grads0.values())

    times: dict[str, list[float]] = {"padded": [], "packed": []}
    for _ in range(steps):
        for name in times:
            start = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - start)
    padded_s, packed_s = statistics.median(times["padded"]), statistics.median(times["packed"])
    ours, theirs = real_tokens / packed_s, real_tokens / padded_s
    log.info(f"packed: {packed_s:.2f} s/step = {ours:.0f} tok/s in {micro_batches['packed']} micro-batches of <= "
             f"{budget} tokens; padded: {padded_s:.2f} s/step = {theirs:.0f} tok/s in {micro_batches['padded']} "
             f"micro-batches of {micro} rows ({computed['padded']} token positions computed for {real_tokens} real); "
             f"activations saved per micro-batch {saved['packed'] / 2**20:.0f} MiB packed, "
             f"{saved['padded'] / 2**20:.0f} MiB padded; max |log-prob difference| {logprob_diff:.2g}")
    return {"ratio": round(ours / theirs, 3), "tokens_per_s": round(ours, 1), "padded_tokens_per_s": round(theirs, 1),
            "packed_step_s": round(packed_s, 3), "padded_step_s": round(padded_s, 3),
            "packed_steps_s": [round(s, 3) for s in times["packed"]],
            "padded_steps_s": [round(s, 3) for s in times["padded"]],
            "real_tokens": real_tokens, "padded_computed_tokens": computed["padded"],
            "micro_batches": micro_batches, "packed_activation_mib": round(saved["packed"] / 2**20, 1),
            "padded_activation_mib": round(saved["padded"] / 2**20, 1),
            "activation_ratio": round(saved["padded"] / max(saved["packed"], 1), 3),
            "max_logprob_diff": logprob_diff, "loss_diff": abs(loss1 - loss0), "max_grad_diff": grad_diff,
            "max_grad": grad_scale, "rows": rows, "median": median, "min_len": min_len, "max_len": max_len,
            "micro_batch_size": micro, "budget": budget, "threads": threads, "steps": steps, "model": model.arch.family}
