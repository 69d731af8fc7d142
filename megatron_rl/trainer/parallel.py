"""Process-group set-up for Megatron trainers: torch.distributed init, Megatron's parallel_state, and
an explicit `ProcessGroupCollection` that the rest of the trainer receives (never fetched from globals
deep inside RL code)."""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, require


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
    """How trainer ranks split the model: tensor x pipeline x data parallel (data = world / (TP * PP))."""

    tensor_parallel: int = 1
    """Tensor-parallel size (Megatron TP); must divide the model's key/value heads."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size (Megatron PP); must divide the number of layers."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """torch.distributed backend: auto picks nccl when CUDA is available, else gloo."""
    timeout_minutes: int = 30
    """Collective timeout."""

    def __post_init__(self) -> None:
        require(self.tensor_parallel >= 1, "tensor_parallel", "must be >= 1")
        require(self.pipeline_parallel >= 1, "pipeline_parallel", "must be >= 1")
        require(self.timeout_minutes >= 1, "timeout_minutes", "must be >= 1")

    def resolved_backend(self) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() else "gloo"

    def data_parallel(self, world_size: int) -> int:
        model_parallel = self.tensor_parallel * self.pipeline_parallel
        if world_size % model_parallel:
            raise ConfigError(f"world size {world_size} is not a multiple of tensor_parallel x pipeline_parallel "
                              f"= {self.tensor_parallel} x {self.pipeline_parallel}")
        return world_size // model_parallel


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        dist.init_process_group(config.resolved_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(config.resolved_backend(), timeout=timeout)


def setup_model_parallel(config: ParallelConfig):
    """Initialise Megatron's parallel state over the current world; return its process groups."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    init_distributed(config)
    config.data_parallel(dist.get_world_size())  # validates divisibility with a clear message
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        create_gloo_process_groups=config.resolved_backend() != "gloo",
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def teardown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
