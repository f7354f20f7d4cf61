"""Record the torch.distributed calls a process makes, while they still run for real.

`with recording() as (log, p2p): ...` wraps every collective and point-to-point function of
torch.distributed, and the aliases parallel.collectives took at import, for the block; each
call is written down as (function name, described positional args, described kwargs):
tensors as ("tensor", shape, dtype), groups by their ranks, reduce ops by name.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

import shardface.parallel.collectives as collectives

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "barrier",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
    "send",
    "recv",
]
POINT_TO_POINT = ["isend", "irecv"]  # matched by (peer, tag): their order may differ by rank


def describe(value):
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)  # ReduceOp


@contextlib.contextmanager
def recording():
    """Yield (collective calls, point-to-point calls), two lists filled as calls are made."""
    log, p2p = [], []

    def wrap(target, name, real):
        @functools.wraps(real)
        def recorded(*args, **kwargs):
            seen_kwargs = {k: describe(v) for k, v in sorted(kwargs.items()) if k != "async_op"}
            entry = (real.__name__, [describe(a) for a in args], seen_kwargs)
            (p2p if real.__name__ in POINT_TO_POINT else log).append(entry)
            return real(*args, **kwargs)

        setattr(target, name, recorded)

    patched = [(dist, n, getattr(dist, n)) for n in COLLECTIVES + POINT_TO_POINT if hasattr(dist, n)]
    patched += [(collectives, n, getattr(collectives, n)) for n in ("_all_gather", "_reduce_scatter")]
    for target, name, real in patched:
        wrap(target, name, real)
    try:
        yield log, p2p
    finally:
        for target, name, real in patched:
            setattr(target, name, real)
