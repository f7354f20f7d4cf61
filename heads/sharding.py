"""Which classes each rank owns: the insightface convention, so weights move between the two."""

from __future__ import annotations

import torch

from shardface.errors import ConfigError
from shardface.parallel.flat import Range


def class_shard(num_classes: int, world_size: int, rank: int) -> Range:
    """Rank r owns n_r = C // W + (r < C % W) classes from (C // W) * r + min(r, C % W): the
    range [start, end) of class indices (the same `Range` the flat-shard layouts use)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    base, extra = divmod(num_classes, world_size)
    start = base * rank + min(rank, extra)
    return Range(start, start + base + int(rank < extra))


def check_world_fits(num_classes: int, world_size: int) -> None:
    """Every rank must own at least one class: a rank with an empty head shard has no row to
    take its statistics from. The trainer and the planner refuse such a job alike."""
    if world_size < 1:
        raise ConfigError(f"world size {world_size}: a job needs at least one rank")
    if num_classes < world_size:
        raise ConfigError(
            f"config num_classes = {num_classes} is fewer than the world size {world_size}: every rank "
            f"needs at least one class of the head; run at most {num_classes} ranks"
        )


INIT_BLOCK = 4096  # classes drawn from one generator seed


def initial_class_rows(classes: Range, k: int, dim: int, seed: int, std: float = 0.01) -> torch.Tensor:
    """N(0, std) weight rows of the given classes, k rows each (class-major): each class's rows
    depend on (seed, class) alone. Every world size starts from the same head, and no two
    shards start alike (one seed for every rank would repeat the same rows in each shard)."""
    out = torch.empty(classes.size * k, dim)
    first, last = classes.start // INIT_BLOCK, (classes.end - 1) // INIT_BLOCK
    for block in range(first, last + 1) if classes.size else ():
        lo, hi = max(classes.start, block * INIT_BLOCK), min(classes.end, (block + 1) * INIT_BLOCK)
        g = torch.Generator().manual_seed((seed * 1_000_003 + block) % 2**63)
        rows = torch.normal(0.0, std, (INIT_BLOCK * k, dim), generator=g)  # whole blocks: the same draw
        out[(lo - classes.start) * k : (hi - classes.start) * k] = rows[
            (lo - block * INIT_BLOCK) * k : (hi - block * INIT_BLOCK) * k
        ]
    return out
