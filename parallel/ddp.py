"""The plain data-parallel alternative to ZeRO-2, with the same optimizer surface."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from parallel.dist import get_world_size


class DDPOptimizer:
    """A torch optimizer over a DDP-wrapped module, exposing what Zero2Optimizer exposes
    (`clip_grad_norm_` with model-parallel `extra_params`, `unscale_and_check_`, per-name
    `state_dict`) so the training loop and checkpoints treat both alike. Every rank holds the
    full optimizer state: this is the baseline ZeRO-2 is measured against."""

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.SGD, process_group=None, **defaults):
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.module = module
        if self.world_size > 1:
            self.ddp = DistributedDataParallel(module, process_group=process_group,
                                               broadcast_buffers=False, gradient_as_bucket_view=True)
        else:
            self.ddp = module
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.optimizer = optimizer_class([p for _, p in self.named], **defaults)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def no_sync(self):
        """Skip gradient all-reduce for the micro-steps of gradient accumulation."""
        return self.ddp.no_sync() if self.world_size > 1 else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for _, p in self.named if p.grad is not None]

    def _model_parallel_sum(self, local: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(local, group=self.group)
        return local

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, extra_params=()) -> torch.Tensor:
        grads = self._grads()
        extra = [p.grad for p in extra_params if p.grad is not None]
        dev = grads[0].device
        replicated = sum((g.float().square().sum() for g in grads), torch.zeros((), device=dev))
        sharded = sum((g.float().square().sum().to(dev) for g in extra), torch.zeros((), device=dev))
        norm = (replicated + self._model_parallel_sum(sharded)).sqrt()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for g in grads + extra:
                g.mul_(coef.to(g.device))
        return norm

    @torch.no_grad()
    def unscale_and_check_(self, inv_scale: float, extra_params=()) -> bool:
        grads = self._grads() + [p.grad for p in extra_params if p.grad is not None]
        bad = torch.zeros((), device=grads[0].device)
        for g in grads:
            g.mul_(inv_scale)
            bad += (~torch.isfinite(g)).any().float().to(bad.device)
        return bool(self._model_parallel_sum(bad).item() > 0)

    def step(self) -> None:
        self.optimizer.step()

    def state_dict(self) -> dict:
        index = {id(p): n for n, p in self.named}
        state = {index[id(p)]: dict(s) for p, s in self.optimizer.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups, "master": {}}

    def load_state_dict(self, state_dict: dict) -> None:
        for pg, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            pg.update(saved)
        for name, p in self.named:
            if name in state_dict["state"]:
                self.optimizer.state[p] = {k: (v.clone().to(p.device) if torch.is_tensor(v) and v.dim() else v)
                                           for k, v in state_dict["state"][name].items()}
