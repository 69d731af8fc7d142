"""Save and resume everything a run needs: model shards, optimizer and scheduler, RNG states, the data
cursor, the rollout buffer, the step and weight version, and the controller's own state.

Layout of one checkpoint (`run_dir/checkpoints/step_00000010/`):
    model/                                        a Megatron checkpoint directory (`megatron-rl convert`
                                                  and `model.path` read it): one shard per TP x PP rank;
                                                  a LoRA run's holds the adapters only, with lora.json
                                                  naming the frozen base (docs/lora.md)
    optimizer_state/mp_rank_TT_PPP/optimizer.safetensors
                                                  Adam's moments (and fp32 master weights of a bf16
                                                  model) in the shapes and names of that shard's weights,
                                                  whole over data-parallel ranks (checkpoint/reshard.py)
    optimizer/rank_{global:05d}.pt                LR scheduler state and step count
    rng/rank_{global:05d}.pt                      torch (and CUDA tracker) RNG states
    {name}.safetensors                            extra tensor records, e.g. rollouts.safetensors: the
                                                  rollout buffer (tokens, behaviour log-probs, per-token
                                                  versions; its index as JSON in the file's metadata)
    state.json                                    step, version, data cursor, controller state
    MANIFEST.json                                 every file's size and CRC32
    COMPLETE                                      written last: a directory without it is ignored

Writes are atomic: everything goes into a temporary directory (fsynced) that is renamed into place,
then the `latest` pointer is replaced with `os.replace`; old checkpoints are renamed away before they
are deleted. A crash or a failed write at any point leaves the previous checkpoint as the latest,
whole. On load, each candidate is checked against its manifest (one without MANIFEST.json is unusable)
and parsed; a corrupt or partial one
is reported (naming the file and the problem) and the previous one is used; if every checkpoint is
unusable, loading fails with the list of problems rather than silently starting over.

Loading never unpickles objects: safetensors for tensors, `torch.load(..., weights_only=True)` for
optimizer and RNG state (plain containers of tensors and numbers), JSON for the rest. A `.pt` file
holding any other object is refused (reported as unusable, like a corrupt file).

A checkpoint resumes at any TP x PP x DP layout: at its own, each rank reads its own files (bit-exact);
at another, the weights and optimizer state are resharded (docs/checkpoints.md).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import shutil
import zlib
from typing import Any

import torch
from megatron.core import tensor_parallel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoint.config import CheckpointConfig
from megatron_rl.checkpoint.reshard import (
    OPTIMIZER_STATE,
    apply_optimizer_state,
    gather_optimizer_state,
    optimizer_state_file,
    prepare_optimizer_state,
    reshard_file_kinds,
)
from megatron_rl.config import ConfigError
from megatron_rl.models.arch import ModelArch
from megatron_rl.models.megatron_layout import MegatronLayout, hf_tensor_shapes
from megatron_rl.models.pretrained import (
    LORA_BASE_CHECKSUM,
    read_lora_meta,
    read_megatron_layout,
    shard_file,
    write_lora_meta,
    write_megatron_meta,
)
from megatron_rl.ranks import all_ranks_agree, barrier
from megatron_rl.ranks import rank as global_rank

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
LATEST = "latest"
MANIFEST = "MANIFEST.json"
FORMAT = 2
"""2: layout-independent optimizer state beside the model shards (docs/checkpoints.md); 1: per-rank
optimizer files, loadable only at the layout that wrote them."""
_STEP_DIR = re.compile(r"^step_\d{8}$")


class CheckpointError(ConfigError):
    """No usable checkpoint, or one that cannot be read; the message names the file and the problem."""


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_step(path: str) -> int:
    """The training step a checkpoint directory (RUN_DIR/checkpoints/step_00000010) was taken after."""
    return int(os.path.basename(os.path.normpath(path))[len("step_"):])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_record(path: str) -> dict[str, int]:
    """Size and CRC32 of a file; fsyncs it on the way (the data must be on disk before COMPLETE)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
        os.fsync(f.fileno())
    return {"bytes": os.path.getsize(path), "crc32": crc}


