"""`VLLMWeightTransfer`: the trainer's side of vLLM's weight-transfer API for one vLLM server
(vLLM 0.32: `entrypoints/rl/online/api_router.py`, `distributed/weight_transfer/`).

A sync is one round of vLLM's protocol: `/start_weight_update` (the workers begin a layerwise reload), then per
bucket of tensors `/update_weights` with their names, dtypes and shapes, answered once the workers have
received them, while this process broadcasts them in that order from rank 0 of a transfer group it shares
with the server's workers (each tensor loaded by `model.load_weights` as it arrives, in checkpoint format:
HF names, vLLM fuses and quantizes as it does when loading a checkpoint), then `/finish_weight_update` with the
new version label. The group is formed once, by `/init_weight_transfer_engine`, on the first sync.

Transports (the server is launched with the matching `--weight-transfer-config.backend`):
- nccl (GPU): vLLM's dense NCCL backend, unpacked, joined through its unique-id rendezvous: this process
  mints an ncclUniqueId (torch.cuda.nccl), sends it base64-encoded with rank_offset 1 and the world size, and
  joins as rank 0 while the workers join; then it answers the one-element float32 all-reduce that vLLM's
  communicator issues right after ncclCommInitRank (its warm-up handshake) before anything else.
- ipc (a server of one worker on trainer rank 0's own GPU, rollout.placement colocated): vLLM's CUDA-IPC backend,
  unpacked: no group; each `/update_weights` carries, per tensor, the CUDA-IPC handle of rank 0's copy keyed by
  the GPU's UUID (`torch.multiprocessing.reductions.reduce_tensor`'s arguments, pickled: the server needs
  VLLM_ALLOW_INSECURE_SERIALIZATION=1), and the worker maps it and loads from it in place.
- gloo (no GPU): the backend of megatron_rl's vLLM plugin (plugins/vllm: installed into vLLM's environment by
  scripts/setup_vllm_cpu.sh): this process serves a TCPStore on an ephemeral port, and both sides build
  `ProcessGroupGloo(PrefixStore(group_name, store), rank, world_size)`.
Workers are ranks 1 .. world_size - 1 (vLLM orders them by data-parallel index, then rank in TP x PP).
"""
from __future__ import annotations

import base64
import datetime
import logging
import pickle
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from megatron_rl.config import ConfigError
from megatron_rl.rollout.client import EngineHTTPError
from megatron_rl.weight_sync.distributed import buckets, dtype_name, run_all, wire_tensor

log = logging.getLogger(__name__)

TRANSFER_BACKENDS = ("nccl", "gloo", "ipc")
GROUP_NAME = "megatron_rl_weight_transfer"  # the plugin's default (plugins/vllm/megatron_rl_vllm/gloo_transfer.py)


def weight_transfer_config(backend: str) -> list[str]:
    """The `vllm serve` flags that give a server the weight-transfer backend `backend`: vLLM's dotted form of
    `--weight-transfer-config '{"backend": ...}'`, which survives word-splitting in the Slurm scripts."""
    return ["--weight-transfer-config.backend", backend]


def nccl_init_info(uid: bytes, world_size: int) -> dict[str, Any]:
    """`/init_weight_transfer_engine`'s init_info for vLLM's NCCL backend (its NCCLWeightTransferInitInfo):
    the unique-id rendezvous (standard base64 of the 128 bytes), workers from rank 1, unpacked tensors."""
    return {"nccl_unique_id_b64": base64.b64encode(uid).decode("ascii"), "rank_offset": 1, "world_size": world_size,
            "packed": False}


def gloo_init_info(master_address: str, master_port: int, world_size: int, timeout_s: float) -> dict[str, Any]:
    """init_info for the plugin's gloo backend (GlooWeightTransferInitInfo)."""
    return {"master_address": master_address, "master_port": master_port, "rank_offset": 1, "world_size": world_size,
            "group_name": GROUP_NAME, "timeout_s": timeout_s}


