"""Which classes each rank owns: the insightface convention, so weights move between the two."""
from __future__ import annotations

from parallel.flat import Range


def class_shard(num_classes: int, world_size: int, rank: int) -> Range:
    """Rank r owns n_r = C // W + (r < C % W) classes from (C // W) * r + min(r, C % W): the
    range [start, end) of class indices (the same `Range` the flat-shard layouts use)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    base, extra = divmod(num_classes, world_size)
    start = base * rank + min(rank, extra)
    return Range(start, start + base + int(rank < extra))
