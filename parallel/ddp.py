"""The plain data-parallel alternative to ZeRO-2, with the same optimizer surface."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardface.parallel.dist import get_rank, get_world_size
from shardface.parallel.grad_ops import clip_global_norm_, unscale_and_check_
from shardface.parallel.wrapped import WrappedOptimizer


class DDPOptimizer(WrappedOptimizer):
    """A torch optimizer over a DDP-wrapped module, exposing what Zero2Optimizer exposes
    (`clip_grad_norm_` with model-parallel `extra_params`, `unscale_and_check_`, per-name
    `state_dict`) so the training loop and checkpoints treat both alike. Every rank holds the
    full optimizer state: this is the baseline ZeRO-2 is measured against."""

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.SGD, process_group=None, **defaults):
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.module = module
        if self.world_size > 1:
            _refuse_crashing_debug_mode(process_group)
            self.ddp = DistributedDataParallel(
                module, process_group=process_group, broadcast_buffers=False, gradient_as_bucket_view=True
            )
        else:
            self.ddp = module
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.optimizer = optimizer_class([p for _, p in self.named], **defaults)

    def no_sync(self):
        """Skip the gradient all-reduce in the backward passes inside this context (the
        micro-steps of gradient accumulation); the first backward after it reduces the sum."""
        return self.ddp.no_sync() if self.world_size > 1 else contextlib.nullcontext()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients in place by default: DDP's `gradient_as_bucket_view` keeps them
        as views of its buckets, which `set_to_none=True` would drop (torch's meaning)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for _, p in self.named if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float, extra_params=()) -> torch.Tensor:
        extra = [p.grad for p in extra_params if p.grad is not None]
        return clip_global_norm_(extra, self._grads(), max_norm, self.group)

    def unscale_and_check_(self, inv_scale: float, extra_params=()) -> torch.Tensor:
        extra = [p.grad for p in extra_params if p.grad is not None]
        return unscale_and_check_(self._grads() + extra, inv_scale, self.group)

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("DDPOptimizer.step does not take a closure")
        self.optimizer.step()

    def state_dict(self, to_rank: int | None = None) -> dict | None:
        """Per-parameter optimizer state by name, on the CPU (the format Zero2Optimizer saves).
        Every rank holds it whole, so nothing is communicated; with `to_rank`, ranks other than
        that group rank return None (the same contract as Zero2Optimizer.state_dict)."""
        if to_rank is not None and get_rank(self.group) != to_rank:
            return None
        index = {id(p): n for n, p in self.named}
        state = {
            index[id(p)]: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        return {"state": state, "param_groups": self._param_groups_state(), "master": {}}

    def load_state_dict(self, state_dict: dict) -> None:
        self._load_param_groups(state_dict["param_groups"])
        for name, p in self.named:
            if name in state_dict["state"]:
                self.optimizer.state[p] = {
                    k: (v.clone().to(p.device) if torch.is_tensor(v) and v.dim() else v)
                    for k, v in state_dict["state"][name].items()
                }


def _refuse_crashing_debug_mode(group) -> None:
    """torch 2.15's DDP constructor dies with SIGSEGV (in its construction-time logger) on a
    gloo group made under TORCH_DISTRIBUTED_DEBUG=DETAIL: say so instead of crashing."""
    if dist.get_debug_level() == dist.DebugLevel.DETAIL and dist.get_backend(group) == "gloo":
        raise RuntimeError(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL crashes torch's DistributedDataParallel on gloo "
            "(SIGSEGV while it is built): unset it or use INFO, or train with ZeRO-2 "
            "(--zero true), which does not use DDP"
        )