class CheckpointManager:
    """Atomic save / validated load of run checkpoints under `run_dir/checkpoints`."""

    def __init__(self, run_dir: str, config: CheckpointConfig):
        self.root = os.path.join(run_dir, "checkpoints")
        self.config = config

    # --- save -------------------------------------------------------------------------------------
    def due(self, step: int, last_step: int) -> bool:
        """Whether step `step` (1-based) writes a checkpoint: every `every_steps`, and the last one when
        `save_at_end`."""
        every = self.config.every_steps
        return bool(every and step % every == 0) or (step == last_step and self.config.save_at_end)

    def save(self, step: int, trainer, state: dict[str, Any], tokenizer=None,
             tensors: dict[str, tuple[dict[str, torch.Tensor], Any]] | None = None) -> str:
        """Write checkpoint `step`; a collective over the trainer's world (shared file system).

        Each rank writes its own files (its model shard once per data-parallel group, its optimizer and
        RNG state); rank 0 writes the run-level records (`state`, and `tensors`: record name -> (named
        tensors, JSON-able metadata), read back with `load_tensors`), the manifest and the commit. On
        any rank's failure every rank raises, the temporary directory is removed and the previous
        checkpoint stays the latest."""
        rank = global_rank()
        final = os.path.join(self.root, _step_name(step))
        tmp = final + ".tmp"
        error: BaseException | None = None
        if rank == 0:
            try:
                os.makedirs(self.root, exist_ok=True)
                self._remove_leftovers()
                shutil.rmtree(tmp, ignore_errors=True)
                for sub in ("model", "optimizer", "rng"):
                    os.makedirs(os.path.join(tmp, sub))
            except BaseException as exc:
                error = exc
        if all_ranks_agree(error is None):
            try:
                self._write_rank_files(tmp, rank, trainer)
            except BaseException as exc:
                error = exc
        if all_ranks_agree(error is None) and rank == 0:
            try:
                self._commit(tmp, final, step, trainer, state, tokenizer, tensors)
            except BaseException as exc:
                error = exc
        if not all_ranks_agree(error is None):
            if error is not None:  # before the temporary directory's removal frees the space again
                error = _as_disk_full(error, self.root)
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error if error is not None else CheckpointError(
                f"checkpoint {final}: another rank failed to write its files (see its log)")
        if rank == 0:
            self._prune()
        barrier()
        return final

    def _write_rank_files(self, tmp: str, rank: int, trainer) -> None:
        # The distributed optimizer's slices are gathered over data-parallel ranks first: a collective
        # must not sit behind a write that can fail on one rank alone.
        distributed = bool(getattr(trainer.config, "use_distributed_optimizer", False))
        optimizer_state = gather_optimizer_state(trainer) if distributed else None
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
        torch.save({"format": FORMAT, "scheduler": trainer.scheduler.state_dict(), "step_count": trainer.step_count},
                   os.path.join(tmp, "optimizer", f"rank_{rank:05d}.pt"))
        if trainer.pg.dp.rank() != 0:  # one data-parallel replica holds every shard once
            return
        # a LoRA run keeps its adapters only; the frozen base is named by the checksum of this rank's shard
        shard = {k: v.detach().contiguous().cpu() for k, v in trainer.checkpoint_state().items()}
        model_file = shard_file(os.path.join(tmp, "model"), trainer.tp_rank, trainer.pp_rank)
        os.makedirs(os.path.dirname(model_file))
        lora = getattr(trainer, "lora", None) is not None
        save_file(shard, model_file, metadata={LORA_BASE_CHECKSUM: trainer.base_checksum()} if lora else None)
        tensors, meta = optimizer_state if optimizer_state is not None else gather_optimizer_state(trainer)
        state_file = optimizer_state_file(tmp, trainer.tp_rank, trainer.pp_rank)
        os.makedirs(os.path.dirname(state_file))
        save_file({k: v.contiguous() for k, v in tensors.items()}, state_file, metadata={
            "json": json.dumps({**meta, "format": FORMAT, "data_parallel": trainer.dp_size,
                                "distributed_optimizer": distributed})})

    def _commit(self, tmp: str, final: str, step: int, trainer, state: dict[str, Any], tokenizer,
                tensors: dict[str, tuple[dict[str, torch.Tensor], Any]] | None) -> None:
        """Rank 0, after every rank wrote its files: run-level records, manifest, COMPLETE, rename, pointer."""
        write_megatron_meta(os.path.join(tmp, "model"), trainer.layout, tokenizer)
        if getattr(trainer, "lora", None) is not None:
            write_lora_meta(os.path.join(tmp, "model"), lora_meta(trainer))
        for name, (named, metadata) in (tensors or {}).items():
            save_file({k: v.contiguous() for k, v in named.items()}, os.path.join(tmp, f"{name}.safetensors"),
                      metadata={"json": json.dumps(metadata)})
        payload = {"step": step, "python_random": _encode_python_random(), **state}
        with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2)
        manifest = {}
        for folder, _, files in os.walk(tmp):
            for file in files:
                path = os.path.join(folder, file)
                manifest[os.path.relpath(path, tmp)] = _file_record(path)
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        for folder, _, _ in os.walk(tmp):
            _fsync_dir(folder)
        if os.path.exists(final):  # a previous attempt at this step (e.g. before a crash): move aside
            os.rename(final, final + ".old")
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._point_latest_to(_step_name(step))

    def _point_latest_to(self, name: str) -> None:
        pointer = os.path.join(self.root, LATEST)
        with open(pointer + ".tmp", "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        _fsync_dir(self.root)

    def _remove_leftovers(self) -> None:
        """Temporary and half-deleted directories a killed run left behind (never a complete checkpoint)."""
        for name in os.listdir(self.root):
            if name.startswith("step_") and name.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    def _prune(self) -> None:
        complete = self.complete_checkpoints()
        for name in complete[:-self.config.keep_last]:
            doomed = os.path.join(self.root, name)
            os.rename(doomed, doomed + ".old")  # no longer a candidate, even if deletion is interrupted
            shutil.rmtree(doomed + ".old", ignore_errors=True)

    # --- load -------------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        names = [n for n in os.listdir(self.root) if _STEP_DIR.match(n)
                 and os.path.isfile(os.path.join(self.root, n, COMPLETE))]
        return sorted(names)

    def resumable(self) -> bool:
        """Whether a run could resume here: a complete checkpoint with its manifest exists (cheap: no
        checksums; `latest` validates)."""
        return any(os.path.isfile(os.path.join(self.root, name, MANIFEST)) for name in self.complete_checkpoints())

    def latest(self) -> str | None:
        """The newest complete checkpoint that validates; a corrupt one is reported and skipped.
        None when there is no complete checkpoint at all; CheckpointError when none is usable."""
        candidates = self.complete_checkpoints()
        pointer = os.path.join(self.root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer) as f:
                named = f.read().strip()
            if named in candidates:  # the pointer wins; newer complete ones can only come from a crash mid-prune
                candidates = [c for c in candidates if c <= named]
        problems = []
        for name in reversed(candidates):
            problem = self.validate(os.path.join(self.root, name))
            if problem is None:
                return os.path.join(self.root, name)
            problems.append(f"{name}: {problem}")
            log.warning(f"checkpoint {name} is unusable ({problem}); falling back to the previous one")
        if problems:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(problems))
        return None

    @staticmethod
    def validate(path: str) -> str | None:
        """None if the checkpoint at `path` is whole and readable, else what is wrong (naming the file)."""
        manifest_path = os.path.join(path, MANIFEST)
        current = "state.json"
        # Every checkpoint we write has a manifest; one without it could hold any bytes (a deleted
        # manifest and a flipped tensor byte would otherwise load silently).
        if not os.path.isfile(manifest_path):
            return f"{MANIFEST} is missing (its files cannot be checked)"
        try:
            current = MANIFEST
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
            for rel, record in manifest.items():
                current = rel
                full = os.path.join(path, rel)
                if not os.path.isfile(full):
                    return f"{rel} is missing"
                if os.path.getsize(full) != record["bytes"]:
                    return f"{rel} has {os.path.getsize(full)} bytes, the manifest says {record['bytes']} (truncated?)"
                if _file_record(full)["crc32"] != record["crc32"]:
                    return f"{rel} does not match its checksum (corrupted on disk)"
            current = "state.json"
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                json.load(f)
            for sub in ("model", "optimizer", "rng"):
                if not os.listdir(os.path.join(path, sub)):
                    return f"{sub}/ is empty"
            for shard in os.listdir(os.path.join(path, "model")):
                if shard.startswith("mp_rank_"):
                    current = os.path.join("model", shard, "model.safetensors")
                    load_file(os.path.join(path, current))  # every tensor reads
            if os.path.isdir(os.path.join(path, OPTIMIZER_STATE)):
                saved = read_megatron_layout(os.path.join(path, "model"))
                for p in range(saved.pp):
                    for t in range(saved.tp):
                        current = os.path.relpath(optimizer_state_file(path, t, p), path)
                        with safe_open(os.path.join(path, current), framework="pt") as f:
                            json.loads((f.metadata() or {})["json"])
                        load_file(os.path.join(path, current))
            for sub in ("optimizer", "rng"):
                for file in os.listdir(os.path.join(path, sub)):
                    current = os.path.join(sub, file)
                    _safe_torch_load(os.path.join(path, current))
            for file in os.listdir(path):
                if file.endswith(".safetensors"):
                    current = file
                    load_file(os.path.join(path, file))
        except Exception as exc:  # json, OS, safetensors and unpickling errors all mean: unusable
            return f"{current}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None

    def load(self, path: str, trainer) -> dict[str, Any]:
        """Restore trainer weights, optimizer, scheduler and RNG from `path`; return the saved state.
        A checkpoint of format 2 loads at any TP x PP x DP layout (its tensors are resharded when the
        layout differs); an older one only at the layout it was written with."""
        rank = global_rank()
        if not os.path.isdir(os.path.join(path, OPTIMIZER_STATE)):
            _load_legacy(path, trainer, rank)
            same_layout = True
        else:
            saved = read_megatron_layout(os.path.join(path, "model"))
            same_layout = _same_layout(saved, trainer.layout)
            _check_same_adapters(path, read_lora_meta(os.path.join(path, "model")), trainer, same_layout)
            if same_layout:
                shard = load_file(shard_file(os.path.join(path, "model"), trainer.tp_rank, trainer.pp_rank))
                state_file = optimizer_state_file(path, trainer.tp_rank, trainer.pp_rank)
                optimizer_tensors = load_file(state_file)
            else:
                _check_same_arch(path, saved.arch, trainer.arch)
                shard, optimizer_tensors = _resharded(path, saved, trainer)
                state_file = optimizer_state_file(path, 0, 0)
            with safe_open(state_file, framework="pt") as f:
                optimizer_meta = json.loads((f.metadata() or {})["json"])
            _check_same_model(path, shard, trainer.checkpoint_state())
            prepare_optimizer_state(trainer, optimizer_meta)
            if getattr(trainer, "lora", None) is not None and same_layout:
                _check_same_base(path, trainer)
            trainer.load_checkpoint_state(shard)
            try:
                apply_optimizer_state(trainer, optimizer_tensors, optimizer_meta, state_file)
            except ConfigError as exc:
                raise CheckpointError(str(exc)) from None
            opt = _safe_torch_load(_rank_file(path, "optimizer", rank))
            trainer.scheduler.load_state_dict(opt["scheduler"])
            trainer.step_count = int(opt["step_count"])
        rng_file = _rank_file(path, "rng", rank)
        # The model-parallel RNG streams (dropout) belong to one TP rank: restored at the same layout only.
        _set_rng_state(_safe_torch_load(rng_file), model_parallel=same_layout and rng_file.endswith(f"rank_{rank:05d}.pt"))
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        random.setstate(_decode_python_random(state.pop("python_random")))
        return state

    @staticmethod
    def load_tensors(path: str, name: str) -> tuple[dict[str, torch.Tensor], Any] | None:
        """A record saved with `save(..., tensors={name: ...})`: (tensors, metadata), or None if absent."""
        file = os.path.join(path, f"{name}.safetensors")
        if not os.path.isfile(file):
            return None
        with safe_open(file, framework="pt") as f:
            metadata = json.loads((f.metadata() or {}).get("json", "null"))
        return load_file(file), metadata


