"""Cross-entropy over a class-sharded, margin-adjusted cosine classifier, in one pass.

Each rank holds the weight rows of its class shard and the normalised embeddings of the
whole global batch. The batch is processed in blocks of rows; for each block:

1. cosines of the block against the shard, tile by tile (K classes at a time), kept, and the
   block's local row statistics (log-sum-exp);
2. one all-gather of those statistics, from which every rank forms log Z of each row
   (logits are never concatenated or exchanged);
3. the softmax gradient from the kept cosines, tile by tile, straight into the gradient of
   the embeddings and of the weight (the three GEMMs any exact head needs: logits, dE, dW).

What is kept between 1 and 3 is one fp32 value per (row, shard row): the cosine, or, where
the margin's other logits are s * cos (`MarginLoss.linear_other_logits`), exp(logit) itself, so that
one exponential per logit serves both the statistics and the gradient (see EXP_RANGE). Where:
the first block (up to D rows) in the weight gradient's own buffer, which nothing else uses
before that block's gradient is written (tile j's values, rows x K_j floats, fit in the
K_j x D rows of the gradient that tile j then writes, and are read before they are
overwritten); later blocks of `row_block` rows in one block buffer. So a global batch of at
most D rows costs no memory beyond the weight gradient.

No pass over the shard's C x D values beyond the three GEMMs but these: the weight rows'
norms (one pass, forward) and the normalisation's radial correction g_j -= r_j inv_j^2 w_j,
applied to each tile's gradient rows right after the GEMM that wrote them (with the fused head
optimizer, inside its row step, where it replaces SGD's and Adam's own weight-decay pass).
r_j = sum_i dcos_ij cos_ij is taken from the tile (rows x K_j values) where that moves fewer
bytes than <g_j, w_j> over the rows (2 x K_j x D): the tile's product and column sum move
4 x rows x K_j, so where the batch is one block of 2 x rows <= D. On the exp(logit) path that
needs the logits beside their exponentials: the block kept in the gradient's buffer keeps both
there (2 x rows floats per row of the gradient fit in D), the fused head in a second tile.
Otherwise (a global batch of more than D / 2 rows, or sampled rows, whose block buffer has no
room for logits) r_j = <g_j, w_j> of the complete gradient rows, in the last block's dW step.

The last block's gradient pass runs in backward, with the incoming gradient folded into its
row scale: with one block (a global batch of at most D rows), nothing else touches the weight
gradient; earlier blocks' sums are scaled in the last block's dW step. Under `torch.no_grad()`
only the statistics are formed. The margin (losses/base.py) shapes each logit elementwise;
the target cosines of the global batch are all-reduced up front, so every rank knows every
row's target logit, and the per-row context of the margin (norm statistics, CurricularFace's
t) is the same everywhere.

Nothing here waits on the device: no `nonzero`, `unique`, `.item()` or boolean indexing;
rows without a target on this rank are handled with gathers and scatters that write an
unchanged value back.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from shardface.configs.schema import keys
from shardface.losses.base import MarginLoss
from shardface.parallel.collectives import all_gather_flat
from shardface.parallel.dist import get_world_size

EPS = 1e-12
# Where a margin's other logits are s * cos (`MarginLoss.linear_other_logits`), the head keeps
# exp(s cos) itself, unshifted, while s + log C stays under this: fp32's normal range is
# e^-87.3 .. e^88.7, so every kept value (|cos| <= 1), every row sum (<= C e^s) and exp(-log Z)
# stay normal, and one exp per element serves both the statistics and the gradient.
EXP_RANGE = 85.0
PRECISIONS = ("fp32", "tf32", "bf16")


@dataclass(frozen=True)
class HeadPlan:
    """How the head walks its work: `tile` classes per GEMM tile, `row_block` rows of the
    global batch per block after the first (the first has up to D rows and is kept in the
    weight gradient's buffer; later ones in a buffer of row_block x shard values), and the
    precision of the logits GEMM (row statistics and gradients stay fp32).

    `fused`: no weight gradient is ever held. Forward forms only the statistics; backward
    recomputes each tile's cosines for the whole batch (a fourth GEMM), and as soon as a
    tile's weight gradient is complete hands it to `step_rows(rows, grad, decay)` (the head
    optimizer's update of those rows with gradient grad + decay_j w_j), then drops it."""

    tile: int = keys()["chunk_size"].default  # the defaults are the config's (configs/schema.py)
    row_block: int = keys()["row_block"].default
    precision: str = "fp32"
    fused: bool = False

    def __post_init__(self):
        if self.tile < 1 or self.row_block < 1:
            raise ValueError(f"tile and row_block must be >= 1, got {self.tile}, {self.row_block}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


def _tf32(enabled: bool):
    if not enabled or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return _AllowTF32()


class _AllowTF32:
    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def rows_of_classes(classes: torch.Tensor, k: int) -> torch.Tensor:
    """Weight rows of the given classes with k sub-centres each (class-major)."""
    if k == 1:
        return classes
    return (classes[:, None] * k + torch.arange(k, device=classes.device)).reshape(-1)


def _slice_rows(rows: dict[str, torch.Tensor], r0: int, r1: int) -> dict[str, torch.Tensor]:
    return {name: (v[r0:r1] if v.dim() else v) for name, v in rows.items()}


def _put(tile: torch.Tensor, col: torch.Tensor, has: torch.Tensor, value: torch.Tensor) -> None:
    """tile[i, col[i]] = value[i] where has[i] (col, has: n x 1, col within the tile); other rows
    keep their value (no host sync; three kernels)."""
    tile.scatter_(1, col, torch.where(has, value[:, None], tile.gather(1, col)))


# Row dot products' temporary (vecdot forms the elementwise product of its inputs first): on a
# CPU a slice of 1024 rows, whose product stays in cache (the fastest there, measured against
# whole tiles and bmm); elsewhere (a GPU: memory- and launch-bound) slices of at most 4M values
# (16 MB in fp32): 1-4 launches of mul and sum per tile instead of one pair per 1024 rows
ROW_DOTS_CPU_ROWS = 1024
ROW_DOTS_DEVICE_VALUES = 1 << 22


def _row_dots(a: torch.Tensor, b: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """<a_j, b_j> for every row j, a slice of rows at a time (see ROW_DOTS_CPU_ROWS)."""
    if rows is None:
        on_cpu = a.device.type == "cpu"
        rows = ROW_DOTS_CPU_ROWS if on_cpu else max(ROW_DOTS_CPU_ROWS, ROW_DOTS_DEVICE_VALUES // a.shape[1])
    out = a.new_empty(a.shape[0])
    for r0 in range(0, a.shape[0], rows):
        torch.linalg.vecdot(a[r0 : r0 + rows], b[r0 : r0 + rows], out=out[r0 : r0 + rows])
    return out


class _Shard:
    """The classes this rank computes this step: the whole shard or a sampled index. The rows'
    inverse norms are computed once per step: for the whole shard up front, for a sample by the
    first walk over each tile (the statistics), and reused by the gradient's."""

    def __init__(self, weight: torch.Tensor, index: torch.Tensor | None, k: int):
        self.weight, self.index, self.k = weight, index, k
        self.classes = weight.shape[0] // k if index is None else index.numel()
        self.inv_norm = (
            None
            if index is not None
            else torch.linalg.vector_norm(weight.float(), dim=1).clamp_min_(EPS).reciprocal_()
        )
        self._sampled_inv: dict[int, torch.Tensor] = {}

    def tile(self, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(weight rows of classes [c0, c1) as fp32, their inverse norms, their shard rows)."""
        k = self.k
        if self.index is None:
            w = self.weight[c0 * k : c1 * k].float()
            return w, self.inv_norm[c0 * k : c1 * k], None
        rows = rows_of_classes(self.index[c0:c1], k)
        w = self.weight[rows].float()
        inv = self._sampled_inv.get(c0)
        if inv is None:
            inv = self._sampled_inv[c0] = torch.linalg.vector_norm(w, dim=1).clamp_min_(EPS).reciprocal_()
        return w, inv, rows

    def target_cos(self, emb_n: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """cos of each row's target class where it lives on this rank, else 0 (max over
        sub-centres)."""
        has = labels >= 0
        cls = labels.clamp_min(0)
        if self.index is not None:
            cls = self.index[cls]
        w = self.weight[rows_of_classes(cls, self.k)].float().view(len(cls), self.k, -1)
        w_n = w / torch.linalg.vector_norm(w, dim=2, keepdim=True).clamp_min(EPS)
        cos = torch.einsum("bd,bkd->bk", emb_n, w_n).amax(1).clamp(-1.0, 1.0)
        return torch.where(has, cos, 0.0)


class ShardedMarginCE(torch.autograd.Function):
    """loss = mean_i(log Z_i - t_i) [+ margin.regularizer] over the global batch; identical
    on every rank.

    Inputs: `emb_n` (B x D, L2-normalised, fp32), `norms` (B, raw embedding norms), `weight`
    (shard rows x D; k rows per class with sub-centres), `labels` (B, column index into the
    shard, or into `index` when sampling; -1 when the class is on another rank), `index`
    (sampled shard classes, sorted, or None for all).
    """

    @staticmethod
    def forward(
        ctx, emb_n, norms, weight, labels, index, margin: MarginLoss, plan: HeadPlan, group, step_rows=None
    ):
        world = get_world_size(group)
        grads = any(ctx.needs_input_grad[:3])
        k = margin.subcenters
        shard = _Shard(weight, index, k)
        has = labels >= 0

        # the global batch's target cosines and logits, identical on every rank
        cos_y = shard.target_cos(emb_n, labels)
        if world > 1:
            dist.all_reduce(cos_y, group=group)
        with torch.enable_grad():
            cos_leaf = cos_y.detach().requires_grad_(grads)
            norm_leaf = norms.detach().requires_grad_(grads and margin.uses_norms)
            rows = margin.begin_step(cos_y.detach(), norm_leaf)
            t_logit = margin.target_logit(cos_leaf, rows)
            if grads:  # elementwise margins: d t_i / d cos_i and d t_i / d norm_i
                leaves = [cos_leaf] + ([norm_leaf] if margin.uses_norms else [])
                d_t = torch.autograd.grad(t_logit.sum(), leaves)
        t_logit = t_logit.detach()
        rows = {n: v.detach() for n, v in rows.items()}

        walk = _Walk(emb_n, shard, labels, has, t_logit, margin, rows, plan, group, grads and not plan.fused)
        if grads:
            walk.d_t_dcos = d_t[0]
        log_z = walk.run()  # every block's statistics; every block's gradient but the last's
        loss = (log_z - t_logit).mean()

        if grads:
            if plan.fused and step_rows is None:
                raise RuntimeError(
                    "PartialFC(fused_optimizer=True) needs its SampledRowsOptimizer: "
                    "create one for the head before the first backward"
                )
            walk.log_z, walk.step_rows = log_z, step_rows if plan.fused else None
            ctx.walk, ctx.d_t, ctx.weight_dtype = walk, d_t, weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        walk, d_t = ctx.walk, ctx.d_t
        del ctx.walk, ctx.d_t
        walk.finish(grad_loss.float())  # fused: the weight's update happens here, tile by tile
        # the target column's gradient went into the GEMMs through dcos_y; the norm's share
        # (MagFace) comes from the rank that owns the target only
        grad_norm = walk.d_target * d_t[1] if len(d_t) > 1 else None
        grad_weight = None
        if walk.step_rows is None:
            grad_weight = walk.grad_weight.to(ctx.weight_dtype)
            walk.grad_weight = None  # the returned gradient is then the only reference: no copy
        return walk.grad_emb, grad_norm, grad_weight, None, None, None, None, None, None


class _Walk:
    """One pass over row blocks x class tiles (see the module docstring)."""

    def __init__(
        self,
        emb_n,
        shard: _Shard,
        labels,
        has,
        t_logit,
        margin: MarginLoss,
        rows,
        plan: HeadPlan,
        group,
        grads: bool,
    ):
        self.emb_n = emb_n
        self.shard = shard
        self.labels = labels
        self.has = has
        self.t_logit = t_logit
        self.margin = margin
        self.rows = rows
        self.plan = plan
        self.group = group
        self.grads = grads
        B, D = emb_n.shape
        self.k = shard.k
        self.K = max(1, min(plan.tile, shard.classes))
        self.tiles = [(c0, min(c0 + self.K, shard.classes)) for c0 in range(0, shard.classes, self.K)]
        # the first block is kept inside the weight gradient (see the module docstring): only
        # where that buffer is laid out like the tiles (no sampling)
        in_grad = grads and shard.index is None
        first = min(B, D) if in_grad else B if not grads else max(1, min(plan.row_block, B))
        rest = max(1, min(plan.row_block, B))
        self.blocks = [(0, first)] + [(r0, min(r0 + rest, B)) for r0 in range(first, B, rest)]
        self.first_in_grad = in_grad
        self.world = get_world_size(group)
        # linear margins: exp(s cos) formed once per logit and kept for the gradient (EXP_RANGE)
        lin = margin.linear_other_logits()
        linear = self.k == 1 and lin is not None and lin[0] + math.log(shard.classes * self.world) < EXP_RANGE
        self.exp_scale = lin[0] if linear else None
        # logits clamped to s * (lo, hi) carry no gradient; the gradient pass tells them apart by
        # their kept exponential. A clamped value is exp of the bound rounded to fp32 (at s = 60
        # that rounding alone moves exp by up to ~60 ulps), to within the exp kernel's few ulps:
        # the thresholds sit 1e-6 (~8 ulps) inside exp(fp32 bound), computed on the host
        self.clamp = None
        if linear and (math.isfinite(lin[1]) or math.isfinite(lin[2])):
            self.clamp = (lin[0] * lin[1], lin[0] * lin[2])
            lo, hi = (float(np.float32(b)) for b in self.clamp)
            self.exp_clamp = (math.exp(lo) * (1 + 1e-6), math.exp(hi) * (1 - 1e-6))
        if self.exp_scale is not None:
            self.exp_t = torch.exp(t_logit)
        # the weight's radial term from the tile where that moves fewer bytes than the rows' dot
        # products (one block, 2 x rows <= D); on the exp path the logits are kept beside their
        # exponentials for it: in the gradient's buffer, or a second tile (fused)
        small = 2 * B <= D and (plan.fused or len(self.blocks) == 1)
        self.keep_logits = in_grad and self.exp_scale is not None and small
        self.radial_from_tile = small and (self.exp_scale is None or self.keep_logits or plan.fused)
        self.step_rows = None
        self._scratch_bufs: dict[str, torch.Tensor] = {}
        self._block_targets: dict[tuple[int, int], tuple] = {}
        self._inv_s: dict[int, torch.Tensor] = {}  # a tile's inv_j * s (the exp path), by class c0
        self._decay_scales: dict[bool, torch.Tensor] = {}  # the whole shard's -inv_j^2 [/ s]
        if grads:
            n_rows = shard.classes * self.k
            self.grad_emb = torch.empty_like(emb_n)
            if shard.index is None:
                self.grad_weight = torch.empty(shard.weight.shape, dtype=torch.float32, device=emb_n.device)
            else:  # unsampled rows get an exact zero
                self.grad_weight = torch.zeros(shard.weight.shape, dtype=torch.float32, device=emb_n.device)
            self.d_target = torch.zeros(B, dtype=torch.float32, device=emb_n.device)
            later = max((r1 - r0 for r0, r1 in self.blocks[1 if in_grad else 0 :]), default=0)
            self.cos_buf = torch.empty(later * n_rows, dtype=torch.float32, device=emb_n.device)

    def _kept(self, r0: int, pos: int, width: int, n: int) -> torch.Tensor:
        """Where the cosines (or, with `exp_scale`, exp(logit)) of rows [r0, r0 + n) x shard
        rows [pos, pos + width) are kept."""
        if r0 == 0 and self.first_in_grad:
            return self.grad_weight[pos : pos + width].view(-1)[: n * width].view(n, width)
        return self.cos_buf[pos * n : (pos + width) * n].view(n, width)

    def _kept_logits(self, pos: int, width: int, n: int) -> torch.Tensor:
        """With `keep_logits`: the first block's logits, beside their exponentials in the same
        gradient rows (2 n x width floats fit in those width x D rows)."""
        return self.grad_weight[pos : pos + width].view(-1)[n * width : 2 * n * width].view(n, width)

    def _scratch(self, name: str, n: int, width: int) -> torch.Tensor:
        """A tile-sized buffer, one per name, reused by every tile of the step."""
        buf = self._scratch_bufs.get(name)
        if buf is None or buf.numel() < n * width:
            buf = self._scratch_bufs[name] = torch.empty(
                n * self.K * self.k, dtype=torch.float32, device=self.emb_n.device
            )
        return buf[: n * width].view(n, width)

    def _gemm_in(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16) if self.plan.precision == "bf16" else x

    def _cosines_into(self, e: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = e . w_j for the tile (the logits GEMM, in the plan's precision)."""
        if e.dtype == torch.float32:
            return torch.mm(e, self._gemm_in(w).t(), out=out)
        return out.copy_(e @ self._gemm_in(w).t())

    def _class_cos(self, cos_sub: torch.Tensor):
        """Class cosines from sub-centre cosines (max over k) and the argmax, or as is."""
        if self.k == 1:
            return cos_sub, None
        vals, arg = cos_sub.view(cos_sub.shape[0], -1, self.k).max(2)
        return vals, arg

    def _exp_logits(
        self, raw: torch.Tensor, inv: torch.Tensor, c0: int, logits: torch.Tensor | None = None
    ) -> None:
        """e . w_j (the tile of classes from c0) -> exp(other logit), in place, for margins with
        linear other logits; the logits themselves (s cos, clamped) into `logits` when given."""
        inv_s = self._inv_s.get(c0)
        if inv_s is None:  # once a step, not at every block and pass
            inv_s = self._inv_s[c0] = inv * self.exp_scale
        logits = raw.mul_(inv_s) if logits is None else torch.mul(raw, inv_s, out=logits)
        if self.clamp is not None:
            logits.clamp_(*self.clamp)
        torch.exp(logits, out=raw)

    def _targets(self, r0: int, r1: int, c0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(column of each row's target in the tile of classes [c0, c0 + width), whether it is
        there), both n x 1. The tile and column of every row's target are formed once per row
        block, so a tile costs one comparison (a GPU step is launch-bound: fewer kernels)."""
        cached = self._block_targets.get((r0, r1))
        if cached is None:
            labels = self.labels[r0:r1]
            tile = torch.where(self.has[r0:r1], labels.div(self.K, rounding_mode="floor"), -1)[:, None]
            col = labels.clamp_min(0).remainder_(self.K)[:, None]
            last = self.tiles[-1][1] - self.tiles[-1][0]  # a narrower last tile: columns within it
            cached = self._block_targets[(r0, r1)] = (
                tile,
                col,
                col.clamp_max(last - 1) if last < self.K else col,
            )
        tile, col, col_last = cached
        return col_last if width < self.K else col, tile == c0 // self.K

    def _logits(self, cos: torch.Tensor, r0: int, r1: int, c0: int, rows) -> torch.Tensor:
        logits = self.margin.other_logits(cos, rows)
        if logits.data_ptr() == cos.data_ptr():
            logits = logits.clone()
        _put(logits, *self._targets(r0, r1, c0, cos.shape[1]), self.t_logit[r0:r1])
        return logits

    def run(self) -> torch.Tensor:
        """Every block's statistics, and the gradient of every block but the last (see `finish`)."""
        B = self.emb_n.shape[0]
        log_z = torch.empty(B, dtype=torch.float32, device=self.emb_n.device)
        with _tf32(self.plan.precision == "tf32"):
            for r0, r1 in self.blocks:
                rows = _slice_rows(self.rows, r0, r1)
                log_z[r0:r1] = self._exchange(self._statistics(r0, r1, rows))
                if self.grads and r1 < B:
                    self._gradient(r0, r1, rows, log_z[r0:r1])
        return log_z

    def _statistics(self, r0: int, r1: int, rows):
        e = self._gemm_in(self.emb_n[r0:r1])
        n = r1 - r0
        lse = torch.full((n,), float("-inf"), device=e.device)  # log-sum-exp of the shard's logits
        total = torch.zeros(n, device=e.device)  # or, with exp_scale, the sum of exp(logit)
        keep_logits = r0 == 0 and self.keep_logits
        pos = 0
        for c0, c1 in self.tiles:
            w, inv, _ = self.shard.tile(c0, c1)
            width = (c1 - c0) * self.k
            if self.grads:
                cos_sub = self._cosines_into(e, w, self._kept(r0, pos, width, n))
            else:
                cos_sub = (e @ self._gemm_in(w).t()).float()
            if self.exp_scale is not None:  # exp(s cos) (what is kept), the target column exp(t)
                self._exp_logits(cos_sub, inv, c0, self._kept_logits(pos, width, n) if keep_logits else None)
                _put(cos_sub, *self._targets(r0, r1, c0, width), self.exp_t[r0:r1])
                total.add_(cos_sub.sum(1))
                pos += width
                continue
            pos += width
            cos_sub.mul_(inv)  # |cos| <= 1 up to rounding; the target's cosine is clamped by the margin
            cos, _ = self._class_cos(cos_sub)
            logits = self._logits(cos, r0, r1, c0, rows)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
        return total.log_() if self.exp_scale is not None else lse

    def _exchange(self, local: torch.Tensor) -> torch.Tensor:
        """log Z per row from every rank's log-sum-exp: one all-gather, exact and overflow-free."""
        if self.world == 1:
            return local
        gathered = local.new_empty(self.world * local.numel())
        all_gather_flat(gathered, local.contiguous(), group=self.group)
        return torch.logsumexp(gathered.view(self.world, -1), dim=0)

    def finish(self, grad_loss: torch.Tensor) -> None:
        """Backward: the last block's gradient pass with the incoming gradient in its row scale
        (fused: the whole batch as one block, cosines recomputed per tile, each tile's weight
        gradient handed to `step_rows` as soon as it is complete). Blocks before the last were
        formed at scale 1 in forward: their rows of dE are scaled here (b x D), their sum in
        the weight gradient in the last block's dW step, tile by tile."""
        B = self.emb_n.shape[0]
        with _tf32(self.plan.precision == "tf32"):
            if self.step_rows is not None:
                self.grad_emb = torch.empty_like(self.emb_n)
                self.d_target = torch.zeros(B, dtype=torch.float32, device=self.emb_n.device)
                self._gradient(0, B, self.rows, self.log_z, scale=grad_loss)
                return
            r0, r1 = self.blocks[-1]
            if r0 > 0:
                self.grad_emb[:r0].mul_(grad_loss)
                self.d_target[:r0].mul_(grad_loss)
            self._gradient(r0, r1, _slice_rows(self.rows, r0, r1), self.log_z[r0:r1], scale=grad_loss)

    def _exp_dcos(
        self,
        x: torch.Tensor,
        logits: torch.Tensor | None,
        r0: int,
        r1: int,
        c0: int,
        row_scale: torch.Tensor,
        dcos_y: torch.Tensor,
        in_place: bool,
    ):
        """On the exp path: d loss / d cos of a tile from its exp(logit) `x` (times the row scale
        coef * s / Z_i; the target column dcos_y; clamped logits 0), and, given the tile's logits
        (s cos), s sum_i dcos_ij cos_ij (else None; `_decay` divides by s)."""
        n, width = x.shape
        clamped = None if self.clamp is None else (x <= self.exp_clamp[0]).logical_or_(x >= self.exp_clamp[1])
        dcos = x.mul_(row_scale) if in_place else torch.mul(x, row_scale, out=self._scratch("dcos", n, width))
        if clamped is not None:
            dcos.masked_fill_(clamped, 0.0)
        _put(dcos, *self._targets(r0, r1, c0, width), dcos_y)
        return dcos, None if logits is None else logits.mul_(dcos).sum(0)

    def _general_dcos(self, cos_sub: torch.Tensor, r0: int, r1: int, c0: int, rows, log_z, coef, dcos_y):
        """Any margin: d loss / d cos of a tile from its cosines, and sum_i dcos_ij cos_ij where
        the radial term comes from the tile (else None)."""
        n, width = cos_sub.shape
        cos, arg = self._class_cos(cos_sub)
        logits = self._logits(cos, r0, r1, c0, rows)
        grad = self.margin.other_grad(cos, rows)
        dl = logits.sub_(log_z[:, None]).exp_()  # softmax; times coef = d loss / d logit
        # d loss / d cos (the target column is put below)
        dcos = dl.mul_(coef * grad) if isinstance(grad, float) else dl.mul_(coef).mul_(grad)
        _put(dcos, *self._targets(r0, r1, c0, width // self.k), dcos_y)
        if arg is not None:
            dsub = torch.zeros_like(cos_sub).view(n, -1, self.k)
            dsub.scatter_(2, arg[..., None], dcos[..., None])
            dcos = dsub.view(n, width)
        return dcos, cos_sub.mul_(dcos).sum(0) if self.radial_from_tile else None  # cosines no longer needed

    def _gradient(
        self, r0: int, r1: int, rows, log_z: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """Softmax gradient of the block, tile by tile, into dE and dW (or, fused, into the
        head optimizer's update of each tile). `scale`: the incoming gradient (the last block,
        in backward); None for earlier blocks (scale 1, in forward)."""
        n = r1 - r0
        B = self.emb_n.shape[0]
        coef = 1.0 / B if scale is None else scale / B
        fused = self.step_rows is not None
        last = r1 == B
        earlier = r0 > 0  # blocks before this one have added to the weight gradient
        e = self.emb_n[r0:r1]
        # target column: d loss / d t = coef * (p_t - 1), through the margin into cos_y
        has = self.has[r0:r1]
        d_t = torch.where(has, (torch.exp(self.t_logit[r0:r1] - log_z) - 1.0) * coef, 0.0)
        self.d_target[r0:r1] = d_t
        dcos_y = d_t * self.d_t_dcos[r0:r1]
        grad_e = self.grad_emb[r0:r1]
        in_grad = r0 == 0 and self.first_in_grad and not fused  # kept values alias this tile's rows of g
        if self.exp_scale is not None:  # kept exp(logit) -> coef * softmax * s = d loss / d cos
            row_scale = torch.exp(-log_z).mul_(coef * self.exp_scale)[:, None]
        pos = 0
        for c0, c1 in self.tiles:
            w, inv, shard_rows = self.shard.tile(c0, c1)
            width = (c1 - c0) * self.k
            rr = slice(pos, pos + width)
            pos += width
            if fused:  # recomputed: nothing of the forward's tiles was kept
                raw = self._cosines_into(self._gemm_in(e), w, self._scratch("raw", n, width))
                if self.exp_scale is not None:
                    logits = self._scratch("logits", n, width) if self.radial_from_tile else None
                    self._exp_logits(raw, inv, c0, logits)
                    dcos, radial = self._exp_dcos(raw, logits, r0, r1, c0, row_scale, dcos_y, True)
                else:
                    dcos, radial = self._general_dcos(raw.mul_(inv), r0, r1, c0, rows, log_z, coef, dcos_y)
            elif self.exp_scale is not None:
                logits = self._kept_logits(rr.start, width, n) if r0 == 0 and self.keep_logits else None
                dcos, radial = self._exp_dcos(
                    self._kept(r0, rr.start, width, n), logits, r0, r1, c0, row_scale, dcos_y, not in_grad
                )
            else:  # (in the first block, a view of the gradient rows this tile writes below)
                dcos, radial = self._general_dcos(
                    self._kept(r0, rr.start, width, n), r0, r1, c0, rows, log_z, coef, dcos_y
                )
            dcos.mul_(inv)  # now d loss / d (e . w_j)
            if c0 == 0:
                torch.mm(dcos, w, out=grad_e)
            else:
                grad_e.addmm_(dcos, w)
            if not last:  # an earlier block: add to the tile's rows; the correction comes last
                if shard_rows is not None:
                    self.grad_weight.index_add_(0, shard_rows, dcos.t() @ e)
                elif r0 == 0:
                    torch.mm(dcos.t(), e, out=self.grad_weight[rr])
                else:
                    self.grad_weight[rr].addmm_(dcos.t(), e)
                continue
            # d cos_ij / d w_j = inv_j e_i - cos_ij inv_j^2 w_j: g_j = inv_j sum_i dcos_ij e_i + decay_j w_j,
            # decay_j = -inv_j^2 sum_i dcos_ij cos_ij = -inv_j^2 <g_j, w_j> (g_j before the correction)
            if fused:  # the tile's gradient is complete: step its rows now and drop it
                g = dcos.t() @ e
                self.step_rows(
                    rr if shard_rows is None else shard_rows, g, self._decay(radial, g, w, inv, rr)
                )
                continue
            if shard_rows is None:
                g = self.grad_weight[rr]
                if earlier:  # the earlier blocks' sum, formed at scale 1
                    g.mul_(scale).addmm_(dcos.t(), e)
                else:
                    torch.mm(dcos.t(), e, out=g)
            else:
                g = dcos.t() @ e
                if earlier:
                    g.addcmul_(self.grad_weight[shard_rows], scale)
            g.addcmul_(w, self._decay(radial, g, w, inv, rr)[:, None])
            if shard_rows is not None:
                self.grad_weight.index_copy_(0, shard_rows, g)

    def _decay(
        self, radial: torch.Tensor | None, g: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, rr: slice
    ) -> torch.Tensor:
        """-inv_j^2 sum_i dcos_ij cos_ij, from the tile's sum (`_exp_dcos`': s times it), or as
        <g_j, w_j> of the complete rows (the tile's shard rows `rr`, when not sampled)."""
        from_logits = radial is not None and self.exp_scale is not None
        if radial is None:
            radial = _row_dots(g, w)
        per = -1.0 / self.exp_scale if from_logits else -1.0
        if self.shard.index is not None:
            return radial.mul_(inv.square().mul_(per))
        scale = self._decay_scales.get(from_logits)
        if scale is None:  # the whole shard's, once a step: one kernel a tile
            scale = self._decay_scales[from_logits] = self.shard.inv_norm.square().mul_(per)
        return radial.mul_(scale[rr])
