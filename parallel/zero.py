"""ZeRO-2: sharded optimizer state, fp32 master weights and gradients over one flat layout."""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch import nn

from shardface.parallel.collectives import all_gather_flat, all_gather_no_grad, reduce_scatter_flat
from shardface.parallel.dist import get_rank, get_world_size
from shardface.parallel.flat import FlatLayout, ParamSlot, Range, ShardPiece, build_layouts
from shardface.parallel.grad_ops import clip_global_norm_, unscale_and_check_
from shardface.parallel.scratch import ScratchPool
from shardface.parallel.wrapped import WrappedOptimizer


class BucketState(Enum):
    """Where a gradient bucket is in one backward pass."""

    EMPTY = "empty"  # no gradient of this pass yet
    FILLING = "filling"  # some of its parameters' gradients arrived
    READY = "ready"  # all arrived; waits for the buckets before it to launch
    LAUNCHED = "launched"  # reduction in flight
    DONE = "done"  # added to the gradient shard, scratch released


@dataclass(eq=False)  # identity: buckets are compared by object, never by tensor contents
class _Bucket:
    """A fixed element range of a flat buffer whose gradients are reduced together (a large
    parameter spans several buckets; `slots` are the parameters overlapping the range).
    Collective exchange: the bucket is a segment of the layout and `piece` this rank's 1/W."""

    range: Range
    slots: list[ParamSlot]
    piece: ShardPiece | None = None
    state: BucketState = BucketState.EMPTY
    pending: int = 0
    scratch: torch.Tensor | None = None  # p2p: the bucket's gradients, copied in by the hooks
    tag: int = 0  # distinct per bucket: names its point-to-point messages
    handles: list = field(default_factory=list)
    pieces: list = field(default_factory=list)  # (shard range, [summands]) this rank owns


@dataclass(frozen=True)
class MasterShard:
    """This rank's fp32 master weights of one dtype's layout, as (shard range, tensor) pieces
    that together cover the shard: what the optimizer steps and what an EMA follows."""

    layout: FlatLayout
    pieces: list[tuple[Range, torch.Tensor]]


class _DtypeGroup:
    """The flat parameter buffer of one dtype, its fp32 master shard and fp32 gradient shard."""

    def __init__(
        self, layout: FlatLayout, bucket_numel: int, chunk_numel: int, first_tag: int, collective: bool
    ):
        self.layout = layout
        self.buffer = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        for slot in layout.slots:
            view = slot.global_range.of(self.buffer).view(slot.param.shape)
            view.copy_(slot.param.detach())
            slot.param.data = view  # parameters become views into the flat buffer
        # fp32 models step their own weights (the shard's pieces of the buffer, in place);
        # other dtypes keep an fp32 master copy of the shard and write it back after the step
        if layout.dtype == torch.float32:
            self.master = None
            masters = [(p.shard_range, p.global_range.of(self.buffer)) for p in layout.pieces]
        else:
            self.master = layout.shard_of(self.buffer).detach().float().clone()
            masters = [(Range(0, layout.shard_numel), self.master)]
        self.master_pieces = masters
        self.grad_shard = torch.zeros(layout.shard_numel, dtype=torch.float32, device=layout.device)
        # the torch optimizer steps the shard in chunks (views of the master and of the
        # gradient shard): its per-step temporaries (weight decay's grad + wd*p, Adam's
        # denominator) then stay small enough for the allocator to reuse
        self.chunks = []
        for shard_range, master in masters:
            for start in range(0, shard_range.size, chunk_numel):
                r = Range(start, min(start + chunk_numel, shard_range.size))
                chunk = nn.Parameter(r.of(master.detach()))
                chunk.grad = r.shift(-shard_range.start).of(self.grad_shard)
                self.chunks.append(chunk)
        self.buckets = []
        self.buckets_of: dict[str, list[_Bucket]] = {slot.name: [] for slot in layout.slots}
        if collective:
            # every bucket is a segment of the layout: one reduce-scatter, one all-gather each;
            # gradients accumulate in place in persistent views of `grad_buffer`
            ranges = layout.segments
            self.grad_buffer = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
            self.grad_views = {
                s.name: s.global_range.of(self.grad_buffer).view(s.param.shape) for s in layout.slots
            }
        else:
            # fixed element ranges: a parameter may span buckets (its gradient is copied into
            # each), so every bucket, received piece and pooled buffer is at most bucket_numel
            ranges = [
                Range(s, min(s + bucket_numel, layout.numel)) for s in range(0, layout.numel, bucket_numel)
            ]
            self.grad_buffer, self.grad_views = None, {}
        for i, r in enumerate(ranges):
            bucket = _Bucket(
                r,
                [s for s in layout.slots if s.global_range.intersect(r).size],
                tag=first_tag + i,
                piece=layout.pieces[i] if collective else None,
            )
            self.buckets.append(bucket)
            for slot in bucket.slots:
                self.buckets_of[slot.name].append(bucket)

    def gaps_in(self, bucket: _Bucket) -> list[Range]:
        """Bucket-relative ranges that no parameter covers (alignment and end padding)."""
        gaps, pos = [], bucket.range.start
        for slot in bucket.slots:
            part = slot.global_range.intersect(bucket.range)
            if part.start > pos:
                gaps.append(Range(pos, part.start).shift(bucket.range.start))
            pos = part.end
        if pos < bucket.range.end:
            gaps.append(Range(pos, bucket.range.end).shift(bucket.range.start))
        return gaps

    def write_back(self) -> None:
        """Copy the stepped fp32 master into this rank's pieces of the model-dtype buffer."""
        if self.master is not None:
            for piece in self.layout.pieces:
                piece.global_range.of(self.buffer).copy_(piece.shard_range.of(self.master))


