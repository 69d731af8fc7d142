"""Delta weight sync: send only the elements that changed since the version the receiver holds.

Between two RL steps most of an engine's weights keep their bits: an optimizer step moves a weight by
about the learning rate, and in bf16 that rarely crosses to the next representable value (only a few
percent of the elements change per step). So a sync compares each tensor, bit for bit and in the
receiver's dtype, with what the receiver holds and sends, per tensor, the smallest of

- nothing (no element changed);
- `sparse`: the changed elements' flat positions (int32, or int64 past 2**31 elements) and new values;
- `mask`: a bitmask of the changed positions (one bit per element) and the new values;
- the whole tensor (most elements changed, as in fp32: every weight with a gradient moves).

The choice is by exact size, from the count of changed elements. Bitwise comparison (not `!=` on
floats) makes the result equal to a full sync bit for bit: a -0.0 that became 0.0, or a NaN that
stayed a NaN with another payload, is sent like any other change.

What the receiver holds is known in one of two ways: the sender keeps its own copy of every tensor it
sent (`DeltaEncoder()`, one copy of the engine-dtype weights in host memory), or reads the receiver's
tensors directly where it can (`DeltaEncoder(held=...)`: an in-process engine's weights; the shared
memory arena of a generator process, `write_changed`), which costs no copy. `reset()` forgets it all,
so the next sync is full: on start, on resume and after any mismatch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable, Iterator, Literal, Mapping

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIRE = "::delta."  # a delta's payload travels as plain named tensors: f"{name}{_WIRE}{encoding}.{part}"
_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as same-width integers (1-D), for bitwise comparison."""
    return tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])


def changed_elements(new: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bits differ (same shape and dtype)."""
    return _bits(new) != _bits(held)


@dataclasses.dataclass(frozen=True)
class WeightDelta:
    """The changed elements of one tensor the receiver holds: `values` (its dtype) at the positions given
    by `positions` (sparse: flat int32 / int64 indices; mask: a little-endian bitmask, one bit per element)."""

    shape: tuple[int, ...]
    encoding: Literal["sparse", "mask"]
    positions: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.positions.numel() * self.positions.element_size() + self.values.numel() * self.values.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    def indices(self) -> torch.Tensor:
        """Flat int64 positions of the changed elements, in order."""
        if self.encoding == "sparse":
            return self.positions.long()
        numel = math.prod(self.shape)
        bits = (self.positions.view(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=self.positions.device)) & 1
        return bits.reshape(-1)[:numel].nonzero().view(-1)

    def apply_to(self, target: torch.Tensor) -> None:
        """Write the changed elements into `target` (the receiver's tensor, of `shape`, any float dtype)."""
        if tuple(target.shape) != tuple(self.shape):
            raise ValueError(f"a weight delta for shape {self.shape} applied to a tensor of shape {tuple(target.shape)}")
        flat = target.view(-1) if target.is_contiguous() else None
        index = self.indices().to(target.device)
        values = self.values.to(device=target.device, dtype=target.dtype)
        if flat is not None:
            flat.index_copy_(0, index, values)
        else:  # a strided view: write through a contiguous copy
            dense = target.contiguous().view(-1)
            dense.index_copy_(0, index, values)
            target.copy_(dense.view(target.shape))


def encode(new: torch.Tensor, held: torch.Tensor) -> torch.Tensor | WeightDelta | None:
    """The cheapest way to turn `held` into `new` (same shape and dtype): None (unchanged), a
    `WeightDelta`, or `new` itself (sent whole)."""
    changed = changed_elements(new, held)
    count = int(changed.count_nonzero())  # (25x faster than a bool sum on CPU)
    if count == 0:
        return None
    numel, size = new.numel(), new.element_size()
    index_bytes = 4 if numel < 2**31 else 8
    sparse, mask, dense = count * (index_bytes + size), (numel + 7) // 8 + count * size, numel * size
    if dense <= min(sparse, mask):
        return new
    index = changed.nonzero().view(-1)  # (gathering by index is several times faster than by a bool mask)
    values = new.detach().reshape(-1).index_select(0, index)
    if sparse <= mask:
        return WeightDelta(tuple(new.shape), "sparse", index.to(torch.int32 if index_bytes == 4 else torch.int64),
                           values)
    return WeightDelta(tuple(new.shape), "mask", pack_bits(changed), values)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A flat bool mask as uint8, eight elements per byte, the first in the lowest bit."""
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:mask.numel()] = mask
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


@dataclasses.dataclass
class DeltaStats:
    """What one sync sent against what a full sync would have."""

    sent_bytes: int = 0
    full_bytes: int = 0
    tensors: dict[str, int] = dataclasses.field(default_factory=lambda: {"unchanged": 0, "sparse": 0, "mask": 0,
                                                                          "whole": 0})

    def metrics(self) -> dict[str, float]:
        return {"weight_sync/sent_bytes": float(self.sent_bytes), "weight_sync/full_bytes": float(self.full_bytes),
                "weight_sync/sent_fraction": self.sent_bytes / max(self.full_bytes, 1),
                **{f"weight_sync/{kind}_tensors": float(n) for kind, n in self.tensors.items()}}


class DeltaEncoder:
    """The sender's side: for each (name, tensor) of a sync, what to send given what the receiver holds.

    `held(name)` returns the receiver's tensor of that name where the sender can read it (None: unknown);
    without it the encoder keeps a copy of everything it sent. `dtype` is the receiver's (the comparison is
    of the values it will hold); None keeps each tensor's own."""

    def __init__(self, held: Callable[[str], torch.Tensor | None] | None = None, dtype: torch.dtype | None = None):
        self._held = held
        self._copies: dict[str, torch.Tensor] = {}
        self.dtype = dtype
        self.full = True
        self.stats = DeltaStats()

    @property
    def reads_receiver(self) -> bool:
        """Whether the baseline is the receiver's own tensors (it is in this process: deltas go to it as
        `WeightDelta` objects) rather than a copy of what was sent (they go `to_wire`)."""
        return self._held is not None

    def reset(self) -> None:
        """The next sync sends everything (start, resume, a mismatch, a restarted receiver)."""
        self._copies.clear()
        self.full = True

    def encode(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | WeightDelta]]:
        """One sync: the (name, tensor or delta) pairs to send; unchanged tensors are left out. The
        receiver must apply all of them (an encoder whose sync failed midway must be `reset`)."""
        self.stats = DeltaStats()
        full, self.full = self.full, False
        for name, tensor in named:
            new = tensor.detach()
            if self.dtype is not None and new.is_floating_point() and new.dtype != self.dtype:
                new = new.to(self.dtype)
            self.stats.full_bytes += new.numel() * new.element_size()
            held = self._receiver_tensor(name) if not full else None
            if held is None or held.shape != new.shape or held.dtype != new.dtype:
                kind, out = "whole", new
            else:
                out = encode(new, held)
                kind = "unchanged" if out is None else "whole" if isinstance(out, torch.Tensor) else out.encoding
            self.stats.tensors[kind] += 1
            if out is None:
                continue
            self.stats.sent_bytes += out.nbytes if isinstance(out, WeightDelta) else new.numel() * new.element_size()
            if self._held is None:
                copy = self._copies.get(name)
                if copy is not None and copy.shape == new.shape and copy.dtype == new.dtype:
                    copy.copy_(new)
                else:
                    self._copies[name] = new.clone()
            yield name, out

    def _receiver_tensor(self, name: str) -> torch.Tensor | None:
        return self._held(name) if self._held is not None else self._copies.get(name)


