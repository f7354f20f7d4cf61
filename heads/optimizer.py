"""An optimizer for the head that steps only the rows Partial FC sampled."""

from __future__ import annotations

import torch
from torch import nn

from shardface.heads.partial_fc import PartialFC
from shardface.parallel.wrapped import WrappedOptimizer


class SampledRowsOptimizer(WrappedOptimizer):
    """Wraps a pointwise torch optimizer (SGD, AdamW, ...) over `head.weight`.

    With `sample_rate` = 1 it is the plain optimizer. With Partial FC, each `step()` updates
    only the rows in `head.sampled` (the rows used since the last step): their weights
    and per-row optimizer state (momentum, Adam moments) are gathered, stepped and written
    back; every other row and its state stay exactly as they were (no weight decay, no
    momentum drift while a class is not sampled). A row's state starts at zero the first
    time it is sampled, which for SGD equals torch's lazy initialisation. Scalar state such as
    Adam's `step` counts head steps, not per-row steps. A row listed twice (two micro-steps
    sampled it) is stepped twice from the same values, so both copies write back the same
    result.

    With a fused head (`PartialFC(fused_optimizer=True)`) the head calls `step_rows` for each
    tile of rows during backward, as soon as that tile's gradient is complete, so no weight
    gradient exists; `step()` then has nothing left to do. Set the learning rate before the
    forward pass. The head hands over the tile's gradient without its normalisation's radial
    term decay_j w_j, which `step_rows` adds in the same pass as the optimizer's own L2 weight
    decay (SGD's and Adam's coupled `weight_decay`, which torch would otherwise add in a pass
    and a copy of its own).
    """

    def __init__(self, head: PartialFC, optimizer_class=torch.optim.SGD, **defaults):
        self.head = head
        self.sampled = head.sampled
        self.optimizer = optimizer_class([head.weight], **defaults)
        self._scalars: dict | None = None  # scalar state as it was before this step's first tile
        if head.plan.fused:
            head.step_rows = self.step_rows

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.sampled.clear()
        self._scalars = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def step(self) -> None:
        if self.head.plan.fused:  # every used row was stepped during backward
            self._scalars = None
            return
        index, weight = self.sampled.index(), self.head.weight
        if index is None or weight.grad is None:
            self.optimizer.step()
            return
        self.step_rows(index, weight.grad[index])
        self._scalars = None

    @torch.no_grad()
    def step_rows(
        self, rows: slice | torch.Tensor, grad: torch.Tensor, decay: torch.Tensor | None = None
    ) -> None:
        """One optimizer step of `weight[rows]` with gradient `grad` + decay_j weight_j (`decay`:
        one value per row, or None; one tile of a fused head, or the sampled rows): the rows and
        their state are stepped as their own parameter. `grad` may be modified."""
        weight = self.head.weight
        full_state = self.optimizer.state.setdefault(weight, {})
        if self._scalars is None:  # every tile of this step starts from the state before it
            self._scalars = {
                k: v.clone() if torch.is_tensor(v) else v
                for k, v in full_state.items()
                if not _per_row(v, weight)
            }
            self._row_keys = [k for k, v in full_state.items() if _per_row(v, weight)]
        # contiguous rows (a fused head's tile) are stepped in place through views; sampled
        # rows are gathered, stepped and written back
        view = isinstance(rows, slice)
        part = nn.Parameter(weight[rows] if view else weight[rows].clone())
        group = self.optimizer.param_groups[0]
        weight_decay = group.get("weight_decay", 0.0)
        folded = (
            decay is not None
            and not torch.is_tensor(weight_decay)
            and weight_decay != 0
            and _coupled_decay(self.optimizer, group)
        )
        if decay is not None:  # one pass for the head's radial term and the optimizer's L2 decay
            grad.addcmul_(part.detach(), (decay + weight_decay if folded else decay)[:, None])
        part.grad = grad.to(weight.dtype)
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in self._scalars.items()}
        state.update(
            {k: full_state[k][rows] if view else full_state[k][rows].clone() for k in self._row_keys}
        )
        self.optimizer.state[part] = state
        group["params"] = [part]
        if folded:
            group["weight_decay"] = 0.0
        try:
            self.optimizer.step()
        finally:
            group["params"] = [weight]
            group["weight_decay"] = weight_decay
        if not (view and _same(part, weight[rows])):
            weight[rows] = part
        for k, v in self.optimizer.state.pop(part).items():
            if _per_row(v, part):
                if k not in full_state:
                    full_state[k] = torch.zeros_like(weight, dtype=v.dtype)
                if not (view and _same(v, full_state[k][rows])):
                    full_state[k][rows] = v
            else:
                full_state[k] = v


def _coupled_decay(optimizer: torch.optim.Optimizer, group: dict) -> bool:
    """The optimizer adds weight_decay * param to the gradient before anything else (L2, as
    torch's SGD and Adam do unless decoupled or maximising), so it can be added beforehand."""
    if group.get("maximize", False) or group.get("decoupled_weight_decay", False):
        return False
    return type(optimizer) in (torch.optim.SGD, torch.optim.Adam)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a is b's memory (an in-place step of a view): nothing to write back."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _per_row(value, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == like.shape
