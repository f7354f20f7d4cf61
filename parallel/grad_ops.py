"""Gradient clipping and unscaling shared by Zero2Optimizer and DDPOptimizer.

Both optimizers describe their gradients as `sharded` tensors (distinct on every rank:
ZeRO-2's shards, the head's class shard), whose squares are summed across ranks, and
`replicated` tensors (identical on every rank after DDP's all-reduce), counted once.

Nothing here reads a value on the host: the norm and the found-inf flag stay on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sum_over_ranks(t: torch.Tensor, group) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _sq_sum(tensors, device) -> torch.Tensor:
    """Sum of squares accumulated in fp64. ZeRO-2 sums each rank's shard (parameters cut
    anywhere), DDP whole parameters: in fp32 the two orders differ in the last bits, which
    training then amplifies. In fp64 the order changes the sum by ~1e-16 relative, far below
    fp32's resolution, so every sharding and world size clips with the same fp32 norm."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        total += torch.sum(t.float().square(), dtype=torch.float64).to(device)
    return total


@torch.no_grad()
def clip_global_norm_(
    sharded: list[torch.Tensor], replicated: list[torch.Tensor], max_norm: float, group=None
) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm (torch's rule:
    coefficient max_norm / (norm + 1e-6), capped at 1); returns the fp32 norm before clipping."""
    device = (sharded + replicated)[0].device
    norm = (_sum_over_ranks(_sq_sum(sharded, device), group) + _sq_sum(replicated, device)).sqrt().float()
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for t in sharded + replicated:
            t.mul_(coef.to(t.device))
    return norm


@torch.no_grad()
def unscale_and_check_(grads: list[torch.Tensor], inv_scale: float, group=None) -> torch.Tensor:
    """Multiply gradients by inv_scale; returns a 0-dim device tensor, > 0 when any rank holds
    an inf/NaN (the same value on every rank). One fused pass per device, no host read."""
    device = grads[0].device
    found = torch.zeros((), dtype=torch.float32, device=device)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for dev, tensors in by_device.items():
        flag = found if dev == device else torch.zeros((), dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, flag, torch.full((), inv_scale, dtype=torch.float32, device=dev)
        )
        if flag is not found:
            found += flag.to(device)
    return _sum_over_ranks(found, group)
