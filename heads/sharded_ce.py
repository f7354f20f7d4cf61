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
one exponential per logit serves both the statistics and the gradient (heads/walk.py's EXP_RANGE). Where:
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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardface.configs.schema import keys
from shardface.heads.walk import Walk
from shardface.losses.base import MarginLoss
from shardface.parallel.dist import get_world_size

EPS = 1e-12
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


def rows_of_classes(classes: torch.Tensor, k: int) -> torch.Tensor:
    """Weight rows of the given classes with k sub-centres each (class-major)."""
    if k == 1:
        return classes
    return (classes[:, None] * k + torch.arange(k, device=classes.device)).reshape(-1)


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

        walk = Walk(emb_n, shard, labels, has, t_logit, margin, rows, plan, group, grads and not plan.fused)
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
