"""Which classes each rank owns: the insightface convention, so weights move between the two."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClassShard:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def class_shard(num_classes: int, world_size: int, rank: int) -> ClassShard:
    """Rank r owns n_r = C // W + (r < C % W) classes from (C // W) * r + min(r, C % W)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    base, extra = divmod(num_classes, world_size)
    return ClassShard(start=base * rank + min(rank, extra), size=base + int(rank < extra))

