"""Gradient clipping and unscaling shared by Zero2Optimizer and DDPOptimizer.

Both optimizers describe their gradients as `sharded` tensors (distinct on every rank:
ZeRO-2's shards, the head's class shard), whose squares are summed across ranks, and
`replicated` tensors (identical on every rank after DDP's all-reduce), counted once.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _sum_over_ranks(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _sq_sum(tensors, device) -> torch.Tensor:
    return sum((t.float().square().sum().to(device) for t in tensors), torch.zeros((), device=device))


@torch.no_grad()
def clip_global_norm_(sharded: list[torch.Tensor], replicated: list[torch.Tensor], max_norm: float,
                      group=None) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm (torch's rule:
    coefficient max_norm / (norm + 1e-6), capped at 1); returns the norm before clipping."""
    device = (sharded + replicated)[0].device
    norm = (_sum_over_ranks(_sq_sum(sharded, device), group) + _sq_sum(replicated, device)).sqrt()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for t in sharded + replicated:
            t.mul_(coef.to(t.device))
    return norm


@torch.no_grad()
def unscale_and_check_(grads: list[torch.Tensor], inv_scale: float, group=None) -> bool:
    """Multiply gradients by inv_scale; True when any rank holds an inf/NaN (all agree)."""
    bad = torch.zeros((), device=grads[0].device)
    for g in grads:
        g.mul_(inv_scale)
        bad += (~torch.isfinite(g)).any().float().to(bad.device)
    return bool(_sum_over_ranks(bad, group).item() > 0)
