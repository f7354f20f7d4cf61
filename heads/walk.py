"""The head's walk over row blocks x class tiles (heads/sharded_ce.py's module docstring gives
the algorithm), in three named parts chosen once per step, each small enough to read alone:

- where the kept values live (`Kept`): one fp32 value per (row, shard row) between a block's
  statistics and its gradient, the first block inside the weight gradient's own buffer where
  that is laid out like the tiles, later blocks in one block buffer;
- the logit path: `ExpLogits` for margins whose other logits are s * cos (exp(logit) is formed
  once and kept for the gradient), `MarginLogits` for any margin (cosines kept, the logits
  formed by the margin in each pass);
- the weight sink: `AccumulatedGradient` (dW in the gradient's buffer, blocks before the last
  at scale 1 and their sum scaled by the last), or `SteppedRows` (the fused head optimizer:
  each tile's complete gradient handed to `step_rows` and dropped).

`Walk` holds the blocks and tiles and drives them: `run()` in forward (every block's
statistics, every block's gradient but the last's), `finish(grad_loss)` in backward. The parts
issue exactly the kernels the walk issued as one class (tests/test_head_passes.py and
tests/test_head_launches.py count them)."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from shardface.parallel.collectives import all_gather_flat
from shardface.parallel.dist import get_world_size

# Where a margin's other logits are s * cos (`MarginLoss.linear_other_logits`), the head keeps
# exp(s cos) itself, unshifted, while s + log C stays under this: fp32's normal range is
# e^-87.3 .. e^88.7, so every kept value (|cos| <= 1), every row sum (<= C e^s) and exp(-log Z)
# stay normal, and one exp per element serves both the statistics and the gradient.
EXP_RANGE = 85.0

# Row dot products' temporary (vecdot forms the elementwise product of its inputs first): on a
# CPU a slice of 1024 rows, whose product stays in cache (the fastest there, against whole tiles
# and bmm); elsewhere (a GPU: memory- and launch-bound) slices of at most 4M values (16 MB in
# fp32): 1-4 launches of mul and sum per tile instead of one pair per 1024 rows
ROW_DOTS_CPU_ROWS = 1024
ROW_DOTS_DEVICE_VALUES = 1 << 22


def row_dots(a: torch.Tensor, b: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """<a_j, b_j> for every row j, a slice of rows at a time (see ROW_DOTS_CPU_ROWS)."""
    if rows is None:
        on_cpu = a.device.type == "cpu"
        rows = ROW_DOTS_CPU_ROWS if on_cpu else max(ROW_DOTS_CPU_ROWS, ROW_DOTS_DEVICE_VALUES // a.shape[1])
    out = a.new_empty(a.shape[0])
    for r0 in range(0, a.shape[0], rows):
        torch.linalg.vecdot(a[r0 : r0 + rows], b[r0 : r0 + rows], out=out[r0 : r0 + rows])
    return out


def put(tile: torch.Tensor, col: torch.Tensor, has: torch.Tensor, value: torch.Tensor) -> None:
    """tile[i, col[i]] = value[i] where has[i] (col, has: n x 1, col within the tile); other rows
    keep their value (no host sync; three kernels)."""
    tile.scatter_(1, col, torch.where(has, value[:, None], tile.gather(1, col)))


def slice_rows(rows: dict[str, torch.Tensor], r0: int, r1: int) -> dict[str, torch.Tensor]:
    return {name: (v[r0:r1] if v.dim() else v) for name, v in rows.items()}


class _AllowTF32:
    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def tf32(enabled: bool):
    if not enabled or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return _AllowTF32()


class Kept:
    """Where the kept values of rows [r0, r0 + n) x shard rows [pos, pos + width) live: the first
    block's (`first_in_grad`) in the weight gradient's rows, which nothing reads before that
    block's gradient pass overwrites them tile by tile (tile j's n x width values fit in the
    width x D gradient rows tile j then writes, and are read before); later blocks' in one buffer
    of the largest later block x shard rows. With `keep_logits`, the first block's logits lie
    beside their exponentials in the same gradient rows (2 n x width floats fit in width x D).
    Also the tile-sized scratch buffers the gradient pass reuses, one per name."""

    def __init__(
        self,
        grad_weight,
        first_in_grad: bool,
        keep_logits: bool,
        later_rows: int,
        shard_rows: int,
        tile_rows: int,
        device,
    ):
        self.grad_weight = grad_weight
        self.first_in_grad = first_in_grad
        self.tile_rows = tile_rows  # the widest tile's shard rows
        self.device = device
        self.keep_logits = keep_logits
        self.block = (
            None
            if grad_weight is None
            else torch.empty(later_rows * shard_rows, dtype=torch.float32, device=device)
        )
        self._scratch: dict[str, torch.Tensor] = {}

    def values(self, r0: int, pos: int, width: int, n: int) -> torch.Tensor:
        """The cosines (the exp path: exp(logit)) of the block from row r0."""
        if r0 == 0 and self.first_in_grad:
            return self.grad_weight[pos : pos + width].view(-1)[: n * width].view(n, width)
        return self.block[pos * n : (pos + width) * n].view(n, width)

    def logits(self, pos: int, width: int, n: int) -> torch.Tensor:
        """With `keep_logits`: the first block's logits, beside their exponentials."""
        return self.grad_weight[pos : pos + width].view(-1)[n * width : 2 * n * width].view(n, width)

    def scratch(self, name: str, n: int, width: int) -> torch.Tensor:
        """A tile-sized buffer, one per name, reused by every tile of the step."""
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n * width:
            buf = self._scratch[name] = torch.empty(
                n * self.tile_rows, dtype=torch.float32, device=self.device
            )
        return buf[: n * width].view(n, width)


