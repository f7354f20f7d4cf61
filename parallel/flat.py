"""One flat layout of a module's parameters, shared by ZeRO-2 and the sharded EMA.

Trainable parameters of one dtype are packed into one flat buffer (each parameter's start
aligned to `ALIGN` elements, the total padded so it divides by W * ALIGN). Rank r owns the
element range [r*N/W, (r+1)*N/W) of each buffer; a parameter may straddle two ranks. The
index math lives in three named ranges per parameter (Megatron-LM's idea):

    slot.global_range   where the parameter lies in the whole buffer
    slot.local_range    the part of it this rank owns, in buffer coordinates (may be empty)
    slot.param_range    that same part in the parameter's own flattened coordinates
    slot.shard_range    that same part in this rank's shard coordinates
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 16


@dataclass(frozen=True)
class Range:
    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Range") -> "Range":
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, max(start, end))

    def shift(self, origin: int) -> "Range":
        """The same elements in coordinates that start at `origin`."""
        return Range(self.start - origin, self.end - origin)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.end]


@dataclass(frozen=True)
class ParamSlot:
    name: str
    param: nn.Parameter
    global_range: Range
    local_range: Range

    @property
    def param_range(self) -> Range:
        return self.local_range.shift(self.global_range.start)


class FlatLayout:
    """Where each parameter of one dtype lives in the flat buffer and which part this rank owns."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], world_size: int, rank: int):
        if not named_params:
            raise ValueError("FlatLayout needs at least one parameter")
        self.dtype = named_params[0][1].dtype
        self.device = named_params[0][1].device
        self.world_size, self.rank = world_size, rank
        offsets, pos = [], 0
        for _, p in named_params:
            offsets.append(pos)
            pos += -(-p.numel() // ALIGN) * ALIGN
        unit = world_size * ALIGN
        self.numel = -(-pos // unit) * unit
        self.shard = self.shard_of(rank)
        self.slots = []
        for (name, p), start in zip(named_params, offsets):
            whole = Range(start, start + p.numel())
            self.slots.append(ParamSlot(name, p, whole, whole.intersect(self.shard)))

    def shard_of(self, rank: int) -> Range:
        size = self.numel // self.world_size
        return Range(rank * size, (rank + 1) * size)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def shard_numel(self) -> int:
        return self.shard.size

    def flatten(self, tensors: dict[str, torch.Tensor], dtype=None) -> torch.Tensor:
        """Pack per-parameter tensors (by name) into a full flat vector; gaps are zero."""
        flat = torch.zeros(self.numel, dtype=dtype or self.dtype, device=self.device)
        for slot in self.slots:
            slot.global_range.of(flat).copy_(tensors[slot.name].reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full flat vector into per-parameter tensors (views) by name."""
        return {s.name: s.global_range.of(flat).view(s.param.shape) for s in self.slots}

    def local_pieces(self, tensors_by_name: dict[str, torch.Tensor]) -> list[tuple[Range, torch.Tensor]]:
        """(shard range, flattened slice) of each parameter part this rank owns."""
        pieces = []
        for slot in self.slots:
            if slot.local_range.size:
                src = tensors_by_name[slot.name].reshape(-1)
                pieces.append((slot.local_range.shift(self.shard.start), slot.param_range.of(src)))
        return pieces


def build_layouts(module: nn.Module, world_size: int, rank: int, reverse: bool = False) -> list[FlatLayout]:
    """One layout per dtype over the module's trainable parameters (frozen ones stay out)."""
    by_dtype: dict[torch.dtype, list] = {}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if reverse:  # backward produces gradients roughly last-to-first; buckets then fill in order
        named = named[::-1]
    for name, p in named:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    return [FlatLayout(params, world_size, rank) for params in by_dtype.values()]
