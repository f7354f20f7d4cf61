"""An optimizer for the head that steps only the rows Partial FC sampled."""
from __future__ import annotations

import torch
from torch import nn

from heads.partial_fc import PartialFC
from parallel.wrapped import WrappedOptimizer


class SampledRowsOptimizer(WrappedOptimizer):
    """Wraps a pointwise torch optimizer (SGD, AdamW, ...) over `head.weight`.

    With `sample_rate` = 1 it is the plain optimizer. With Partial FC, each `step()` updates
    only the rows in `head.sampled` (the rows used since the last step): their weights and per-row optimizer state
    (momentum, Adam moments) are gathered, stepped and written back; every other row and
    its state stay exactly as they were (no weight decay, no momentum drift while a class
    is not sampled). A row's state starts at zero the first time it is sampled, which for
    SGD equals torch's lazy initialisation. Scalar state such as Adam's `step` counts
    head steps, not per-row steps. A row listed twice (two micro-steps sampled it) is
    stepped twice from the same values, so both copies write back the same result.
    """

    def __init__(self, head: PartialFC, optimizer_class=torch.optim.SGD, **defaults):
        self.head = head
        self.sampled = head.sampled
        self.optimizer = optimizer_class([head.weight], **defaults)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.sampled.clear()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def step(self) -> None:
        index, weight = self.sampled.index(), self.head.weight
        if index is None or weight.grad is None:
            self.optimizer.step()
            return
        full_state = self.optimizer.state.get(weight, {})
        rows = nn.Parameter(weight[index].clone())
        rows.grad = weight.grad[index]
        self.optimizer.state[rows] = {
            k: (v[index].clone() if torch.is_tensor(v) and v.shape == weight.shape else v)
            for k, v in full_state.items()
        }
        group = self.optimizer.param_groups[0]
        group["params"] = [rows]
        try:
            self.optimizer.step()
        finally:
            group["params"] = [weight]
        weight[index] = rows
        stepped = self.optimizer.state.pop(rows)
        for k, v in stepped.items():
            if torch.is_tensor(v) and v.shape == rows.shape:
                if k not in full_state:
                    full_state[k] = torch.zeros_like(weight, dtype=v.dtype)
                full_state[k][index] = v
            else:
                full_state[k] = v
        self.optimizer.state[weight] = full_state
