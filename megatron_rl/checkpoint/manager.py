"""Save and resume everything a run needs: model shards, optimizer and scheduler, RNG states, the data
cursor, the step and weight version, and the controller's own state.

Layout of one checkpoint (`run_dir/checkpoints/step_00000010/`):
    model/                                        a Megatron checkpoint directory (`megatron-rl convert`
                                                  and `model.path` read it): one shard per trainer rank
    optimizer/rank_{global:05d}.pt                optimizer + LR scheduler state (tensors and plain data)
    rng/rank_{global:05d}.pt                      torch (and CUDA tracker) RNG states
    state.json                                    step, version, data cursor, controller state
    COMPLETE                                      written last: a directory without it is ignored

Writes are atomic: everything goes into a temporary directory that is renamed into place, then the
`latest` pointer is replaced with `os.replace`. A crash at any point leaves the previous checkpoint
as the latest, whole. Loading never unpickles objects: safetensors for weights, `torch.load(...,
weights_only=True)` for optimizer and RNG state, JSON for the rest.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megatron_rl.checkpoints_tools.pretrained import shard_file, write_megatron_meta
from megatron_rl.config import ConfigError, require

COMPLETE = "COMPLETE"
LATEST = "latest"


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    """When and how many checkpoints to keep."""

    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end of the run)."""
    keep_last: int = 2
    """Checkpoints kept on disk; older ones are deleted after a newer one is complete."""
    save_at_end: bool = True
    """Save after the last step."""

    def __post_init__(self) -> None:
        require(self.every_steps >= 0, "every_steps", "must be >= 0")
        require(self.keep_last >= 1, "keep_last", "must be >= 1")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    """Atomic save / validated load of run checkpoints under `run_dir/checkpoints`."""

    def __init__(self, run_dir: str, config: CheckpointConfig):
        self.root = os.path.join(run_dir, "checkpoints")
        self.config = config

    # --- save -------------------------------------------------------------------------------------
    def save(self, step: int, trainer, state: dict[str, Any], tokenizer=None) -> str:
        """Write checkpoint `step` (single-controller process: this rank holds the whole trainer world)."""
        os.makedirs(self.root, exist_ok=True)
        final = os.path.join(self.root, _step_name(step))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(os.path.join(tmp, "model"))
            os.makedirs(os.path.join(tmp, "optimizer"))
            os.makedirs(os.path.join(tmp, "rng"))
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            shard = {k: v.detach().contiguous().cpu() for k, v in trainer.shard_state().items()}
            model_file = shard_file(os.path.join(tmp, "model"), trainer.tp_rank, trainer.pp_rank)
            os.makedirs(os.path.dirname(model_file))
            save_file(shard, model_file)
            if rank == 0:
                write_megatron_meta(os.path.join(tmp, "model"), trainer.layout, tokenizer)
            torch.save({"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict(),
                        "step_count": trainer.step_count}, os.path.join(tmp, "optimizer", f"rank_{rank:05d}.pt"))
            torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
            payload = {"step": step, "python_random": _encode_python_random(), **state}
            with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=2)
            with open(os.path.join(tmp, COMPLETE), "w") as f:
                f.write("ok\n")
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            self._point_latest_to(_step_name(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _point_latest_to(self, name: str) -> None:
        pointer = os.path.join(self.root, LATEST)
        with open(pointer + ".tmp", "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)

    def _prune(self) -> None:
        complete = self.complete_checkpoints()
        for name in complete[:-self.config.keep_last]:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

    # --- load -------------------------------------------------------------------------------------
    def complete_checkpoints(self) -> list[str]:
        if not os.path.isdir(self.root):
            return []
        names = [n for n in os.listdir(self.root) if n.startswith("step_") and not n.endswith(".tmp")
                 and os.path.isfile(os.path.join(self.root, n, COMPLETE))]
        return sorted(names)

    def latest(self) -> str | None:
        """The newest complete checkpoint that validates; a corrupt one is reported and skipped."""
        candidates = self.complete_checkpoints()
        pointer = os.path.join(self.root, LATEST)
        if os.path.isfile(pointer):
            with open(pointer) as f:
                named = f.read().strip()
            if named in candidates:  # the pointer wins; newer complete ones can only come from a crash mid-prune
                candidates = [c for c in candidates if c <= named]
        for name in reversed(candidates):
            problem = self.validate(os.path.join(self.root, name))
            if problem is None:
                return os.path.join(self.root, name)
            print(f"checkpoint {name} is unusable ({problem}); falling back to the previous one")
        return None

    @staticmethod
    def validate(path: str) -> str | None:
        try:
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                json.load(f)
            for sub in ("model", "optimizer", "rng"):
                if not os.listdir(os.path.join(path, sub)):
                    return f"{sub}/ is empty"
            for shard in os.listdir(os.path.join(path, "model")):
                if shard.startswith("mp_rank_"):
                    load_file(os.path.join(path, "model", shard, "model.safetensors"))  # every tensor reads
        except (OSError, ValueError, json.JSONDecodeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # safetensors raises its own error type on truncated files
            return f"{type(exc).__name__}: {exc}"
        return None

    def load(self, path: str, trainer) -> dict[str, Any]:
        """Restore trainer weights, optimizer, scheduler and RNG from `path`; return the saved state."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        model_file = shard_file(os.path.join(path, "model"), trainer.tp_rank, trainer.pp_rank)
        if not os.path.isfile(model_file):
            raise ConfigError(f"{path}: no model shard for tp={trainer.tp_rank} pp={trainer.pp_rank} "
                              "(was the checkpoint written with another parallel layout?)")
        trainer.load_shard(load_file(model_file))
        opt = torch.load(os.path.join(path, "optimizer", f"rank_{rank:05d}.pt"), weights_only=True)
        trainer.optimizer.load_state_dict(opt["optimizer"])
        trainer.scheduler.load_state_dict(opt["scheduler"])
        trainer.step_count = int(opt["step_count"])
        _set_rng_state(torch.load(os.path.join(path, "rng", f"rank_{rank:05d}.pt"), weights_only=True))
        with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
            state = json.load(f)
        random.setstate(_decode_python_random(state.pop("python_random")))
        return state


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _encode_python_random() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _decode_python_random(data: list) -> tuple:
    version, internal, gauss = data
    return version, tuple(internal), gauss
