"""`megatron-rl bench lora`: a LoRA trainer (trainer.lora, rank r on every linear) against full training of the
same SmolLM2 model on the same batch, in one process: step time (forward + backward + Adam), the bytes each
holds for gradients and optimizer state, and the bytes of a weight sync (the merged weights every engine gets
today, and the adapters alone). Steps alternate (LoRA, full, LoRA, ...) after one warm-up step each; each side
reports its median."""
from __future__ import annotations

import logging
import statistics
import time

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.trainer.bench_train_step import language_model_batch
from megatron_rl.trainer.config import LoraConfig, TrainerConfig
from megatron_rl.trainer.trainer import MegatronTrainer

log = logging.getLogger(__name__)

OPTIONS = ("batch", "seq", "steps", "threads", "rank", "model")


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_lora(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"bench lora: unknown option(s) {unknown} (known: {', '.join(OPTIONS)})")
    rows, length = int(options.get("batch", 8)), int(options.get("seq", 256))
    steps, threads, rank = int(options.get("steps", 3)), int(options.get("threads", 2)), int(options.get("rank", 8))
    if min(rows, length - 1, steps, threads, rank) < 1:
        raise ConfigError("bench lora: batch, steps, threads and rank must be >= 1 and seq >= 2")
    torch.set_num_threads(threads)
    model = load_pretrained(str(options.get("model", "smollm2-135m")))
    batch = language_model_batch(model.arch.vocab_size, rows, length)
    normalizer = batch.loss_mask.sum()

    def loss(logprobs, mb, entropy):
        return -(logprobs * mb.loss_mask).sum() / normalizer, {}

    trainers = {
        "lora": MegatronTrainer(model.arch, TrainerConfig(micro_batch_size=rows, lr=1e-4, lora=LoraConfig(rank=rank)),
                                hf_state=model.state),
        "full": MegatronTrainer(model.arch, TrainerConfig(micro_batch_size=rows, lr=1e-5), hf_state=model.state),
    }
    timed: dict[str, list[float]] = {name: [] for name in trainers}
    for name, trainer in trainers.items():  # warm-up: allocator, autograd graph caches, optimizer state
        trainer.train_step(batch, loss)
    for _ in range(steps):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(batch, loss)
            timed[name].append(time.perf_counter() - start)
    lora_trainer = trainers["lora"]
    start = time.perf_counter()
    merged = lora_trainer.shard_state()
    merge_s = time.perf_counter() - start
    memory = {name: trainer.memory_bytes() for name, trainer in trainers.items()}
    trainable = {name: sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
                 for name, trainer in trainers.items()}
    step = {name: statistics.median(times) for name, times in timed.items()}
    sync_full = _bytes(merged.values())
    sync_adapters = _bytes(lora_trainer.checkpoint_state().values())
    log.info(f"LoRA rank {rank}: {step['lora']:.2f} s/step, full training {step['full']:.2f} s/step "
             f"({rows} x {length} tokens, fp32, {threads} threads, median of {steps} alternating steps); "
             f"trainable {trainable['lora'] / 1e6:.2f} M of {trainable['full'] / 1e6:.1f} M parameters; "
             f"gradients + optimizer {(memory['lora']['grads'] + memory['lora']['optimizer']) / 2**20:.1f} MiB vs "
             f"{(memory['full']['grads'] + memory['full']['optimizer']) / 2**20:.1f} MiB; "
             f"weight sync {sync_full / 2**20:.1f} MiB merged (adapters alone {sync_adapters / 2**20:.2f} MiB, "
             f"merge {merge_s * 1e3:.0f} ms)")
    return {"ratio": round(step["full"] / step["lora"], 3), "rank": rank, "batch": rows, "seq": length,
            "threads": threads, "steps": steps,
            "lora_step_s": round(step["lora"], 3), "full_step_s": round(step["full"], 3),
            "lora_steps_s": [round(s, 3) for s in timed["lora"]], "full_steps_s": [round(s, 3) for s in timed["full"]],
            "lora_trainable_params": trainable["lora"], "full_trainable_params": trainable["full"],
            "lora_grad_bytes": memory["lora"]["grads"], "full_grad_bytes": memory["full"]["grads"],
            "lora_optimizer_bytes": memory["lora"]["optimizer"], "full_optimizer_bytes": memory["full"]["optimizer"],
            "sync_merged_bytes": sync_full, "sync_adapter_bytes": sync_adapters, "merge_s": round(merge_s, 4)}
