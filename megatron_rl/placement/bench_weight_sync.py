"""`megatron-rl bench sync`: weight sync of SmolLM2-135M from a Megatron trainer at TP=3 (three gloo
processes) into a generator process, against one memcpy of the same bytes, in the same run. Each
trainer rank writes its own shard into the engine's shared-memory buffer through the reshard plan,
then the generator loads the buffer; a final sync runs in checksum mode (every tensor hashed on both
sides)."""
from __future__ import annotations

import logging
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatron_rl.models.megatron_layout import MegatronLayout, hf_to_megatron
from megatron_rl.models.pretrained import load_pretrained, write_megatron_shards
from megatron_rl.placement.generator_process import GeneratorProcess
from megatron_rl.placement.launch import run_distributed
from megatron_rl.rollout.config import NativeEngineConfig
from megatron_rl.trainer.config import ParallelConfig, TrainerConfig
from megatron_rl.trainer.trainer import load_policy
from megatron_rl.weight_sync.channel import SharedMemoryWeightChannel

log = logging.getLogger(__name__)


def _bench_worker(rank, world_size, checkpoint, repeats, engine_config):
    torch.set_num_threads(1)
    trainer = load_policy(checkpoint, TrainerConfig(parallel=ParallelConfig(tensor_parallel=world_size)))
    generator = None
    if rank == 0:
        model = load_pretrained(checkpoint)
        generator = GeneratorProcess(model.arch, model.state, config=engine_config)
        del model
    try:
        channel = SharedMemoryWeightChannel(trainer, generator)
        channel.push(1)  # warm-up: page in the buffer on both sides
        timings = [channel.push(2 + i) for i in range(repeats)]
        if generator is not None:
            generator.verify_weights = True
        verified = channel.push(2 + repeats)  # raises WeightMismatchError on any difference
        dist.barrier()
        if rank != 0:
            return None
        views = list(channel.arena_views[0].values())
        copies = [torch.empty_like(t) for t in views]
        memcpy = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            torch._foreach_copy_(copies, views)
            memcpy.append(time.perf_counter() - start)
        return {"sync": [t["perf/weight_sync_time"] for t in timings],
                "write": [t["perf/weight_sync_write_time"] for t in timings],
                "commit": [t["perf/weight_sync_commit_time"] for t in timings],
                "bytes": timings[0]["perf/weight_sync_bytes"], "memcpy": memcpy[1:],
                "verified_sync_s": verified["perf/weight_sync_time"]}
    finally:
        if generator is not None:
            generator.close()


def _megatron_checkpoint(source: str, directory: str, tp: int) -> str:
    """`source` as a Megatron checkpoint at TP=`tp` in the empty `directory`, as `megatron-rl convert --to
    megatron --tp` writes it: each trainer rank then reads only its own shard, as in a run."""
    model = load_pretrained(source)
    layout = MegatronLayout(model.arch, tp=tp)
    write_megatron_shards(directory, layout, hf_to_megatron(model.state, layout), model.tokenizer)
    return directory


def bench_sync(options: dict) -> dict:
    tp = int(options.get("tp", 3))
    repeats = int(options.get("repeats", 5))
    # The engine as the RL loop runs it (batch 64); prepack=false skips GEMM weight re-packing on load.
    engine_config = NativeEngineConfig(max_batch_size=int(options.get("engine_batch", 64)), max_seq_len=256,
                                       prepack_weights=bool(options.get("prepack", True)))
    with tempfile.TemporaryDirectory() as root:
        checkpoint = _megatron_checkpoint(str(options.get("model", "smollm2-135m")), root, tp)
        result = run_distributed(_bench_worker, tp, checkpoint, repeats, engine_config)[0]
    sync, memcpy = statistics.median(result["sync"]), statistics.median(result["memcpy"])
    gib = result["bytes"] / 2**30
    log.info(f"weight sync TP={tp} -> engine process: {sync:.3f} s (trainer writes {statistics.median(result['write']):.3f} s, "
             f"engine load {statistics.median(result['commit']):.3f} s) for {gib:.2f} GiB; one memcpy {memcpy:.3f} s; "
             f"checksum-verified sync {result['verified_sync_s']:.2f} s")
    return {"ratio": round(sync / memcpy, 3), "sync_s": round(sync, 4), "memcpy_s": round(memcpy, 4),
            "write_s": round(statistics.median(result["write"]), 4),
            "engine_load_s": round(statistics.median(result["commit"]), 4), "gib": round(gib, 3),
            "trainer_tp": tp, "engine_prepack_weights": engine_config.prepack_weights, "checksum_mode": "passed", "verified_sync_s": round(result["verified_sync_s"], 3)}
