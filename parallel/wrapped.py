"""The part of the torch.optim.Optimizer surface every ShardFace optimizer forwards."""

from __future__ import annotations

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Base of Zero2Optimizer and DDPOptimizer: a `torch.optim.Optimizer` to torch's LR
    schedulers (they check `isinstance`), which forwards `param_groups`, `defaults` and
    `state` to the torch optimizer in `self.optimizer` (so schedules and
    `utils.schedule.set_lr` change the lr that is stepped) and saves/loads the param_groups.

    `Optimizer.__init__` is not called: the param groups are the inner optimizer's, not
    copies. Subclasses implement `step`, `zero_grad`, `state_dict`, `load_state_dict`,
    `clip_grad_norm_`, `unscale_and_check_` and `no_sync`.
    """

    optimizer: torch.optim.Optimizer = None

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    @property
    def state(self):
        return self.optimizer.state

    def _param_groups_state(self) -> list[dict]:
        """Every param group's settings (lr, momentum, ...) without its tensors."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _load_param_groups(self, saved: list[dict]) -> None:
        groups = self.optimizer.param_groups
        if len(saved) != len(groups):
            raise ValueError(f"optimizer state has {len(saved)} param_groups, this optimizer {len(groups)}")
        for group, settings in zip(groups, saved):
            group.update({k: v for k, v in settings.items() if k != "params"})

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
