"""Sharded EMA: each rank keeps the fp32 EMA of its 1/W of the flat layout."""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from parallel.collectives import all_gather_no_grad
from parallel.dist import get_rank, get_world_size
from parallel.flat import Range, build_layouts


class ShardedEMA:
    """Exponential moving average of a module's trainable parameters, sharded over ranks.

    `update()` after each optimizer step: with `updates` counted from 1,
    d = decay * (1 - exp(-updates / tau)) and ema = d * ema + (1 - d) * param.

    Given a `Zero2Optimizer`, the EMA shard of each dtype is lerped toward that optimizer's
    fp32 master shard: one `lerp_` per dtype, no communication. Without it (e.g. under DDP)
    the same layout is laid over the module's own parameters and each rank lerps the slices
    it owns. Communication happens only in `state_dict()` / `ema_module()`, which all-gather
    the shards (every rank must call them); buffers (BatchNorm statistics) and frozen
    parameters are taken from the live model then.
    """

    def __init__(self, module: nn.Module, decay: float = 0.9999, tau: float = 2000.0,
                 optimizer=None, process_group=None):
        self.module, self.decay, self.tau = module, decay, tau
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.updates = 0
        if optimizer is not None:
            self.layouts = [g.layout for g in optimizer.groups]
            # the whole fp32 master shard of each dtype
            self.sources = [[(Range(0, g.layout.shard_numel), g.master.detach())] for g in optimizer.groups]
        else:
            self.layouts = build_layouts(module, self.world_size, get_rank(process_group))
            # views of the parameter slices this rank owns (build the EMA after moving the model)
            self.sources = [layout.local_pieces({s.name: s.param.detach() for s in layout.slots})
                            for layout in self.layouts]
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
    def state_dict(self) -> dict:
        """The module's full state dict with EMA parameters (collective: call on every rank)."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for i, layout in enumerate(self.layouts):
            for name, t in layout.unflatten(all_gather_no_grad(self.shards[i], self.group)).items():
                state[name] = t.to(state[name].dtype).clone()
        return state

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
            self.shards[i].copy_(layout.shard.of(full))
        if updates is not None:
            self.updates = int(updates)

    def ema_module(self) -> nn.Module:
        """A deep copy of the module holding the EMA weights (collective), for evaluation."""
        state = self.state_dict()
        model = copy.deepcopy(self.module)
        model.load_state_dict(state)
        return model
