"""The part of the torch.optim.Optimizer surface every ShardFace optimizer forwards."""
from __future__ import annotations


class WrappedOptimizer:
    """Forwards `param_groups` (so LR schedules and `utils.schedule.set_lr` work unchanged)
    and `state` to the torch optimizer in `self.optimizer`."""

    optimizer = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state
