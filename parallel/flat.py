"""One flat layout of a module's parameters, shared by ZeRO-2 and the sharded EMA.

Trainable parameters of one dtype are packed into one flat buffer (each parameter's start
aligned to `ALIGN` elements, the total padded so it divides by W * ALIGN). The buffer is cut
into segments (one segment, the whole buffer, unless asked otherwise) and rank r owns the
r-th 1/W of every segment: with one segment that is the element range [r*N/W, (r+1)*N/W);
with ZeRO-2's collective exchange every gradient bucket is a segment, so each bucket is one
reduce-scatter and one all-gather (Megatron-LM's distributed optimizer does the same). A
rank's shard is its pieces of all segments, concatenated in buffer order; a parameter may
straddle ranks and segments. The index math lives in named ranges (Megatron-LM's idea):

    slot.global_range      where the parameter lies in the whole buffer
    part.global_range      a piece of it this rank owns, in buffer coordinates
    part.param_range       that same piece in the parameter's own flattened coordinates
    part.shard_range       that same piece in this rank's shard coordinates

(`slot.owned` lists the parts: none when another rank owns the whole parameter, two or more
when it straddles segments.)
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
        return flat[self.start : self.end]


@dataclass(frozen=True)
class ShardPiece:
    """A rank's piece of one segment: where it lies in the buffer and in the rank's shard."""

    global_range: Range
    shard_range: Range


@dataclass(frozen=True)
class OwnedPart:
    """A piece of one parameter that this rank owns, in the three coordinates it is used in."""

    global_range: Range
    param_range: Range
    shard_range: Range


@dataclass(frozen=True)
class ParamSlot:
    name: str
    param: nn.Parameter
    global_range: Range
    owned: tuple[OwnedPart, ...]


class FlatLayout:
    """Where each parameter of one dtype lives in the flat buffer and which parts this rank owns.

    `segment_numel`: cut the buffer into segments of this many elements (rounded up to a
    multiple of W * ALIGN; the last may be shorter) and give every rank 1/W of each; None keeps
    one segment.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        world_size: int,
        rank: int,
        segment_numel: int | None = None,
    ):
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
        step = self.numel if segment_numel is None else max(unit, -(-segment_numel // unit) * unit)
        self.segments = [Range(s, min(s + step, self.numel)) for s in range(0, self.numel, step)]
        self.pieces = self.pieces_of(rank)
        self.slots = []
        for (name, p), start in zip(named_params, offsets):
            whole = Range(start, start + p.numel())
            owned = []
            for piece in self.pieces:
                part = whole.intersect(piece.global_range)
                if part.size:
                    owned.append(
                        OwnedPart(
                            part,
                            part.shift(whole.start),
                            part.shift(piece.global_range.start - piece.shard_range.start),
                        )
                    )
            self.slots.append(ParamSlot(name, p, whole, tuple(owned)))

    def pieces_of(self, rank: int) -> list[ShardPiece]:
        """Rank `rank`'s piece of every segment, in buffer order (its shard's order)."""
        pieces, offset = [], 0
        for seg in self.segments:
            size = seg.size // self.world_size
            pieces.append(
                ShardPiece(
                    Range(seg.start + rank * size, seg.start + (rank + 1) * size),
                    Range(offset, offset + size),
                )
            )
            offset += size
        return pieces

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    def shard_of(self, full: torch.Tensor, rank: int | None = None) -> torch.Tensor:
        """A rank's shard (this rank's by default) of a full flat vector; a view with one segment."""
        pieces = self.pieces if rank is None else self.pieces_of(rank)
        if len(pieces) == 1:
            return pieces[0].global_range.of(full)
        return torch.cat([p.global_range.of(full) for p in pieces])

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full flat vector from every rank's shard concatenated in rank order (what an
        all-gather of the shards returns)."""
        if len(self.segments) == 1:
            return gathered
        by_rank = gathered.view(self.world_size, self.shard_numel)
        return torch.cat(
            [by_rank[:, p.shard_range.start : p.shard_range.end].reshape(-1) for p in self.pieces]
        )

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
            if slot.owned:
                src = tensors_by_name[slot.name].reshape(-1)
                pieces.extend((part.shard_range, part.param_range.of(src)) for part in slot.owned)
        return pieces


def build_layouts(
    module: nn.Module, world_size: int, rank: int, reverse: bool = False, segment_bytes: float | None = None
) -> list[FlatLayout]:
    """One layout per dtype over the module's trainable parameters (frozen ones stay out);
    `segment_bytes` cuts each into segments of about that size (see FlatLayout)."""
    by_dtype: dict[torch.dtype, list] = {}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if reverse:  # backward produces gradients roughly last-to-first; buckets then fill in order
        named = named[::-1]
    for name, p in named:
        by_dtype.setdefault(p.dtype, []).append((name, p))
    layouts = []
    for params in by_dtype.values():
        size = params[0][1].element_size()
        segment_numel = None if segment_bytes is None else max(1, int(segment_bytes / size))
        layouts.append(FlatLayout(params, world_size, rank, segment_numel))
    return layouts
