"""Process-group set-up for Megatron trainers: torch.distributed init, Megatron's parallel_state, and
an explicit `ProcessGroupCollection` that the rest of the trainer receives (never fetched from globals
deep inside RL code)."""
from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rl.trainer.config import ParallelConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolved_backend(config: ParallelConfig) -> str:
    """`parallel.backend`, with auto resolved: nccl when CUDA is available, else gloo."""
    if config.backend != "auto":
        return config.backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(config: ParallelConfig) -> None:
    """Join the torchrun / srun world, or form a world of one on loopback when launched directly."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(minutes=config.timeout_minutes)
    if "RANK" not in os.environ:
        # A world of one needs no rendezvous: an in-process store, so no port to pick (and none to
        # collide with another run's on a busy machine). The environment stays untouched, so child
        # processes (tests, launchers) do not mistake themselves for ranks of this world.
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(resolved_backend(config), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(resolved_backend(config), timeout=timeout)


def setup_model_parallel(config: ParallelConfig):
    """Initialise Megatron's parallel state over the current world; return its process groups."""
    init_distributed(config)
    config.data_parallel(dist.get_world_size())  # validates divisibility with a clear message
    if parallel_state.model_parallel_is_initialized():
        if _same_layout(config):
            # Several trainers of one process (policy, reference, value model; the tests' many) share
            # the groups: Megatron's reset drops its references without destroying them, and every
            # gloo group keeps its transport threads for the life of the process.
            return ProcessGroupCollection.use_mpu_process_groups()
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        expert_model_parallel_size=config.expert_parallel,
        create_gloo_process_groups=resolved_backend(config) != "gloo",
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def _same_layout(config: ParallelConfig) -> bool:
    return (parallel_state.get_tensor_model_parallel_world_size() == config.tensor_parallel
            and parallel_state.get_pipeline_model_parallel_world_size() == config.pipeline_parallel
            and parallel_state.get_expert_model_parallel_world_size() == config.expert_parallel)


def teardown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