def update_info(bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """`/update_weights`'s update_info for one bucket, in broadcast order (both backends' UpdateInfo)."""
    return {"names": [n for n, _ in bucket], "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket]}


def ipc_handles(tensors: list[torch.Tensor]) -> str:
    """The `ipc_handles_pickled` of vLLM's IPCWeightTransferUpdateInfo for CUDA tensors on this process's GPU:
    per tensor, {GPU UUID: the arguments `rebuild_cuda_tensor` takes}, pickled and base64-encoded."""
    handles = []
    for tensor in tensors:
        uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
        _, args = reduce_tensor(tensor)
        handles.append({uuid: args})
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


class VLLMWeightTransfer:
    """One server's transfer group and rounds (see the module docstring). `post(path, body)`: the server's
    control plane (raises on failure); `workers`: the server's worker processes (TP x PP x DP);
    `master_address`: this host as the server's workers reach it (gloo)."""

    def __init__(self, post: Callable[[str, Any], Any], *, backend: str, workers: int = 1,
                 master_address: str = "127.0.0.1", bucket_bytes: int = 1 << 30, timeout_s: float = 1800.0):
        if backend not in TRANSFER_BACKENDS:
            raise ValueError(f"weight transfer backend {backend!r}: one of {', '.join(TRANSFER_BACKENDS)}")
        self.post = post
        self.backend = backend
        self.world_size = 1 + workers
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._group = None  # gloo: the ProcessGroupGloo; nccl: the communicator; ipc: True once announced
        self._store = None
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend in ("nccl", "ipc") \
            else torch.device("cpu")

    # --- the group ------------------------------------------------------------------------------
    def open(self) -> None:
        """Form the group with the server's workers: `/init_weight_transfer_engine` answers once they joined, while
        this process joins beside it. A server without the backend is refused by name (ConfigError)."""
        if self.backend == "ipc":  # no group: the handles travel with each update
            info = {"packed": False}
            joining = run_all([])
        elif self.backend == "nccl":
            uid = torch.cuda.nccl.unique_id()
            info = nccl_init_info(uid, self.world_size)
            joining = run_all([lambda: self._join_nccl(uid)])
        else:  # the store is ours (rank 0); the workers connect to it
            self._store = dist.TCPStore("0.0.0.0", 0, self.world_size, is_master=True, timeout=self.timeout,
                                        wait_for_workers=False)
            info = gloo_init_info(self.master_address, self._store.port, self.world_size, self.timeout.total_seconds())
            joining = run_all([self._join_gloo])
        try:
            self.post("/init_weight_transfer_engine", {"init_info": info})
        except EngineHTTPError as exc:  # our join stays blocked until its timeout; the caller learns now
            if any(m in str(exc) for m in ("not configured", "Invalid weight transfer backend", "Invalid init_info")):
                raise ConfigError(f"cluster.generator.vllm_weight_transfer: the vLLM server has no {self.backend} "
                                  f"weight transfer (start it with `{' '.join(weight_transfer_config(self.backend))}`"
                                  f"): {exc}", field="cluster.generator.vllm_weight_transfer") from exc
            raise
        joining.join()
        if self.backend == "ipc":
            self._group = True

    def _join_nccl(self, uid: bytes) -> None:
        with torch.cuda.device(self.device):
            group = torch.cuda.nccl.init_rank(self.world_size, uid, 0)
            handshake = torch.zeros(1, device=self.device)
            torch.cuda.nccl.all_reduce([handshake], comms=[group])
            torch.cuda.current_stream(self.device).synchronize()
        self._group = group

    def _join_gloo(self) -> None:
        self._group = dist.ProcessGroupGloo(dist.PrefixStore(GROUP_NAME, self._store), 0, self.world_size,
                                            self.timeout)

    def _broadcast(self, tensor: torch.Tensor, calls) -> int:
        """One tensor from rank 0; `calls`: the server's `/update_weights`, which fails first when a worker died
        (gloo: the broadcast is then left, not waited on for the group's timeout; an NCCL broadcast cannot be
        left: its stream waits for the peer)."""
        tensor = tensor.detach().to(self.device).contiguous()
        if self.backend == "nccl":
            torch.cuda.nccl.broadcast([tensor], root=0, comms=[self._group])
        else:
            work = self._group.broadcast([wire_tensor(tensor, "gloo")], dist.BroadcastOptions())
            pause = 1e-4
            while not work.is_completed():
                if calls.errors:
                    raise calls.errors[0]
                time.sleep(pause)
                pause = min(2 * pause, 0.05)
            work.wait()  # raises what the broadcast failed with
        return tensor.numel() * tensor.element_size()

    def _broadcast_bucket(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """nccl / gloo: the server's /update_weights for the bucket, answered once its workers took every tensor,
        beside our broadcasts of them in the same order."""
        info = update_info(bucket)
        calls = run_all([lambda: self.post("/update_weights", {"update_info": info})])
        sent = sum(self._broadcast(tensor, calls) for _, tensor in bucket)
        if self.backend == "nccl":
            torch.cuda.current_stream(self.device).synchronize()
        calls.join()
        return sent

    def _share(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """ipc: the bucket's tensors on this GPU, their handles sent; they stay alive until the server has loaded
        them (its /update_weights answers after load_weights)."""
        tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        torch.cuda.current_stream(self.device).synchronize()  # the copies are complete before the server reads them
        try:
            self.post("/update_weights", {"update_info": {**update_info(bucket),
                                                          "ipc_handles_pickled": ipc_handles(tensors)}})
        except EngineHTTPError as exc:
            if "VLLM_ALLOW_INSECURE_SERIALIZATION" in str(exc):
                raise ConfigError("cluster.generator.vllm_weight_transfer: ipc sends pickled CUDA-IPC handles, which "
                                  "the vLLM server takes only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 in its "
                                  f"environment: {exc}", field="cluster.generator.vllm_weight_transfer") from exc
            raise
        return sum(t.numel() * t.element_size() for t in tensors)

    # --- a round --------------------------------------------------------------------------------
    def send(self, named: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> dict[str, float]:
        """One weight update: every tensor of `named`, then the version label (None: unchanged). The caller
        pauses generation around it. Returns the tensors, bytes and buckets sent."""
        if self._group is None:
            self.open()
        self.post("/start_weight_update", None)
        tensors = sent = count = 0
        try:
            for bucket in buckets(named, self.bucket_bytes):
                sent += self._share(bucket) if self.backend == "ipc" else self._broadcast_bucket(bucket)
                tensors += len(bucket)
                count += 1
        except BaseException:
            try:  # close the server's session (its weights are part-updated; the next round sends them all)
                self.post("/finish_weight_update", {})
            except Exception as exc:
                log.debug("finish_weight_update after a failed round: %s", exc)
            raise
        self.post("/finish_weight_update", {} if version is None else {"weight_version": str(int(version))})
        return {"tensors": float(tensors), "bytes": float(sent), "buckets": float(count)}

    def close(self, notify: bool = True) -> None:
        """Leave the group (`notify`: tell the server to release its side, best effort)."""
        if self._group is None:
            return
        if notify:
            try:
                self.post("/shutdown_weight_transfer_engine", None)
            except Exception as exc:  # a dead server has nothing to release
                log.debug("shutdown_weight_transfer_engine: %s", exc)
        self._group = None
        self._store = None