def resolve_exchange(exchange: str, backend: str) -> str:
    """The exchange a Zero2Optimizer uses: 'auto' is 'p2p' under gloo, 'collective' otherwise;
    'local' without a process group (the p2p bookkeeping, no communication)."""
    if exchange not in ("auto", "p2p", "collective"):
        raise ValueError(f"Zero2Optimizer exchange must be 'auto', 'p2p' or 'collective', not {exchange!r}")
    if exchange == "p2p" and backend == "nccl":
        raise ValueError(
            "Zero2Optimizer exchange='p2p' is for gloo: under NCCL point-to-point sends are "
            "slower than its reduce-scatter and all-gather; use exchange='collective' (or 'auto')"
        )
    if backend == "none":  # no process group: one rank, nothing to exchange
        return "local"
    if exchange == "auto":
        exchange = "p2p" if backend == "gloo" else "collective"
    return exchange


class Zero2Optimizer(WrappedOptimizer):
    """ZeRO stage 2 over any pointwise torch optimizer (SGD, AdamW, ...).

    What is sharded: each rank keeps the optimizer state, the fp32 master weights and the
    fp32 gradients of its 1/W of every per-dtype flat buffer (`parallel.flat`). Parameters
    stay whole on every rank (as views into the flat buffers), so the module runs unchanged.

    `exchange` picks how gradients and parameters travel (see benchmarks/README.md, ZeRO-2):
      * "collective" (the default except under gloo): every gradient bucket is a segment of
        the layout and rank r owns its r-th 1/W (Megatron-LM's distributed optimizer).
        Parameters' `.grad` are views of a persistent bucket buffer, so autograd accumulates
        in place and the hooks only count arrivals; a complete bucket is one
        `reduce_scatter_tensor` (average, like DDP), up to `max_inflight_buckets` in flight.
        After `step()` each bucket's parameters are re-assembled by one asynchronous
        `all_gather_into_tensor`, waited by `wait_params()`, which the module's next forward,
        `state_dict()` and `load_state_dict()` call (call it yourself before reading
        parameters any other way).
      * "p2p" (the default under gloo, refused under NCCL): rank r owns [r*N/W, (r+1)*N/W) of
        each buffer; a hook copies each gradient into fixed-size buckets lent by a reusable
        pool (`parallel.scratch`) and frees it; a full bucket is sent point to point to the
        ranks owning its elements, which add the W copies; after `step()` every rank
        broadcasts its shard. Gradient memory is the fp32 shard plus a few buckets
        (`peak_scratch_bytes`), not a full gradient copy.
    Buckets launch in a fixed order on every rank; `max_inflight_buckets` reductions (default
    3 on CUDA, where they overlap backward's compute, else 1) stay open while the next fill.
    `clip_grad_norm_` and `unscale_and_check_` all-reduce one scalar; neither reads a value on
    the host.

    Every rank must call `backward`, `step`, `clip_grad_norm_`, `state_dict` and
    `load_state_dict` together. Move the module to its device and dtype before building this
    optimizer: `.to()` afterwards would detach the parameters from the flat buffers. Every
    trainable parameter must be used in every backward pass on every rank. Change weights
    through `module.load_state_dict` (which refreshes the fp32 masters), not in place.

    Example::

        opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        loss.backward()
        opt.clip_grad_norm_(5.0, extra_params=head.parameters())
        opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_class=torch.optim.SGD,
        process_group=None,
        bucket_cap_mb: float = 16.0,
        max_inflight_buckets: int | None = None,
        step_chunk_mb: float = 4.0,
        exchange: str = "auto",
        **defaults,
    ):
        self.module = module
        self.group = process_group
        self.world_size = get_world_size(process_group)
        self.rank = get_rank(process_group)
        backend = dist.get_backend(process_group) if dist.is_initialized() else "none"
        self.exchange = resolve_exchange(exchange, backend)
        self._p2p, self._collective = self.exchange in ("p2p", "local"), self.exchange == "collective"
        # NCCL averages in the reduce-scatter itself; gloo has no AVG, so it sums and the
        # shard is scaled as the pieces are added
        self._reduce_op = dist.ReduceOp.AVG if self._collective and backend == "nccl" else dist.ReduceOp.SUM
        self._piece_scale = 1.0 if self._reduce_op == dist.ReduceOp.AVG else 1.0 / self.world_size
        self.groups: list[_DtypeGroup] = []
        tags = 0
        segment_bytes = bucket_cap_mb * 2**20 if self._collective else None
        for layout in build_layouts(
            module, self.world_size, self.rank, reverse=True, segment_bytes=segment_bytes
        ):
            bucket_numel = max(1, int(bucket_cap_mb * 2**20 / layout.element_size))
            chunk_numel = max(1, int(step_chunk_mb * 2**20 / 4))  # fp32 master elements
            self.groups.append(_DtypeGroup(layout, bucket_numel, chunk_numel, tags, self._collective))
            tags += len(self.groups[-1].buckets)
        self.optimizer = optimizer_class([c for g in self.groups for c in g.chunks], **defaults)
        if max_inflight_buckets is None:  # on CUDA reductions overlap backward's compute
            device = self.groups[0].layout.device if self.groups else torch.device("cpu")
            max_inflight_buckets = 3 if device.type == "cuda" else 1
        self.max_inflight_buckets = max(1, int(max_inflight_buckets))
        self._inflight: deque = deque()  # (group, bucket) launched, not yet completed
        self._param_handles: list = []  # the all-gathers of the parameters after step()
        self._in_backward = False
        self._no_sync = False
        self._unreduced = False  # gradients accumulated under no_sync, not reduced yet
        self._arrived: set[str] = set()  # parameters whose gradient this backward pass delivered
        self.scratch = ScratchPool()  # bucket and receive buffers, reused every backward
        self._hooks = []
        for g in self.groups:
            for slot in g.layout.slots:
                if self._collective:
                    slot.param.grad = g.grad_views[slot.name]
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._grad_ready(g, slot)))
        # module hooks hold the optimizer weakly: deepcopy(module) (the EMA model) then
        # copies a plain function, not this optimizer
        ref = weakref.ref(self)
        # (a deep copy keeps these hooks too: each acts only on the module it was built for)
        self._hooks.append(module.register_forward_pre_hook(lambda m, args: _call(ref, "wait_params", m)))
        self._hooks.append(
            module.register_state_dict_pre_hook(lambda m, prefix, keep: _call(ref, "wait_params", m))
        )
        self._hooks.append(
            module.register_load_state_dict_pre_hook(lambda m, *args: _call(ref, "wait_params", m))
        )
        self._hooks.append(
            module.register_load_state_dict_post_hook(lambda m, keys: _call(ref, "refresh_master", m))
        )

    # ----- the fp32 master shards ----------------------------------------------------------
    def master_shards(self) -> list[MasterShard]:
        """This rank's fp32 master weights, one entry per dtype (what `ShardedEMA` follows)."""
        return [MasterShard(g.layout, g.master_pieces) for g in self.groups]

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Reload the fp32 masters from the module's weights (after the weights were loaded)."""
        self.wait_params()
        for g in self.groups:
            if g.master is not None:
                g.master.copy_(g.layout.shard_of(g.buffer))

    # ----- gradient reduction -------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients without reducing them (the micro-steps
        of gradient accumulation); the first backward after it reduces the sum. The
        accumulated gradients are full-size (collective: in the bucket views; p2p: `.grad`)."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def _grad_ready(self, group: _DtypeGroup, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            if not self._in_backward:  # first gradient of a backward pass
                self._in_backward = True
                self._arrived = set()
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._arrived.add(slot.name)
            if self._collective:
                view = group.grad_views[slot.name]
                if param.grad.data_ptr() != view.data_ptr():  # .grad was replaced (set to None)
                    view.copy_(param.grad)
                    param.grad = view
            if self._no_sync:
                self._unreduced = True
                return
            if self._p2p:
                grad = param.grad.reshape(-1)
                param.grad = None
            for bucket in group.buckets_of[slot.name]:
                # a bucket still launched or done holds an earlier backward pass (gradient
                # accumulation): finish that one, then start this pass's sum afresh
                self._complete(group, bucket)
                if bucket.state == BucketState.DONE:
                    bucket.state = BucketState.EMPTY
                if bucket.state == BucketState.EMPTY:
                    if self._p2p:
                        self._alloc_scratch(group, bucket)
                    bucket.state, bucket.pending = BucketState.FILLING, len(bucket.slots)
                if self._p2p:
                    part = slot.global_range.intersect(bucket.range)
                    part.shift(bucket.range.start).of(bucket.scratch).copy_(
                        part.shift(slot.global_range.start).of(grad)
                    )
                bucket.pending -= 1
                if bucket.pending == 0:
                    bucket.state = BucketState.READY
                    self._launch_ready(group)  # before filling the next: bounds the scratch

        return hook

    def _end_of_backward(self) -> None:
        """Every bucket is full, hence launched, once every parameter's gradient arrived."""
        self._in_backward = False
        missing = [s.name for g in self.groups for s in g.layout.slots if s.name not in self._arrived]
        if missing:  # its bucket would never be complete: the ranks' reductions would diverge
            raise RuntimeError(
                f"Zero2Optimizer: parameter '{missing[0]}' ({len(missing)} in all) got no gradient in "
                f"this backward pass; every trainable parameter must be used in every pass "
                f"(freeze unused ones with requires_grad_(False) before building the optimizer)"
            )
        if self._collective:
            # the next backward accumulates into the same bucket views: the reductions reading
            # them must be complete first (on CUDA, wait() only orders the streams)
            self._finish_reduction()
        if not self._no_sync:
            self._unreduced = False

    def _launch_ready(self, group: _DtypeGroup) -> None:
        """Launch ready buckets strictly in bucket order, so all ranks issue the same calls."""
        for bucket in group.buckets:
            if bucket.state in (BucketState.LAUNCHED, BucketState.DONE):
                continue
            if bucket.state != BucketState.READY:
                return
            self._launch(group, bucket)

    def _launch(self, group: _DtypeGroup, bucket: _Bucket) -> None:
        """Start reducing the bucket to the ranks owning its elements: one reduce-scatter
        (collective), or each rank sends every other owner its piece and receives the others'
        copies of its own piece (p2p)."""
        if self._collective:
            out = self.scratch.take(bucket.piece.global_range.size, group.layout.dtype, group.layout.device)
            bucket.handles.append(
                reduce_scatter_flat(
                    out,
                    bucket.range.of(group.grad_buffer),
                    op=self._reduce_op,
                    group=self.group,
                    async_op=True,
                )
            )
            bucket.pieces.append((bucket.piece.shard_range, [out]))
        else:
            for r in range(self.world_size):
                owned = group.layout.pieces_of(r)[0].global_range  # p2p layouts have one segment
                piece = bucket.range.intersect(owned)
                if not piece.size:
                    continue
                data = piece.shift(bucket.range.start).of(bucket.scratch)
                if r == self.rank:
                    summands = [data]
                    for other in range(self.world_size):
                        if other != r:
                            summands.append(self.scratch.take(piece.size, data.dtype, data.device))
                            bucket.handles.append(
                                dist.irecv(
                                    summands[-1],
                                    src=self._global_rank(other),
                                    group=self.group,
                                    tag=bucket.tag,
                                )
                            )
                    bucket.pieces.append((piece.shift(owned.start), summands))
                else:
                    bucket.handles.append(
                        dist.isend(data, dst=self._global_rank(r), group=self.group, tag=bucket.tag)
                    )
        bucket.state = BucketState.LAUNCHED
        self._inflight.append((group, bucket))
        while len(self._inflight) > self.max_inflight_buckets:  # bound the scratch memory
            self._complete(*self._inflight.popleft())

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    @property
    def peak_scratch_bytes(self) -> int:
        """Most memory the gradient scratch (buckets, received pieces) has held at once."""
        return self.scratch.peak_held_bytes

    def _alloc_scratch(self, group: _DtypeGroup, bucket: _Bucket) -> None:
        bucket.scratch = self.scratch.take(bucket.range.size, group.layout.dtype, group.layout.device)
        for gap in group.gaps_in(bucket):  # alignment padding: every gradient is copied in
            gap.of(bucket.scratch).zero_()

    def _finish_reduction(self) -> None:
        """Wait for the reductions still open and accumulate them into the fp32 shards."""
        while self._inflight:
            self._complete(*self._inflight.popleft())

    def _complete(self, group: _DtypeGroup, bucket: _Bucket) -> None:
        """Wait for a launched bucket, add its reduced part to the gradient shard, free it."""
        if bucket.state != BucketState.LAUNCHED:
            return
        if (group, bucket) in self._inflight:
            self._inflight.remove((group, bucket))
        for h in bucket.handles:
            h.wait()
        for shard_range, summands in bucket.pieces:
            grad = shard_range.of(group.grad_shard)
            for data in summands:
                grad.add_(data, alpha=self._piece_scale)
            if self._collective:
                self.scratch.give(summands[0])
            for received in summands[1:]:
                self.scratch.give(received)
        if self._collective:
            bucket.range.of(group.grad_buffer).zero_()  # ready for the next pass to accumulate
        else:
            self.scratch.give(bucket.scratch)
        bucket.scratch, bucket.handles, bucket.pieces = None, [], []
        bucket.state = BucketState.DONE

    # ----- the torch.optim.Optimizer surface (param_groups, state: WrappedOptimizer) ------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero this rank's fp32 gradient shard (and gradients held back by `no_sync`).
        `set_to_none` is accepted for torch's signature and has no effect: the shard is
        persistent storage the optimizer's chunks are views of, so it is zeroed in place."""
        self._finish_reduction()
        for g in self.groups:
            g.grad_shard.zero_()
        if self._unreduced:  # accumulated under no_sync and never reduced: drop them
            for g in self.groups:
                if g.grad_buffer is not None:
                    g.grad_buffer.zero_()
                else:
                    for slot in g.layout.slots:
                        slot.param.grad = None
            self._unreduced = False

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's reduced fp32 gradient shards (after backward), as the optimizer's chunks:
        norms and inf checks then allocate chunk-sized temporaries, not shard-sized ones."""
        self._finish_reduction()
        return [c.grad for g in self.groups for c in g.chunks]

    def clip_grad_norm_(self, max_norm: float, extra_params=()) -> torch.Tensor:
        """Clip by the global L2 norm of all shards plus `extra_params` (model-parallel tensors
        distinct on every rank, such as the head's shard); returns the norm before clipping."""
        extra = [p.grad for p in extra_params if p.grad is not None]
        return clip_global_norm_(self.grad_shards() + extra, [], max_norm, self.group)

    def unscale_and_check_(self, inv_scale: float, extra_params=()) -> torch.Tensor:
        """Multiply every gradient by inv_scale; a device flag > 0 if any rank found inf/NaN (all agree)."""
        extra = [p.grad for p in extra_params if p.grad is not None]
        return unscale_and_check_(self.grad_shards() + extra, inv_scale, self.group)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Step every rank's shard, then re-assemble the parameters (collective: asynchronously,
        waited by `wait_params()` before the module's next forward)."""
        if closure is not None:
            raise ValueError("Zero2Optimizer.step does not take a closure")
        self._finish_reduction()
        self.wait_params()  # the previous step's all-gather reads the buffer this step writes
        self.optimizer.step()
        for g in self.groups:
            g.write_back()
            if self._p2p and self.world_size > 1:
                # gloo's all-gather is slow: every rank broadcasts its shard, concurrently
                owned = [g.layout.pieces_of(r)[0].global_range for r in range(self.world_size)]
                handles = [
                    dist.broadcast(o.of(g.buffer), src=self._global_rank(r), group=self.group, async_op=True)
                    for r, o in enumerate(owned)
                ]
                for h in handles:
                    h.wait()
            elif self._collective:
                for bucket in g.buckets:  # in place: this rank's piece is the r-th 1/W of the bucket
                    self._param_handles.append(
                        all_gather_flat(
                            bucket.range.of(g.buffer),
                            bucket.piece.global_range.of(g.buffer),
                            group=self.group,
                            async_op=True,
                        )
                    )

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers of the last `step()` (on CUDA: the current stream
        waits for them, the host does not)."""
        handles, self._param_handles = self._param_handles, []
        for h in handles:
            h.wait()

    # ----- world-size independent state --------------------------------------------------
    def _shard_state(self, g: _DtypeGroup) -> dict:
        """This rank's optimizer state of one dtype with the chunks joined: shard-sized tensors
        for per-element state, the first chunk's value for the rest (scalars, step counts)."""
        per_chunk = [self.optimizer.state.get(c, {}) for c in g.chunks]
        joined = {}
        for key, value in per_chunk[0].items():
            if torch.is_tensor(value) and value.shape == g.chunks[0].shape:
                joined[key] = torch.cat([s[key] for s in per_chunk])
            else:
                joined[key] = value
        return joined

    def _gather_full(
        self, layout: FlatLayout, shard: torch.Tensor, to_rank: int | None
    ) -> torch.Tensor | None:
        """The full flat vector of a shard-sized tensor: on every rank (to_rank None) or on
        group rank `to_rank` only (None elsewhere)."""
        if self.world_size == 1:
            return layout.assemble(shard)
        if to_rank is None:
            return layout.assemble(all_gather_no_grad(shard, self.group))
        shard = shard.contiguous()
        parts = [torch.empty_like(shard) for _ in range(self.world_size)] if self.rank == to_rank else None
        dist.gather(shard, parts, dst=self._global_rank(to_rank), group=self.group)
        return layout.assemble(torch.cat(parts)) if parts is not None else None

    @torch.no_grad()
    def state_dict(self, to_rank: int | None = None) -> dict | None:
        """Per-parameter optimizer state (full tensors by parameter name, on the CPU): loads at
        any W. Collective: every rank calls it. `to_rank=None` returns it on every rank;
        `to_rank=r` gathers it to group rank r only (one gather per state tensor) and the other
        ranks return None: what a checkpoint written by one rank needs."""
        keep = to_rank is None or self.rank == to_rank
        state, master = {}, {}
        for g in self.groups:
            per_element = {}
            for key, value in self._shard_state(g).items():
                if torch.is_tensor(value) and value.shape == (g.layout.shard_numel,):
                    per_element[key] = value
                elif keep:
                    for slot in g.layout.slots:
                        state.setdefault(slot.name, {})[key] = (
                            value.cpu().clone() if torch.is_tensor(value) else value
                        )
            if g.master is not None:
                per_element[None] = g.master
            for key, value in per_element.items():
                full = self._gather_full(g.layout, value, to_rank)
                if full is None:
                    continue
                tensors = {n: t.cpu().clone() for n, t in g.layout.unflatten(full).items()}
                if key is None:
                    master.update(tensors)
                else:
                    for name, t in tensors.items():
                        state.setdefault(name, {})[key] = t
        if not keep:
            return None
        return {"state": state, "param_groups": self._param_groups_state(), "master": master}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self._load_param_groups(state_dict["param_groups"])
        for g in self.groups:
            names = [s.name for s in g.layout.slots]
            missing = [n for n in names if n not in state_dict["state"]] if state_dict["state"] else []
            if missing:
                raise KeyError(f"optimizer state has no entry for parameter '{missing[0]}'")
            per_param = {n: state_dict["state"].get(n, {}) for n in names}
            keys = per_param[names[0]].keys() if names else []
            chunk_states = [{} for _ in g.chunks]
            for key in keys:
                value = per_param[names[0]][key]
                if torch.is_tensor(value) and value.dim() > 0:
                    full = g.layout.flatten({n: per_param[n][key] for n in names}, dtype=value.dtype)
                    shard = g.layout.shard_of(full).to(g.grad_shard.device)
                    pieces = shard.split([c.numel() for c in g.chunks])
                    for chunk_state, piece in zip(chunk_states, pieces):
                        chunk_state[key] = piece.clone()
                else:
                    for chunk_state in chunk_states:
                        chunk_state[key] = value.clone() if torch.is_tensor(value) else value
            for chunk, chunk_state in zip(g.chunks, chunk_states):
                if chunk_state:
                    self.optimizer.state[chunk] = chunk_state
            if g.master is not None:
                if state_dict.get("master"):
                    full = g.layout.flatten(state_dict["master"], dtype=torch.float32)
                    g.master.copy_(g.layout.shard_of(full))
                else:  # saved without masters (e.g. by DDPOptimizer): start from the weights
                    self.refresh_master()


def _call(ref: weakref.ref, method: str, module: nn.Module) -> None:
    """Call a method of a weakly held optimizer, if it still exists and `module` is the one it
    steps: a copy of the module (the EMA model) must not refresh the live optimizer's masters
    from its own weights."""
    obj = ref()
    if obj is not None and obj.module is module:
        getattr(obj, method)()
