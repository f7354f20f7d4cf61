"""Collectives with autograd and the small compatibility layer over torch versions."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardface.parallel.dist import get_world_size

# torch >= 2.14 renamed the flat-tensor collectives; keep one spelling here.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_flat(
    output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False
):
    """Reduce `input` (W * n elements) over ranks with `op` (sum by default); rank r receives
    elements [r*n, (r+1)*n)."""
    return _reduce_scatter(output, input, op=op, group=group, async_op=async_op)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `input` (n elements) into `output` (W * n elements)."""
    return _all_gather(output, input, group=group, async_op=async_op)


class _AllGatherRows(torch.autograd.Function):
    """Gather row blocks of equal size from every rank.

    Backward: the gradients of the gathered tensor are summed over ranks (each rank holds
    the gradient of its own logits' part) and each rank keeps the rows it contributed,
    multiplied by `grad_scale`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, grad_scale: float) -> torch.Tensor:
        ctx.group, ctx.grad_scale = group, grad_scale
        world = get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_flat(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = get_world_size(ctx.group)
        grad = grad.contiguous()
        local = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        reduce_scatter_flat(local, grad, group=ctx.group)
        if ctx.grad_scale != 1.0:
            local.mul_(ctx.grad_scale)
        return local, None, None


def all_gather_rows(x: torch.Tensor, group=None, grad_scale: float = 1.0) -> torch.Tensor:
    """Autograd-aware all-gather along dim 0 (identity for world size 1)."""
    if get_world_size(group) == 1:
        return x if grad_scale == 1.0 else _ScaleGrad.apply(x, grad_scale)
    return _AllGatherRows.apply(x, group, grad_scale)


def all_gather_no_grad(x: torch.Tensor, group=None) -> torch.Tensor:
    if get_world_size(group) == 1:
        return x
    out = x.new_empty((get_world_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    all_gather_flat(out, x.contiguous(), group=group)
    return out


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


__all__ = ["reduce_scatter_flat", "all_gather_flat", "all_gather_rows", "all_gather_no_grad"]
