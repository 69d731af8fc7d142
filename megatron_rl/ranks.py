"""One launch, many ranks: how the trainer ranks of a torchrun / srun world share the RL loop.

Every rank runs the same `Controller.train_step`. Rank 0, the driver, also owns what exists once per
run: the rollout producer and its engines (or the client of a remote generator group), the prompt
stream, the curriculum, evaluation, metrics and the run directory's bookkeeping. Each step the driver
broadcasts the step's scored groups (typed records: prompts, completions with behaviour log-probs and
weight versions, rewards) to every trainer rank; each rank prepares the whole step with the
objective (deterministic: advantages, the global loss normaliser, padding to micro-batches x DP ranks)
and trains on its data-parallel share (`TrainBatch.data_parallel_share`). Preparing the whole step
everywhere costs one broadcast of token ids, small next to a weight sync, and needs no further
collectives for statistics that span the global batch (group baselines, token-mean normalisers).
Weights flow back through the weight channel, a collective over the same ranks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

DRIVER_RANK = 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_driver() -> bool:
    return rank() == DRIVER_RANK


def broadcast_records(records: Any, *, src: int = DRIVER_RANK, group=None) -> Any:
    """`records` from rank `src` (ignored elsewhere) on every rank of `group`; picklable typed records."""
    if world_size() == 1:
        return records
    box = [records if rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_ranks_agree(ok: bool, group=None) -> bool:
    """True on every rank iff `ok` is true on every rank (e.g. every rank wrote its checkpoint files)."""
    if world_size() == 1:
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0.0


def barrier(group=None) -> None:
    if world_size() > 1:
        dist.barrier(group=group)
