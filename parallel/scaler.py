"""Dynamic loss scaling for fp16 whose skip decision is shared by every rank."""

from __future__ import annotations

import torch


class DynamicLossScaler:
    """Multiply the loss by `scale`; halve it when any rank finds inf/NaN gradients (the step
    is then skipped everywhere), double it after `growth_interval` clean steps.

    Usage with Zero2Optimizer (the head's model-parallel gradients join the same check)::

        scaler.scale(loss).backward()
        if scaler.unscale_(opt, extra_params=head.parameters()):   # False: skip this step
            opt.step(); head_opt.step()
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ):
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.clean_steps = 0
        self.skipped_in_a_row = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer, extra_params=()) -> bool:
        """Unscale gradients in place and update the scale; True when the step may proceed.

        The one host read of an fp16 step: the optimizers keep the found-inf flag on the
        device, but skipping a step of any torch optimizer (Adam's step count lives on the
        host) and of the head's optimizer needs the decision on the host, as in torch's
        GradScaler. It is taken here, once per step, after the all-reduce that all ranks share.
        """
        found_inf = optimizer.unscale_and_check_(1.0 / self.scale_value, extra_params)
        found = bool(found_inf.item() > 0)
        self.update(found)
        return not found

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale_value = max(self.min_scale, self.scale_value * self.backoff_factor)
            self.clean_steps = 0
            self.skipped_in_a_row += 1
        else:
            self.skipped_in_a_row = 0
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {
            "scale": self.scale_value,
            "clean_steps": self.clean_steps,
            "skipped_in_a_row": self.skipped_in_a_row,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_value = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