# Less free space than this after a failed write means the write failed for lack of it.
_DISK_FULL_BYTES = 16 << 20


def _as_disk_full(error: BaseException, root: str) -> BaseException:
    """torch.save reports a full disk as a RuntimeError ("unexpected pos ...") and safetensors as a
    SafetensorError; both become the OSError(ENOSPC) naming the checkpoint directory that they are
    (the CLI prints it as one line). Any other error is returned as it is."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return error
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return error
    if free >= _DISK_FULL_BYTES and "No space left on device" not in str(error):
        return error
    full = OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free) while writing a "
                                 f"checkpoint ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})", root)
    full.__cause__ = error
    return full


def _check_same_model(path: str, saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """A checkpoint of another model (`--resume` after changing model.path) is named, not loaded into
    mismatched tensors."""
    shapes = {name: tuple(t.shape) for name, t in current.items()}
    if {name: tuple(t.shape) for name, t in saved.items()} == shapes:
        return
    missing = sorted(set(shapes) - set(saved))
    extra = sorted(set(saved) - set(shapes))
    differing = [n for n in sorted(set(shapes) & set(saved)) if tuple(saved[n].shape) != shapes[n]]
    example = (f"tensor {differing[0]} is {list(saved[differing[0]].shape)} there, {list(shapes[differing[0]])} in "
               "this run's model" if differing else
               f"tensor {(missing or extra)[0]} is only in {'this run' if missing else 'the checkpoint'}")
    raise CheckpointError(f"{path}: the checkpoint was written for another model than this run's model.path "
                          f"({example}); resume with the model it was trained from, or start afresh with --fresh")


def _rank_file(path: str, sub: str, rank: int) -> str:
    """This rank's file in `sub` (optimizer/, rng/); at a larger world than the checkpoint's, rank 0's
    (the scheduler and the default RNG stream are the same on every rank)."""
    own = os.path.join(path, sub, f"rank_{rank:05d}.pt")
    return own if os.path.isfile(own) else os.path.join(path, sub, "rank_00000.pt")


def lora_meta(trainer) -> dict[str, Any]:
    """The `model/lora.json` record of a LoRA run's checkpoint."""
    config = trainer.lora
    return {"rank": config.rank, "alpha": config.alpha, "dropout": config.dropout, "targets": list(config.targets),
            "base_model": trainer.base_model, "base_dtype": str(trainer.params_dtype).removeprefix("torch.")}