class MarginLogits:
    """Any margin: cosines are kept, and each pass forms the tile's logits from them with the
    margin (sub-centres: a class's cosine is the max over its k rows)."""

    exp_scale = None

    def __init__(self, walk: "Walk"):
        self.walk = walk

    def start(self, n: int, device) -> torch.Tensor:
        """The block's running log-sum-exp of the shard's logits."""
        return torch.full((n,), float("-inf"), device=device)

    def add_tile(self, lse, raw, inv, r0: int, r1: int, c0: int, rows, logits_out) -> torch.Tensor:
        """raw = e . w_j (kept, in place) -> its cosines; the running log-sum-exp with this tile's."""
        raw.mul_(inv)  # |cos| <= 1 up to rounding; the target's cosine is clamped by the margin
        cos, _ = self._class_cos(raw)
        return torch.logaddexp(lse, torch.logsumexp(self._logits(cos, r0, r1, c0, rows), dim=1))

    def local(self, lse: torch.Tensor) -> torch.Tensor:
        return lse

    def row_scale(self, log_z, coef):
        return None

    def recomputed(self, raw, inv, c0: int, n: int, width: int):
        """The fused pass's tile from its fresh e . w_j: its cosines (no logits kept)."""
        return raw.mul_(inv), None

    def dcos(
        self, cos_sub, logits, r0: int, r1: int, c0: int, rows, log_z, coef, dcos_y, row_scale, in_place
    ):
        """d loss / d cos of a tile from its cosines, and sum_i dcos_ij cos_ij where the radial
        term comes from the tile (else None)."""
        walk = self.walk
        n, width = cos_sub.shape
        cos, arg = self._class_cos(cos_sub)
        logits = self._logits(cos, r0, r1, c0, rows)
        grad = walk.margin.other_grad(cos, rows)
        dl = logits.sub_(log_z[:, None]).exp_()  # softmax; times coef = d loss / d logit
        # d loss / d cos (the target column is put below)
        dcos = dl.mul_(coef * grad) if isinstance(grad, float) else dl.mul_(coef).mul_(grad)
        put(dcos, *walk.targets(r0, r1, c0, width // walk.k), dcos_y)
        if arg is not None:
            dsub = torch.zeros_like(cos_sub).view(n, -1, walk.k)
            dsub.scatter_(2, arg[..., None], dcos[..., None])
            dcos = dsub.view(n, width)
        # the cosines are no longer needed
        return dcos, cos_sub.mul_(dcos).sum(0) if walk.radial_from_tile else None

    def _class_cos(self, cos_sub: torch.Tensor):
        """Class cosines from sub-centre cosines (max over k) and the argmax, or as is."""
        k = self.walk.k
        if k == 1:
            return cos_sub, None
        vals, arg = cos_sub.view(cos_sub.shape[0], -1, k).max(2)
        return vals, arg

    def _logits(self, cos: torch.Tensor, r0: int, r1: int, c0: int, rows) -> torch.Tensor:
        walk = self.walk
        logits = walk.margin.other_logits(cos, rows)
        if logits.data_ptr() == cos.data_ptr():
            logits = logits.clone()
        put(logits, *walk.targets(r0, r1, c0, cos.shape[1]), walk.t_logit[r0:r1])
        return logits


class ExpLogits:
    """Margins whose other logits are s * cos, while s + log C < EXP_RANGE: exp(logit) is formed
    once per logit, kept, and serves both the statistics (its row sums) and the gradient
    (softmax = exp(logit) / Z). Logits clamped to s * (lo, hi) carry no gradient; the gradient
    pass tells them apart by their kept exponential. A clamped value is exp of the bound rounded
    to fp32 (at s = 60 that rounding alone moves exp by up to ~60 ulps), to within the exp
    kernel's few ulps: the thresholds sit 1e-6 (~8 ulps) inside exp(fp32 bound), computed on
    the host."""

    def __init__(self, walk: "Walk", scale: float, low: float, high: float):
        self.walk = walk
        self.exp_scale = scale
        self.clamp = None
        if math.isfinite(low) or math.isfinite(high):
            self.clamp = (scale * low, scale * high)
            lo, hi = (float(np.float32(b)) for b in self.clamp)
            self.exp_clamp = (math.exp(lo) * (1 + 1e-6), math.exp(hi) * (1 - 1e-6))
        self.exp_t = torch.exp(walk.t_logit)
        self._inv_s: dict[int, torch.Tensor] = {}  # a tile's inv_j * s, by class c0

    def start(self, n: int, device) -> torch.Tensor:
        """The block's running sum of exp(logit) over the shard."""
        return torch.zeros(n, device=device)

    def add_tile(self, total, raw, inv, r0: int, r1: int, c0: int, rows, logits_out) -> torch.Tensor:
        """raw = e . w_j (kept, in place) -> exp(logit), the target column exp(t); the logits
        themselves into `logits_out` where given."""
        walk = self.walk
        self.exponentials(raw, inv, c0, logits_out)
        put(raw, *walk.targets(r0, r1, c0, raw.shape[1]), self.exp_t[r0:r1])
        return total.add_(raw.sum(1))

    def local(self, total: torch.Tensor) -> torch.Tensor:
        return total.log_()

    def row_scale(self, log_z, coef):
        """coef * s / Z_i: kept exp(logit) times it is d loss / d cos."""
        return torch.exp(-log_z).mul_(coef * self.exp_scale)[:, None]

    def recomputed(self, raw, inv, c0: int, n: int, width: int):
        """The fused pass's tile from its fresh e . w_j: exp(logit) in place, and the logits in a
        second tile where the radial term comes from the tile."""
        logits = self.walk.kept.scratch("logits", n, width) if self.walk.radial_from_tile else None
        self.exponentials(raw, inv, c0, logits)
        return raw, logits

    def exponentials(
        self, raw: torch.Tensor, inv: torch.Tensor, c0: int, logits: torch.Tensor | None
    ) -> None:
        """e . w_j (the tile of classes from c0) -> exp(other logit), in place; the logits
        themselves (s cos, clamped) into `logits` when given."""
        inv_s = self._inv_s.get(c0)
        if inv_s is None:  # once a step, not at every block and pass
            inv_s = self._inv_s[c0] = inv * self.exp_scale
        logits = raw.mul_(inv_s) if logits is None else torch.mul(raw, inv_s, out=logits)
        if self.clamp is not None:
            logits.clamp_(*self.clamp)
        torch.exp(logits, out=raw)

    def dcos(self, x, logits, r0: int, r1: int, c0: int, rows, log_z, coef, dcos_y, row_scale, in_place):
        """d loss / d cos of a tile from its exp(logit) `x` (times the row scale; the target
        column dcos_y; clamped logits 0), and, given the tile's logits (s cos), s sum_i dcos_ij
        cos_ij (else None; the sink's decay divides by s). `in_place`: x may be overwritten."""
        walk = self.walk
        n, width = x.shape
        clamped = None if self.clamp is None else (x <= self.exp_clamp[0]).logical_or_(x >= self.exp_clamp[1])
        dcos = (
            x.mul_(row_scale)
            if in_place
            else torch.mul(x, row_scale, out=walk.kept.scratch("dcos", n, width))
        )
        if clamped is not None:
            dcos.masked_fill_(clamped, 0.0)
        put(dcos, *walk.targets(r0, r1, c0, width), dcos_y)
        return dcos, None if logits is None else logits.mul_(dcos).sum(0)


class _Decay:
    """The normalisation's radial correction of tile rows: decay_j = -inv_j^2 sum_i dcos_ij cos_ij,
    from the tile's sum (the exp path's is s times it), or as <g_j, w_j> of the complete rows."""

    def __init__(self, shard, exp_scale: float | None):
        self.shard = shard
        self.exp_scale = exp_scale
        self._scales: dict[bool, torch.Tensor] = {}  # the whole shard's -inv_j^2 [/ s]

    def __call__(
        self, radial, g: torch.Tensor, w: torch.Tensor, inv: torch.Tensor, rr: slice
    ) -> torch.Tensor:
        from_logits = radial is not None and self.exp_scale is not None
        if radial is None:
            radial = row_dots(g, w)
        per = -1.0 / self.exp_scale if from_logits else -1.0
        if self.shard.index is not None:
            return radial.mul_(inv.square().mul_(per))
        scale = self._scales.get(from_logits)
        if scale is None:  # the whole shard's, once a step: one kernel a tile
            scale = self._scales[from_logits] = self.shard.inv_norm.square().mul_(per)
        return radial.mul_(scale[rr])


class AccumulatedGradient:
    """dW in the weight gradient's buffer. A block before the last adds its tile products at
    scale 1 (in forward); the last block (in backward, at the incoming gradient's scale) scales
    their sum, adds its own and applies the radial correction: d cos_ij / d w_j = inv_j e_i -
    cos_ij inv_j^2 w_j, so g_j = inv_j sum_i dcos_ij e_i + decay_j w_j. Sampled rows go through
    index_add / index_copy; unsampled rows keep their exact zero."""

    def __init__(self, kept: Kept, decay: _Decay):
        self.kept = kept  # the weight gradient's one home (its first block's kept values live in it)
        self.decay = decay

    def add(self, dcos, e, rr: slice, shard_rows, r0: int) -> None:
        """A block before the last: its tile's products into the tile's rows."""
        if shard_rows is not None:
            self.kept.grad_weight.index_add_(0, shard_rows, dcos.t() @ e)
        elif r0 == 0:
            torch.mm(dcos.t(), e, out=self.kept.grad_weight[rr])
        else:
            self.kept.grad_weight[rr].addmm_(dcos.t(), e)

    def complete(self, dcos, e, w, inv, rr: slice, shard_rows, radial, scale, earlier: bool) -> None:
        """The last block: the tile's rows complete, corrected."""
        if shard_rows is None:
            g = self.kept.grad_weight[rr]
            if earlier:  # the earlier blocks' sum, formed at scale 1
                g.mul_(scale).addmm_(dcos.t(), e)
            else:
                torch.mm(dcos.t(), e, out=g)
        else:
            g = dcos.t() @ e
            if earlier:
                g.addcmul_(self.kept.grad_weight[shard_rows], scale)
        g.addcmul_(w, self.decay(radial, g, w, inv, rr)[:, None])
        if shard_rows is not None:
            self.kept.grad_weight.index_copy_(0, shard_rows, g)


class SteppedRows:
    """The fused head optimizer: no weight gradient is held. The whole batch is one block, and as
    soon as a tile's gradient is complete it goes to `step_rows(rows, grad, decay)` (the head
    optimizer's update of those rows with gradient grad + decay_j w_j) and is dropped."""

    def __init__(self, step_rows, decay: _Decay):
        self.step_rows = step_rows
        self.decay = decay

    def complete(self, dcos, e, w, inv, rr: slice, shard_rows, radial, scale, earlier: bool) -> None:
        g = dcos.t() @ e
        self.step_rows(rr if shard_rows is None else shard_rows, g, self.decay(radial, g, w, inv, rr))


class Walk:
    """One pass over row blocks x class tiles: the blocks and tiles, the targets' places in
    them, the statistics' exchange, and the gradient pass, through the parts above."""

    def __init__(self, emb_n, shard, labels, has, t_logit, margin, rows, plan, group, grads: bool):
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
        # the first block is kept inside the weight gradient (see Kept): only where that buffer
        # is laid out like the tiles (no sampling)
        in_grad = grads and shard.index is None
        first = min(B, D) if in_grad else B if not grads else max(1, min(plan.row_block, B))
        rest = max(1, min(plan.row_block, B))
        self.blocks = [(0, first)] + [(r0, min(r0 + rest, B)) for r0 in range(first, B, rest)]
        self.world = get_world_size(group)
        lin = margin.linear_other_logits()
        linear = self.k == 1 and lin is not None and lin[0] + math.log(shard.classes * self.world) < EXP_RANGE
        self.path = ExpLogits(self, *lin) if linear else MarginLogits(self)
        # the weight's radial term from the tile where that moves fewer bytes than the rows' dot
        # products (one block, 2 x rows <= D); on the exp path the logits are kept beside their
        # exponentials for it: in the gradient's buffer, or a second tile (fused)
        small = 2 * B <= D and (plan.fused or len(self.blocks) == 1)
        exp_path = isinstance(self.path, ExpLogits)
        keep_logits = in_grad and exp_path and small
        self.radial_from_tile = small and (not exp_path or keep_logits or plan.fused)
        self.decay = _Decay(shard, self.path.exp_scale)
        self.step_rows = None
        self._block_targets: dict[tuple[int, int], tuple] = {}
        grad_weight = None
        if grads:
            self.grad_emb = torch.empty_like(emb_n)
            if shard.index is None:
                grad_weight = torch.empty(shard.weight.shape, dtype=torch.float32, device=emb_n.device)
            else:  # unsampled rows get an exact zero
                grad_weight = torch.zeros(shard.weight.shape, dtype=torch.float32, device=emb_n.device)
            self.d_target = torch.zeros(B, dtype=torch.float32, device=emb_n.device)
        later = max((r1 - r0 for r0, r1 in self.blocks[1 if in_grad else 0 :]), default=0)
        n_rows = shard.classes * self.k
        self.kept = Kept(grad_weight, in_grad, keep_logits, later, n_rows, self.K * self.k, emb_n.device)
        self.sink = AccumulatedGradient(self.kept, self.decay) if grads else None

    @property
    def grad_weight(self):
        return self.kept.grad_weight

    @grad_weight.setter
    def grad_weight(self, value):
        self.kept.grad_weight = value

    def gemm_in(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16) if self.plan.precision == "bf16" else x

    def cosines_into(self, e: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = e . w_j for the tile (the logits GEMM, in the plan's precision)."""
        if e.dtype == torch.float32:
            return torch.mm(e, self.gemm_in(w).t(), out=out)
        return out.copy_(e @ self.gemm_in(w).t())

    def targets(self, r0: int, r1: int, c0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
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

    def run(self) -> torch.Tensor:
        """Every block's statistics, and the gradient of every block but the last (see `finish`)."""
        B = self.emb_n.shape[0]
        log_z = torch.empty(B, dtype=torch.float32, device=self.emb_n.device)
        with tf32(self.plan.precision == "tf32"):
            for r0, r1 in self.blocks:
                rows = slice_rows(self.rows, r0, r1)
                log_z[r0:r1] = self._exchange(self._statistics(r0, r1, rows))
                if self.grads and r1 < B:
                    self._gradient(r0, r1, rows, log_z[r0:r1])
        return log_z

    def _statistics(self, r0: int, r1: int, rows):
        """The block's local log-sum-exp over the shard, its kept values written as it goes."""
        e = self.gemm_in(self.emb_n[r0:r1])
        n = r1 - r0
        acc = self.path.start(n, e.device)
        keep_logits = r0 == 0 and self.kept.keep_logits
        pos = 0
        for c0, c1 in self.tiles:
            w, inv, _ = self.shard.tile(c0, c1)
            width = (c1 - c0) * self.k
            if self.grads:
                raw = self.cosines_into(e, w, self.kept.values(r0, pos, width, n))
            else:
                raw = (e @ self.gemm_in(w).t()).float()
            logits_out = self.kept.logits(pos, width, n) if keep_logits else None
            acc = self.path.add_tile(acc, raw, inv, r0, r1, c0, rows, logits_out)
            pos += width
        return self.path.local(acc)

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
        with tf32(self.plan.precision == "tf32"):
            if self.step_rows is not None:
                self.grad_emb = torch.empty_like(self.emb_n)
                self.d_target = torch.zeros(B, dtype=torch.float32, device=self.emb_n.device)
                self.sink = SteppedRows(self.step_rows, self.decay)
                self._gradient(0, B, self.rows, self.log_z, scale=grad_loss)
                return
            r0, r1 = self.blocks[-1]
            if r0 > 0:
                self.grad_emb[:r0].mul_(grad_loss)
                self.d_target[:r0].mul_(grad_loss)
            self._gradient(r0, r1, slice_rows(self.rows, r0, r1), self.log_z[r0:r1], scale=grad_loss)

    def _gradient(
        self, r0: int, r1: int, rows, log_z: torch.Tensor, scale: torch.Tensor | None = None
    ) -> None:
        """Softmax gradient of the block, tile by tile, into dE and the weight sink. `scale`: the
        incoming gradient (the last block, in backward); None for earlier blocks (scale 1, in
        forward)."""
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
        # the kept values alias this tile's rows of the gradient
        in_grad = r0 == 0 and self.kept.first_in_grad and not fused
        row_scale = self.path.row_scale(log_z, coef)
        pos = 0
        for c0, c1 in self.tiles:
            w, inv, shard_rows = self.shard.tile(c0, c1)
            width = (c1 - c0) * self.k
            rr = slice(pos, pos + width)
            pos += width
            if fused:  # recomputed: nothing of the forward's tiles was kept
                raw = self.cosines_into(self.gemm_in(e), w, self.kept.scratch("raw", n, width))
                values, logits = self.path.recomputed(raw, inv, c0, n, width)
                in_place = True
            else:  # (in the first block, a view of the gradient rows this tile writes below)
                values = self.kept.values(r0, rr.start, width, n)
                logits = self.kept.logits(rr.start, width, n) if r0 == 0 and self.kept.keep_logits else None
                in_place = not in_grad
            dcos, radial = self.path.dcos(
                values, logits, r0, r1, c0, rows, log_z, coef, dcos_y, row_scale, in_place
            )
            dcos.mul_(inv)  # now d loss / d (e . w_j)
            if c0 == 0:
                torch.mm(dcos, w, out=grad_e)
            else:
                grad_e.addmm_(dcos, w)
            if last:
                self.sink.complete(dcos, e, w, inv, rr, shard_rows, radial, scale, earlier)
            else:  # an earlier block: add to the tile's rows; the correction comes last
                self.sink.add(dcos, e, rr, shard_rows, r0)
