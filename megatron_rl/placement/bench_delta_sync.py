"""`megatron-rl bench delta-sync`: delta weight sync (rollout.weight_sync: delta) against full syncs of the same
weights, in one run. A SmolLM2 trainer takes real Adam steps (the quickstart's learning rate) on a fixed batch;
after each step the weights go to four engines: a native engine in this process and a generator process
(shared memory), each once fully and once by delta. Every delta-fed engine is checked bit for bit against its
fully-fed twin after every step. Reports each path's median sync time, full over delta (`ratio`: the
in-process path, the quickstart's), and the fraction of bytes the deltas wrote."""
from __future__ import annotations

import logging
import statistics
import time

import torch

from megatron_rl.config import ConfigError
from megatron_rl.models.pretrained import load_pretrained
from megatron_rl.placement.generator_process import GeneratorProcess
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.rollout.native import NativeEngine
from megatron_rl.trainer.bench_train_step import language_model_batch
from megatron_rl.trainer.config import TrainerConfig
from megatron_rl.trainer.trainer import MegatronTrainer
from megatron_rl.weight_sync.channel import InProcessWeightChannel, SharedMemoryWeightChannel

log = logging.getLogger(__name__)

OPTIONS = ("dtype", "steps", "lr", "batch", "seq", "threads", "model")


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n].reshape(-1).view(torch.uint8), b[n].reshape(-1).view(torch.uint8))]


def bench_delta_sync(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"bench delta-sync: unknown option(s) {unknown} (known: {', '.join(OPTIONS)})")
    dtype = str(options.get("dtype", "bf16"))
    if dtype not in ("bf16", "fp32"):
        raise ConfigError(f"bench delta-sync: dtype must be bf16 or fp32, got {dtype!r}")
    steps, lr = int(options.get("steps", 6)), float(options.get("lr", 1e-5))
    rows, length, threads = int(options.get("batch", 4)), int(options.get("seq", 128)), int(options.get("threads", 2))
    if min(steps, rows, length - 1, threads) < 1:
        raise ConfigError("bench delta-sync: steps, batch and threads must be >= 1 and seq >= 2")
    torch.set_num_threads(threads)
    model = load_pretrained(str(options.get("model", "smollm2-135m")))
    trainer = MegatronTrainer(model.arch, TrainerConfig(micro_batch_size=rows, lr=lr), hf_state=model.state)
    batch = language_model_batch(model.arch.vocab_size, rows, length)
    normalizer = batch.loss_mask.sum()
    config = NativeEngineConfig(max_batch_size=8, max_seq_len=256, dtype=dtype)
    engines = {mode: NativeEngine(model.arch, model.state, config=config) for mode in ("full", "delta")}
    generators = {mode: GeneratorProcess(model.arch, model.state, config=config) for mode in ("full", "delta")}
    del model
    try:
        channels = {("in_process", mode): InProcessWeightChannel(trainer, engines[mode], delta=mode == "delta")
                    for mode in ("full", "delta")}
        channels.update({("shared_memory", mode): SharedMemoryWeightChannel(trainer, generators[mode],
                                                                            delta=mode == "delta")
                         for mode in ("full", "delta")})
        times = {key: [] for key in channels}
        fractions = {"in_process": [], "shared_memory": []}
        for step in range(1, steps + 1):
            trainer.train_step(batch, lambda lp, mb, ent: (-(lp * mb.loss_mask).sum() / normalizer, {}))
            for key, channel in channels.items():
                start = time.perf_counter()
                pushed = channel.push(step)
                times[key].append(time.perf_counter() - start)
                if key[1] == "delta":
                    fractions[key[0]].append(pushed["weight_sync/sent_fraction"])
            bad = _differing(engines["full"].named_weights(), engines["delta"].named_weights())
            arenas = {m: channels[("shared_memory", m)].arena_views[1 - generators[m].staging_index]
                      for m in ("full", "delta")}
            bad += [f"arena {n}" for n in _differing(arenas["full"], arenas["delta"])]
            if bad:
                raise RuntimeError(f"bench delta-sync: after step {step} the delta-fed weights differ from the "
                                   f"fully fed ones in {len(bad)} tensors, e.g. {bad[:3]}")
    finally:
        for engine in engines.values():
            engine.close()
        for generator in generators.values():
            generator.close()
    # The first sync of the in-process delta channel, and the first into each shared-memory arena, are full.
    skip = {"in_process": 1, "shared_memory": 2}
    result: dict = {"dtype": dtype, "steps": steps, "lr": lr, "verified_bit_equal_steps": steps}
    for path in ("in_process", "shared_memory"):
        full = statistics.median(times[(path, "full")][skip[path]:])
        delta = statistics.median(times[(path, "delta")][skip[path]:])
        sent = fractions[path][skip[path]:]
        result[path] = {"full_s": round(full, 4), "delta_s": round(delta, 4), "speedup": round(full / delta, 3),
                        "sent_fraction_median": round(statistics.median(sent), 4),
                        "sent_fraction_range": [round(min(sent), 4), round(max(sent), 4)],
                        "full_times_s": [round(t, 4) for t in times[(path, "full")]],
                        "delta_times_s": [round(t, 4) for t in times[(path, "delta")]]}
        log.info(f"{path} ({dtype}): full sync {full * 1e3:.0f} ms, delta {delta * 1e3:.0f} ms "
                 f"({full / delta:.2f}x), delta wrote {100 * statistics.median(sent):.1f}% of the bytes "
                 f"(median of {len(sent)} steps; engines bit-equal after every step)")
    return {"ratio": result["in_process"]["speedup"], **result}
