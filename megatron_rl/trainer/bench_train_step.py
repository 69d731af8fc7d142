"""`megatron-rl bench trainer`: Megatron trainer forward+backward+Adam tokens/s against HF transformers'
model on the same SmolLM2 batch, in one process (8 x 256 tokens), and against the machine's training roofline
(observability/roofline.py: 6 x params x tokens flops plus attention at the measured matmul ceiling).

The two trainers' steps alternate (Megatron, HF, Megatron, HF, ...) after one warm-up step each, and each
side reports its median step: load from other processes on a shared machine then falls on both sides
instead of on whichever ran during it."""
from __future__ import annotations

import logging
import statistics
import time

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models import families
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.observability.roofline import (
    measure_ceilings,
    roofline_fields,
    roofline_line,
    train_roofline,
)
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.types import TrainBatch

log = logging.getLogger(__name__)

OPTIONS = ("batch", "seq", "steps", "threads", "model")


def _seconds(step) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one step (CPU time is the steadier figure while other
    processes share the cores, as long as threads do not spin-wait for each other)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - start, time.process_time() - cpu_start


def language_model_batch(vocab_size: int, rows: int, length: int) -> TrainBatch:
    """The benches' batch: random tokens (seed 0), a loss on every position but the first."""
    tokens = torch.randint(0, vocab_size, (rows, length), generator=torch.Generator().manual_seed(0))
    return TrainBatch(tokens=tokens, loss_mask=torch.ones(rows, length).index_fill_(1, torch.tensor([0]), 0.0))


def bench_trainer(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"bench trainer: unknown option(s) {unknown} (known: {', '.join(OPTIONS)})")
    rows, length = int(options.get("batch", 8)), int(options.get("seq", 256))
    steps = int(options.get("steps", 2))
    threads = int(options.get("threads", 2))
    if min(rows, length - 1, steps, threads) < 1:
        raise ConfigError("bench trainer: batch, steps and threads must be >= 1 and seq >= 2")
    torch.set_num_threads(threads)
    model = load_pretrained(str(options.get("model", "smollm2-135m")))
    batch = language_model_batch(model.arch.vocab_size, rows, length)
    tokens, normalizer = batch.tokens, batch.loss_mask.sum()
    lr = 1e-6

    trainer = MegatronTrainer(model.arch, TrainerConfig(micro_batch_size=rows, lr=lr, clip_grad=1.0),
                              hf_state=model.state)
    lm_loss = lambda logprobs, mb, entropy: (-(logprobs * mb.loss_mask).sum() / normalizer, {})

    def megatron_step():
        trainer.train_step(batch, lm_loss)

    import transformers  # the baseline only (dev extra), never the library's code path

    config = transformers.LlamaConfig(**{k: v for k, v in families.to_hf_config(model.arch).items()
                                         if k not in ("architectures", "model_type", "torch_dtype")})
    hf = transformers.LlamaForCausalLM(config)
    hf.load_state_dict(model.state, strict=False)
    hf.train()
    optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)

    def hf_step():
        optimizer.zero_grad(set_to_none=True)
        logits = hf(tokens[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
        loss = -(logprobs * batch.loss_mask[:, 1:]).sum() / normalizer
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        optimizer.step()

    megatron_step()  # warm-up: allocator, autograd graph caches, optimizer state
    hf_step()
    megatron_timed, hf_timed = [], []
    for _ in range(steps):
        megatron_timed.append(_seconds(megatron_step))
        hf_timed.append(_seconds(hf_step))
    ours_s, theirs_s = [wall for wall, _ in megatron_timed], [wall for wall, _ in hf_timed]
    megatron_step_s, hf_step_s = statistics.median(ours_s), statistics.median(theirs_s)
    megatron_cpu_s = statistics.median(cpu for _, cpu in megatron_timed)
    hf_cpu_s = statistics.median(cpu for _, cpu in hf_timed)

    tokens_per_step = rows * length
    ours, theirs = tokens_per_step / megatron_step_s, tokens_per_step / hf_step_s
    log.info(f"megatron trainer: {megatron_step_s:.2f} s/step = {ours:.0f} tok/s; "
             f"HF transformers: {hf_step_s:.2f} s/step = {theirs:.0f} tok/s "
             f"({rows} x {length} tokens, fwd+bwd+Adam, fp32, {threads} threads, median of {steps} alternating steps)")
    ceilings = measure_ceilings(threads=threads)
    roofline = train_roofline(model.arch, tokens_per_step, ceilings, sequence_length=length)
    log.info(roofline_line("megatron trainer", ours, roofline, ceilings))
    return {"ratio": round(ours / theirs, 3), "tokens_per_s": round(ours, 1), "hf_tokens_per_s": round(theirs, 1),
            "batch": rows, "seq": length, "threads": threads, "steps": steps,
            "megatron_step_s": round(megatron_step_s, 3), "hf_step_s": round(hf_step_s, 3),
            "megatron_steps_s": [round(s, 3) for s in ours_s], "hf_steps_s": [round(s, 3) for s in theirs_s],
            "megatron_cpu_s": round(megatron_cpu_s, 3), "hf_cpu_s": round(hf_cpu_s, 3),
            "cpu_ratio": round(hf_cpu_s / megatron_cpu_s, 3),
            **roofline_fields(ours, roofline, ceilings)}
