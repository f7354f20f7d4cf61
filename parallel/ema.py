"""Sharded EMA: each rank keeps the fp32 EMA of its 1/W of the flat layout."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from shardface.parallel.collectives import all_gather_no_grad
from shardface.parallel.dist import get_rank, get_world_size
from shardface.parallel.flat import build_layouts


class ShardedEMA:
    """Exponential moving average of a module's trainable parameters, sharded over ranks.

    `update()` after each optimizer step: with `updates` counted from 1,
    d = decay * (1 - exp(-updates / tau)) and ema = d * ema + (1 - d) * param.

    Given a `Zero2Optimizer`, the EMA shard of each dtype is lerped toward that optimizer's
    fp32 master shard (`master_shards()`): one foreach `lerp_`, no communication. Without it (e.g. under DDP)
    the same layout is laid over the module's own parameters and each rank lerps the slices
    it owns. Communication happens only in `state_dict()` / `ema_module()`, which gather the
    shards (every rank must call them); buffers (BatchNorm statistics) and frozen parameters
    are taken from the live model then. A save that writes the EMA twice (the checkpoint and
    model.pt) gathers once: `state = ema.state_dict(to_rank=0)` and hands `state` to both.
    """

    def __init__(
        self,
        module: nn.Module,
        decay: float = 0.9999,
        tau: float = 2000.0,
        optimizer=None,
        process_group=None,
    ):
        self.module, self.decay, self.tau = module, decay, tau
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.updates = 0
        if optimizer is not None:  # the fp32 master shard of each dtype (one or a few pieces)
            masters = optimizer.master_shards()
            self.layouts = [m.layout for m in masters]
            self.sources = [[(r, t.detach()) for r, t in m.pieces] for m in masters]
        else:
            self.layouts = build_layouts(module, self.world_size, get_rank(process_group))
            # views of the parameter slices this rank owns (build the EMA after moving the model)
            self.sources = [
                layout.local_pieces({s.name: s.param.detach() for s in layout.slots})
                for layout in self.layouts
            ]
        self.shards = []
        for layout, pieces in zip(self.layouts, self.sources):
            shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=layout.device)
            for shard_range, piece in pieces:
                shard_range.of(shard).copy_(piece)
            self.shards.append(shard)

    def current_decay(self) -> float:
        return self.decay * (1.0 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        weight = 1.0 - self.current_decay()
        for shard, pieces in zip(self.shards, self.sources):
            if pieces:  # with ZeRO-2 one piece, the master shard: a single lerp kernel
                torch._foreach_lerp_([r.of(shard) for r, _ in pieces], [p.float() for _, p in pieces], weight)

    @torch.no_grad()
    def state_dict(self, to_rank: int | None = None) -> dict | None:
        """The module's full state dict with EMA parameters, on the CPU (collective: call on
        every rank). `to_rank=r` gathers to group rank r only; the others return None."""
        keep = to_rank is None or get_rank(self.group) == to_rank
        state = {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()} if keep else None
        for i, layout in enumerate(self.layouts):
            full = self._gather(self.shards[i], to_rank)
            if full is not None:
                for name, t in layout.unflatten(layout.assemble(full)).items():
                    state[name] = t.to(state[name].dtype).cpu().clone()
        return state

    def _gather(self, shard: torch.Tensor, to_rank: int | None) -> torch.Tensor | None:
        """Every rank's shard concatenated in rank order, on every rank or on `to_rank` only."""
        if self.world_size == 1:
            return shard
        if to_rank is None:
            return all_gather_no_grad(shard, self.group)
        parts = (
            [torch.empty_like(shard) for _ in range(self.world_size)]
            if get_rank(self.group) == to_rank
            else None
        )
        dst = to_rank if self.group is None else dist.get_global_rank(self.group, to_rank)
        dist.gather(shard, parts, dst=dst, group=self.group)
        return torch.cat(parts) if parts is not None else None

    @torch.no_grad()
    def load_state_dict(self, state: dict, updates: int | None = None) -> None:
        """Accepts a state dict saved by `state_dict()` at any world size; `updates` restores
        the decay ramp (saved separately as `ema.updates`)."""
        for i, layout in enumerate(self.layouts):
            names = [s.name for s in layout.slots]
            missing = [n for n in names if n not in state]
            if missing:
                raise KeyError(f"EMA state dict has no entry for parameter '{missing[0]}'")
            full = layout.flatten({n: state[n] for n in names}, dtype=torch.float32)
            self.shards[i].copy_(layout.shard_of(full))
        if updates is not None:
            self.updates = int(updates)

    def ema_module(self, state: dict | None = None) -> nn.Module:
        """A deep copy of the module holding the EMA weights, for evaluation: collective unless
        `state` (a `state_dict()` already gathered on this rank) is given."""
        if state is None:
            state = self.state_dict()
        model = copy.deepcopy(self.module)
        model.load_state_dict(state)
        return model
