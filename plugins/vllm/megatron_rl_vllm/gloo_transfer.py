"""The `gloo` weight-transfer backend for vLLM's weight-transfer API: the trainer (rank 0) broadcasts
checkpoint-format (HF-named) tensors over a gloo group to every worker of the server, which loads them
through vLLM's layerwise reload, exactly as vLLM's dense NCCL backend does (NCCLWeightTransferEngine,
unpacked), with TCP in place of NCCL.

The group, on both sides (megatron_rl/rollout/vllm_transfer.py builds the trainer's): a `TCPStore` that the
trainer serves at `master_address:master_port`, under `PrefixStore(group_name)`, and
`ProcessGroupGloo(store, rank, world_size)`. The trainer is rank 0; a worker is
`rank_offset + data-parallel index * (TP x PP) + its rank`, as for NCCL.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "megatron_rl_weight_transfer"
    timeout_s: float = 1800.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the tensors the trainer broadcasts next, in this order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """gloo has no 1-byte float types: fp8 travels as its bytes."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: dist.ProcessGroupGloo | None = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        timeout = datetime.timedelta(seconds=init_info.timeout_s)
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size,
                              is_master=False, timeout=timeout)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(init_info.group_name, store), rank,
                                           init_info.world_size, timeout)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises where there is no accelerator.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))  # gloo carries host tensors
            self.group.broadcast([wire(weight)], dist.BroadcastOptions()).wait()
            self.model.load_weights([(name, weight.to(self.device))])

    def shutdown(self) -> None:
        self.group = None
