"""Run a function in N local processes over gloo on loopback (tests, benchmarks, laptop runs),
collect each rank's return value, clean up. Cluster runs use torchrun / srun instead.

Each worker joins a fresh world on a free port (so parallel test files never collide), runs
`target(rank, world_size, *args)`, and returns its result through a pipe. A failing rank's traceback
is re-raised in the test process; all processes are joined (or killed) before returning.
"""
from __future__ import annotations

import io
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.trainer.parallel import free_port, teardown


def _worker(rank, world_size, port, target, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    try:
        result = target(rank, world_size, *args)
        # Serialised by value: tensors sent through torch's shared-memory reductions vanish when the
        # worker exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure, including SystemExit from a bad config
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                teardown()
            except Exception:
                pass


def run_distributed(target, world_size: int, *args, timeout: float = 600.0) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    # Not daemonic: a worker may start processes of its own (a generator executor); all are joined below.
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, target, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