def _check_same_adapters(path: str, saved: dict[str, Any] | None, trainer, same_layout: bool) -> None:
    """A LoRA checkpoint resumes a LoRA run with the same adapters, at the layout that wrote it; a full one, a
    full run. Anything else is refused, naming the difference."""
    current = getattr(trainer, "lora", None)
    if saved is None and current is None:
        return
    if saved is None:
        raise CheckpointError(f"{path} holds the whole model, but this run trains LoRA adapters (trainer.lora.rank "
                              f"{current.rank}): resume with trainer.lora.rank 0, or start a new run directory with "
                              f"model.path: {os.path.join(path, 'model')}")
    if current is None:
        raise CheckpointError(f"{path} holds LoRA adapters (rank {saved['rank']}) on a frozen base, but this run "
                              "trains the whole model (trainer.lora.rank 0): set trainer.lora as the run that wrote it")
    for field in ("rank", "alpha", "targets"):
        if saved[field] != (list(current.targets) if field == "targets" else getattr(current, field)):
            raise CheckpointError(f"{path}: its adapters have trainer.lora.{field} {saved[field]!r}, this run "
                                  f"{getattr(current, field)!r}")
    if not same_layout and saved.get("base_model") != trainer.base_model:
        raise CheckpointError(f"{path}: its adapters were trained on base model {saved.get('base_model')!r}, this "
                              f"run's model.path is {trainer.base_model!r}")


