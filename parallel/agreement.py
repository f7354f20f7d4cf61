"""Values every rank of a job must hold alike (the resolved config), compared once at start.

A rank started with another lr, seed or margin would otherwise train to the end in lockstep
with the others, each applying its own settings, while config.json records rank 0's. One
`all_gather_object` of the values' text forms, at start-up only; every rank then finds the
same differences and raises the same error, so the job stops on every rank with one line.
"""

from __future__ import annotations

from typing import Sequence

from shardface.errors import ConfigError
from shardface.parallel.dist import from_every_rank

_GROUPS_SHOWN = 4  # value groups named per key; more are counted


def _ranks(ranks: Sequence[int]) -> str:
    """`rank 3`, `ranks 0-2, 5`."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, list(ranks[1:]) + [None]):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def describe_differences(per_rank: Sequence[dict], secret: Sequence[str] = ()) -> str | None:
    """The keys whose values are not the same on every rank of `per_rank` (one dict of text
    values per rank, in rank order), each with its values and the ranks holding them, or None.
    The values of `secret` keys are not shown."""
    keys = sorted(set().union(*per_rank))
    parts = []
    for key in keys:
        groups: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            groups.setdefault(values.get(key, "<unset>"), []).append(rank)
        if len(groups) == 1:
            continue
        ordered = sorted(groups.items(), key=lambda item: item[1][0])
        shown = [
            f"{'<hidden>' if key in secret else value[:60]} on {_ranks(ranks)}"
            for value, ranks in ordered[:_GROUPS_SHOWN]
        ]
        if len(ordered) > _GROUPS_SHOWN:
            shown.append(f"{len(ordered) - _GROUPS_SHOWN} more values")
        parts.append(f"{key} {', '.join(shown)}")
    return "; ".join(parts) if parts else None


def check_same_on_every_rank(values: dict, what: str, secret: Sequence[str] = ()) -> None:
    """Raise ConfigError on every rank unless `values` (compared by their repr) are the same on
    every rank, naming each key that differs, its values and ranks. Collective (CPU group)."""
    problem = describe_differences(
        from_every_rank({key: repr(value) for key, value in values.items()}), secret
    )
    if problem:
        raise ConfigError(
            f"{what} differs between the ranks of this job: {problem}; start every rank with the "
            f"same config file and --key values"
        )
