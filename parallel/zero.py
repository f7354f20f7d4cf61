"""ZeRO-2: sharded optimizer state, fp32 master weights and gradients over one flat layout."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import all_gather_flat
from parallel.dist import get_rank, get_world_size
from parallel.flat import FlatLayout, ParamSlot, Range, build_layouts


@dataclass
class _Bucket:
    """A contiguous run of parameters whose gradients are reduced together."""
    range: Range
    slots: list[ParamSlot]
    pending: int = 0
    scratch: torch.Tensor | None = None
    ready: bool = False
    launched: bool = False
    handles: list = field(default_factory=list)
    pieces: list = field(default_factory=list)  # (shard range, scratch slice) this rank receives


class _DtypeGroup:
    """The flat parameter buffer of one dtype, its fp32 master shard and fp32 gradient shard."""

    def __init__(self, layout: FlatLayout, bucket_numel: int):
        self.layout = layout
        self.buffer = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        for slot in layout.slots:
            view = slot.global_range.of(self.buffer).view(slot.param.shape)
            view.copy_(slot.param.detach())
            slot.param.data = view  # parameters become views into the flat buffer
        local = layout.shard.of(self.buffer)
        # fp32 models step in place; others keep an fp32 master copy of the shard
        master = local if layout.dtype == torch.float32 else local.detach().float()
        self.master = nn.Parameter(master)
        self.master.grad = torch.zeros_like(self.master)
        self.buckets = self._make_buckets(bucket_numel)
        self.bucket_of = {slot.name: b for b in self.buckets for slot in b.slots}

    def _make_buckets(self, bucket_numel: int) -> list[_Bucket]:
        buckets, current = [], []
        for slot in self.layout.slots:
            current.append(slot)
            if slot.global_range.end - current[0].global_range.start >= bucket_numel:
                buckets.append(current)
                current = []
        if current:
            buckets.append(current)
        out = []
        for i, slots in enumerate(buckets):
            end = buckets[i + 1][0].global_range.start if i + 1 < len(buckets) else self.layout.numel
            out.append(_Bucket(Range(slots[0].global_range.start, end), slots, pending=len(slots)))
        return out


class Zero2Optimizer:
    """ZeRO stage 2 over any pointwise torch optimizer (SGD, AdamW, ...).

    What is sharded: each rank keeps the optimizer state, the fp32 master weights and the
    fp32 gradients of its 1/W element range of every per-dtype flat buffer (`parallel.flat`).
    Parameters stay whole on every rank (as views into the flat buffers), so the module runs
    unchanged.

    When communication happens:
      * during `backward()`: a hook copies each gradient into its bucket's scratch and frees
        it; a full bucket is reduced (summed, then divided by W like DDP) to the ranks owning
        its elements, asynchronously, buckets in a fixed order on every rank;
      * in `clip_grad_norm_` / `unscale_and_check_`: one all-reduce of a scalar;
      * in `step()`: the remaining reductions are awaited, every rank steps its shard, and the
        parameters are all-gathered.

    Every rank must call `backward`, `step`, `clip_grad_norm_`, `state_dict` and
    `load_state_dict` together. Parameters receive no `.grad` (it lives in the shards); use
    `clip_grad_norm_` for the norm. Move the module to its device and dtype before building
    this optimizer: `.to()` afterwards would detach the parameters from the flat buffers.
    Parameters must be used in every backward pass on every rank (no unused parameters).

    Example::

        opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        loss.backward()
        opt.clip_grad_norm_(5.0, extra_params=head.parameters())
        opt.step(); opt.zero_grad()
    """

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.SGD, process_group=None,
                 bucket_cap_mb: float = 25.0, **defaults):
        self.module = module
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.rank = get_rank(process_group)
        self.name_of = {p: n for n, p in module.named_parameters()}
        self.groups: list[_DtypeGroup] = []
        for layout in build_layouts(module, self.world_size, self.rank, reverse=True):
            bucket_numel = max(1, int(bucket_cap_mb * 2**20 / layout.element_size))
            self.groups.append(_DtypeGroup(layout, bucket_numel))
        self.optimizer = optimizer_class([g.master for g in self.groups], **defaults)
        self._hooks = []
        for g in self.groups:
            for slot in g.layout.slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(g, slot)))

    # ----- gradient reduction -------------------------------------------------------
    def _grad_ready(self, group: _DtypeGroup, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            bucket = group.bucket_of[slot.name]
            if bucket.launched:  # gradient accumulation: the previous pass is still in flight
                self._complete(group, bucket)
            if bucket.scratch is None:
                bucket.scratch = torch.zeros(bucket.range.size, dtype=param.dtype, device=param.device)
            slot.global_range.shift(bucket.range.start).of(bucket.scratch).add_(param.grad.reshape(-1))
            param.grad = None
            bucket.pending -= 1
            if bucket.pending == 0:
                bucket.ready = True
                self._launch_ready(group)
        return hook

    def _launch_ready(self, group: _DtypeGroup, flush: bool = False) -> None:
        """Launch ready buckets strictly in bucket order, so all ranks issue the same calls."""
        for bucket in group.buckets:
            if bucket.launched:
                continue
            if not (bucket.ready or flush):
                return
            if bucket.scratch is None:
                bucket.scratch = torch.zeros(bucket.range.size, dtype=group.layout.dtype,
                                             device=group.layout.device)
            for r in range(self.world_size):
                piece = bucket.range.intersect(group.layout.shard_of(r))
                if not piece.size:
                    continue
                data = piece.shift(bucket.range.start).of(bucket.scratch)
                if self.world_size > 1:
                    dst = r if self.group is None else dist.get_global_rank(self.group, r)
                    bucket.handles.append(dist.reduce(data, dst=dst, group=self.group, async_op=True))
                if r == self.rank:
                    bucket.pieces.append((piece.shift(group.layout.shard.start), data))
            bucket.launched = True

    def _finish_reduction(self) -> None:
        """Flush incomplete buckets, wait for all reductions, accumulate into the fp32 shards."""
        for g in self.groups:
            if not any(b.scratch is not None for b in g.buckets):
                continue  # no backward since the last step
            self._launch_ready(g, flush=True)
            for bucket in g.buckets:
                self._complete(g, bucket)

    def _complete(self, group: _DtypeGroup, bucket: _Bucket) -> None:
        """Wait for a launched bucket, add its reduced part to the gradient shard, reset it."""
        for h in bucket.handles:
            h.wait()
        for shard_range, data in bucket.pieces:
            shard_range.of(group.master.grad).add_(data.float(), alpha=1.0 / self.world_size)
        bucket.scratch, bucket.handles, bucket.pieces = None, [], []
        bucket.ready = bucket.launched = False
        bucket.pending = len(bucket.slots)

    # ----- the torch.optim.Optimizer surface ---------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._finish_reduction()
        for g in self.groups:
            g.master.grad.zero_()

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradient shards (after backward)."""
        self._finish_reduction()
        return [g.master.grad for g in self.groups]

    def _global_sum(self, local: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
        total = local.clone()
        for t in extra:
            total += t
        if self.world_size > 1:
            dist.all_reduce(total, group=self.group)
        return total

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, extra_params=()) -> torch.Tensor:
        """Clip by the global L2 norm of all shards plus `extra_params` (model-parallel tensors
        distinct on every rank, such as the head's shard); returns the norm before clipping."""
        shards = self.grad_shards()
        extra = [p.grad for p in extra_params if p.grad is not None]
        dev = shards[0].device
        local = sum((s.float().square().sum() for s in shards), torch.zeros((), device=dev))
        norm = self._global_sum(local, [e.float().square().sum().to(dev) for e in extra]).sqrt()
        if max_norm > 0:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            for t in shards + extra:
                t.mul_(coef.to(t.device))
        return norm

    @torch.no_grad()
    def unscale_and_check_(self, inv_scale: float, extra_params=()) -> bool:
        """Multiply every gradient by inv_scale; True if any rank found inf/NaN (all agree)."""
        shards = self.grad_shards()
        extra = [p.grad for p in extra_params if p.grad is not None]
        bad = torch.zeros((), device=shards[0].device)
        for t in shards + extra:
            t.mul_(inv_scale)
            bad += (~torch.isfinite(t)).any().float().to(bad.device)
        return bool(self._global_sum(bad, []).item() > 0)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("Zero2Optimizer.step does not take a closure")
        self._finish_reduction()
        self.optimizer.step()
        for g in self.groups:
            local = g.layout.shard.of(g.buffer)
            if g.master.data_ptr() != local.data_ptr():
                local.copy_(g.master)
            if self.world_size > 1:
                src = local.clone() if g.buffer.device.type == "cpu" else local
                all_gather_flat(g.buffer, src, group=self.group)

    # ----- world-size independent state --------------------------------------------------
    def _gather_full(self, g: _DtypeGroup, shard: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return shard.clone()
        full = shard.new_empty(g.layout.numel)
        all_gather_flat(full, shard.contiguous(), group=self.group)
        return full

    def state_dict(self) -> dict:
        """Per-parameter optimizer state (full tensors by parameter name): loads at any W."""
        state, master = {}, {}
        for g in self.groups:
            for key, value in self.optimizer.state.get(g.master, {}).items():
                if torch.is_tensor(value) and value.shape == g.master.shape:
                    for name, t in g.layout.unflatten(self._gather_full(g, value)).items():
                        state.setdefault(name, {})[key] = t.clone()
                else:
                    for slot in g.layout.slots:
                        state.setdefault(slot.name, {})[key] = value
            if g.layout.dtype != torch.float32:
                full = self._gather_full(g, g.master.detach())
                master.update({n: t.clone() for n, t in g.layout.unflatten(full).items()})
        groups = [{k: v for k, v in pg.items() if k != "params"} for pg in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups, "master": master}

    def load_state_dict(self, state_dict: dict) -> None:
        for pg, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            pg.update(saved)
        for g in self.groups:
            names = [s.name for s in g.layout.slots]
            missing = [n for n in names if n not in state_dict["state"]] if state_dict["state"] else []
            if missing:
                raise KeyError(f"optimizer state has no entry for parameter '{missing[0]}'")
            per_param = {n: state_dict["state"].get(n, {}) for n in names}
            keys = per_param[names[0]].keys() if names else []
            new_state = {}
            for key in keys:
                value = per_param[names[0]][key]
                if torch.is_tensor(value) and value.dim() > 0:
                    full = g.layout.flatten({n: per_param[n][key] for n in names}, dtype=value.dtype)
                    new_state[key] = g.layout.shard.of(full).clone().to(g.master.device)
                else:
                    new_state[key] = value.clone() if torch.is_tensor(value) else value
            self.optimizer.state[g.master] = new_state
            if g.layout.dtype != torch.float32:
                if state_dict.get("master"):
                    full = g.layout.flatten(state_dict["master"], dtype=torch.float32)
                    g.master.data.copy_(g.layout.shard.of(full))
                else:  # saved without masters (e.g. by DDPOptimizer): start from the weights
                    g.master.data.copy_(g.layout.shard.of(g.buffer))