def _check_same_base(path: str, trainer) -> None:
    file = shard_file(os.path.join(path, "model"), trainer.tp_rank, trainer.pp_rank)
    with safe_open(file, framework="pt") as f:
        saved = (f.metadata() or {}).get(LORA_BASE_CHECKSUM)
    if saved != trainer.base_checksum():
        raise CheckpointError(f"{file}: its adapters were trained on another base model (base checksum {saved}, "
                              f"this run's model.path {trainer.base_model} gives {trainer.base_checksum()})")


def _same_layout(saved: MegatronLayout, layout: MegatronLayout) -> bool:
    return (saved.tp, saved.stage_layer_counts, saved.layer_spec, saved.padded_vocab_size) == (
        layout.tp, layout.stage_layer_counts, layout.layer_spec, layout.padded_vocab_size)


def _check_same_arch(path: str, saved: ModelArch, current: ModelArch) -> None:
    """Before resharding: the checkpoint's model has this run's tensors (names and shapes)."""
    _check_same_model(path, {n: torch.empty(s, device="meta") for n, s in hf_tensor_shapes(saved).items()},
                      {n: torch.empty(s, device="meta") for n, s in hf_tensor_shapes(current).items()})


def _resharded(path: str, saved: MegatronLayout, trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's weights and optimizer state at the trainer's layout, from shards written at `saved`."""
    model = [[shard_file(os.path.join(path, "model"), t, p) for t in range(saved.tp)] for p in range(saved.pp)]
    state = [[optimizer_state_file(path, t, p) for t in range(saved.tp)] for p in range(saved.pp)]
    where = f"{path} (written at tensor_parallel={saved.tp}, pipeline_parallel={saved.pp})"
    targets = list(trainer.lora.targets) if getattr(trainer, "lora", None) is not None else None
    try:
        weights = reshard_file_kinds(model, saved, trainer.layout, trainer.tp_rank, trainer.pp_rank, where, targets)
        optimizer = reshard_file_kinds(state, saved, trainer.layout, trainer.tp_rank, trainer.pp_rank, where, targets)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    return weights, optimizer


def _load_legacy(path: str, trainer, rank: int) -> None:
    """A checkpoint of format 1 (per-rank optimizer files): only at the layout it was written with."""
    model_file = shard_file(os.path.join(path, "model"), trainer.tp_rank, trainer.pp_rank)
    opt_file = os.path.join(path, "optimizer", f"rank_{rank:05d}.pt")
    if not os.path.isfile(model_file):
        raise CheckpointError(f"{path}: no model shard for tp={trainer.tp_rank} pp={trainer.pp_rank} "
                              "(was the checkpoint written with another parallel layout?); checkpoints written "
                              "before format 2 resume only at their own layout")
    try:
        saved = read_megatron_layout(os.path.join(path, "model"))
    except ConfigError:
        saved = None
    if saved is not None and not _same_layout(saved, trainer.layout):
        raise CheckpointError(f"{path}: written at tensor_parallel={saved.tp}, pipeline_parallel={saved.pp} by "
                              "a version before format 2, which resumes only at its own layout (this run has "
                              f"tensor_parallel={trainer.layout.tp}, pipeline_parallel={trainer.layout.pp})")
    if not os.path.isfile(opt_file):
        raise CheckpointError(f"{path}: no optimizer/rank_{rank:05d}.pt: written by fewer ranks, by a version "
                              "before format 2, which resumes only with the world size that wrote it")
    shard = load_file(model_file)
    _check_same_model(path, shard, trainer.shard_state())
    trainer.load_shard(shard)
    opt = _safe_torch_load(opt_file)
    _load_optimizer_state(trainer, opt, opt_file)
    trainer.scheduler.load_state_dict(opt["scheduler"])
    trainer.step_count = int(opt["step_count"])


def _safe_torch_load(path: str) -> Any:
    """torch.load restricted to tensors and plain containers; anything else is refused, by name."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{path}: refused to load (it holds objects other than tensors and plain data, "
                              f"and checkpoints are never unpickled): {first}") from None


