"""Count the passes a head step makes over its weight shard, by op, on any device.

A pass is an op that reads or writes the C x D values of the shard (or of its gradient, its
optimizer state, or a tile of K x D of them): on a GPU each one moves C x D x 4 bytes of fp32
through memory. A TorchDispatchMode sees every aten call below autograd, so the count on the
CPU is the count the same code makes on a GPU. Each op adds the fraction of the shard it
touches: the largest shard-like tensor among its inputs and outputs, or, for gathers and
scatters of rows (`index`, `index_add_`, `index_copy_`), the rows it moves. Views and
allocations touch no values and are not counted.

A tensor is shard-like when it is 2-D with D columns (or a transposed view with D rows) and a
number of rows the caller names as weight rows (the shard's, a sample's, a tile's): the caller
picks sizes where these cannot be confused with the batch's rows.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = {"mm", "addmm", "addmm_", "bmm", "baddbmm"}
_ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_GATHERS = {"index", "index_select"}  # measured by their output
_SCATTERS = {"index_add_": 3, "index_copy_": 3, "index_put_": 2}  # by their source (argument index)


class ShardPassCounter(TorchDispatchMode):
    """`with ShardPassCounter(dim, weight_rows, shard_rows) as c: ...`; `c.passes` maps each op
    name (without `aten::`) to the shard passes it made: the elements of shard-like tensors it
    touched over shard_rows x dim, summed over its calls."""

    def __init__(self, dim: int, weight_rows: set[int], shard_rows: int):
        super().__init__()
        self.dim, self.weight_rows, self.unit = dim, set(weight_rows), shard_rows * dim
        self._passes: dict[str, float] = defaultdict(float)

    @property
    def passes(self) -> dict[str, float]:
        return {name: round(p, 6) for name, p in sorted(self._passes.items())}

    def gemm_passes(self) -> float:
        return round(sum(p for name, p in self._passes.items() if name in GEMMS), 6)

    def other_passes(self) -> dict[str, float]:
        return {name: p for name, p in self.passes.items() if name not in GEMMS}

    def _shard_like(self, t) -> bool:
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            return False
        rows, cols = t.shape
        if cols == self.dim and rows in self.weight_rows:
            return True
        # a transposed view of weight rows (a GEMM's operand), not a rows x K tile with D rows
        return rows == self.dim and cols in self.weight_rows and t.stride(0) == 1 and cols > 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.removeprefix("aten::")
        if func.is_view or name in _ALLOCATIONS:
            return out
        if name in _GATHERS:
            touched = [out]
        elif name in _SCATTERS:
            touched = [args[_SCATTERS[name]]] if len(args) > _SCATTERS[name] else []
        else:
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            touched = list(args) + list(kwargs.values()) + outs
        size = max((t.numel() for t in touched if self._shard_like(t)), default=0)
        if size:
            self._passes[name] += size / self.unit
        return out