def write_changed(target: torch.Tensor, source: torch.Tensor) -> int:
    """Copy into `target` only the elements of `source` whose bits differ (same shape and dtype; `target`
    may be a strided view). The shared-memory channel's delta write, where the trainer reads the arena it
    writes. Returns the bytes written."""
    if source.dtype != target.dtype:
        source = source.to(target.dtype)
    changed = changed_elements(source, target)
    count = int(changed.count_nonzero())  # (25x faster than a bool sum on CPU)
    if count == 0:
        return 0
    if count * 4 >= changed.numel():  # dense enough that one copy is cheaper than scattered writes
        target.copy_(source)
        return target.numel() * target.element_size()
    if target.is_contiguous():
        index = changed.nonzero().view(-1)
        target.view(-1).index_copy_(0, index, source.reshape(-1).index_select(0, index))
    else:  # a strided view (a TP shard's columns): write through (row, column) indices
        index = changed.view(target.shape).nonzero(as_tuple=True)
        target.index_put_(index, source[index])
    return count * target.element_size()


def to_wire(named: Iterable[tuple[str, torch.Tensor | WeightDelta]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Deltas as plain named tensors, for transports that move (name, tensor) pairs (the broadcast group)."""
    for name, value in named:
        if isinstance(value, WeightDelta):
            shape = "x".join(map(str, value.shape)) or "scalar"
            yield f"{name}{_WIRE}{value.encoding}.{shape}.positions", value.positions
            yield f"{name}{_WIRE}{value.encoding}.{shape}.values", value.values
        else:
            yield name, value


def from_wire(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | WeightDelta]:
    """`to_wire`'s inverse on the receiver: whole tensors as they are, each delta's two parts joined."""
    out: dict[str, torch.Tensor | WeightDelta] = {}
    for key, tensor in named.items():
        if _WIRE not in key:
            out[key] = tensor
            continue
        name, rest = key.split(_WIRE, 1)
        encoding, shape, part = rest.split(".")
        if part != "positions":
            continue
        dims = () if shape == "scalar" else tuple(int(d) for d in shape.split("x"))
        out[name] = WeightDelta(dims, encoding, tensor, named[f"{name}{_WIRE}{encoding}.{shape}.values"])
    return out