def _load_optimizer_state(trainer, saved: dict[str, Any], where: str) -> None:
    """Format 1: the optimizer's `state_dict()` per rank, or with the distributed optimizer each
    rank's inner optimizer state and fp32 main-parameter shard."""
    if ("sharded" in saved) != bool(trainer.config.use_distributed_optimizer):
        raise CheckpointError(f"{where}: written with trainer.use_distributed_optimizer="
                              f"{'sharded' in saved}, this run has {trainer.config.use_distributed_optimizer}")
    if "sharded" not in saved:
        trainer.optimizer.load_state_dict(saved["optimizer"])
        return
    wrappers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    if len(wrappers) != len(saved["sharded"]):
        raise CheckpointError(f"{where}: {len(saved['sharded'])} optimizer shards, this rank has {len(wrappers)}")
    for wrapper, shard in zip(wrappers, saved["sharded"]):
        params = [p for g in wrapper.optimizer.param_groups for p in g["params"]]
        shapes = [tuple(p.shape) for p in params]
        if shapes != [tuple(t.shape) for t in shard["main_params"]]:
            raise CheckpointError(f"{where}: the optimizer shard does not fit this rank (was the checkpoint "
                                  "written with another parallel layout or world size?)")
        wrapper.optimizer.load_state_dict(shard["inner"])
        with torch.no_grad():
            for param, value in zip(params, shard["main_params"]):
                param.copy_(value)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any], model_parallel: bool = True) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        if model_parallel:
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _encode_python_random() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _decode_python_random(data: list) -> tuple:
    version, internal, gauss = data
    return version, tuple(internal), gauss
