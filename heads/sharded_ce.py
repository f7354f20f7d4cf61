"""Cross-entropy over a class-sharded, margin-adjusted cosine classifier.

Each rank holds the weight rows of its class shard and the normalised embeddings of the
whole global batch. Logits are formed chunk by chunk (K classes at a time) and reduced to
three per-row statistics: the running max, the sum of exp(logit - max) and the target
logit. Across ranks only those statistics travel (all-reduce MAX, then SUM), so logits are
never concatenated and, in the forward pass, never held for more than one chunk. The
backward pass recomputes each chunk's logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from losses.margin import CombinedMarginLoss
from parallel.dist import get_world_size

_EPS = 1e-12


def _weight_rows(weight: torch.Tensor, index: torch.Tensor | None, j0: int, j1: int) -> torch.Tensor:
    rows = weight[j0:j1] if index is None else weight[index[j0:j1]]
    return rows.float()


def _normalised(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norm = w.norm(dim=1, keepdim=True).clamp_min(_EPS)
    return w / norm, norm


def _inv_norm(w: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(w, dim=1).clamp_min_(_EPS).reciprocal_()


def _scaled_cos(emb_n, w, inv_norm, margin: CombinedMarginLoss, rows, cc) -> tuple[torch.Tensor, torch.Tensor | None]:
    """s * cos for one chunk with interclass filtering; returns (logits, filtered mask).

    Filtering (arcface_torch's interclass_filtering_threshold) zeroes the cosine of
    non-target classes above the threshold; those entries carry no gradient.
    """
    cos = (emb_n @ w.t()).mul_(inv_norm).clamp_(-1.0, 1.0)
    filtered = None
    thr = margin.interclass_filtering_threshold
    if thr > 0:
        filtered = cos > thr
        filtered[rows, cc] = False
        cos.masked_fill_(filtered, 0.0)
    return cos.mul_(margin.s), filtered


def _chunk_targets(labels, j0, j1):
    """Rows whose target column lies in [j0, j1), and that column relative to j0."""
    rows = torch.nonzero((labels >= j0) & (labels < j1), as_tuple=True)[0]
    return rows, labels[rows] - j0


class ShardedMarginCE(torch.autograd.Function):
    """loss = mean_i(log S_i + M_i - t_i) over the global batch; identical on every rank.

    Inputs: `emb_n` (B x D, L2-normalised, fp32), `weight` (n_local x D), `labels` (B,
    column index into the shard, or into `index` when sampling; -1 when the class is on
    another rank), `index` (sampled shard rows, sorted, or None for all rows).
    """

    @staticmethod
    def forward(ctx, emb_n, weight, labels, index, margin, chunk_size, group):
        B = emb_n.shape[0]
        cols = weight.shape[0] if index is None else index.numel()
        K = max(1, min(chunk_size or cols, cols))

        t_rows = torch.nonzero(labels >= 0, as_tuple=True)[0]
        w_idx = labels[t_rows] if index is None else index[labels[t_rows]]
        wt_n, _ = _normalised(weight[w_idx].float())
        t_cos = (emb_n[t_rows] * wt_n).sum(1)
        t_logit = margin.target_logit(t_cos)

        row_max = emb_n.new_full((B,), float("-inf"))
        row_sum = emb_n.new_zeros(B)
        for j0 in range(0, cols, K):
            j1 = min(j0 + K, cols)
            w = _weight_rows(weight, index, j0, j1)
            rows, cc = _chunk_targets(labels, j0, j1)
            logits, _ = _scaled_cos(emb_n, w, _inv_norm(w), margin, rows, cc)
            logits[rows, cc] = t_logit[torch.searchsorted(t_rows, rows)]
            new_max = torch.maximum(row_max, logits.max(1).values)
            row_sum = row_sum * torch.exp(row_max - new_max) + logits.sub_(new_max[:, None]).exp_().sum(1)
            row_max = new_max
            del logits

        target = emb_n.new_zeros(B)
        target[t_rows] = t_logit
        if get_world_size(group) > 1:
            global_max = row_max.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([row_sum * torch.exp(row_max - global_max), target])
            dist.all_reduce(sums, group=group)
            row_sum, target, row_max = sums[0], sums[1], global_max
        log_z = row_max + torch.log(row_sum)
        loss = (log_z - target).mean()

        ctx.save_for_backward(emb_n, weight, labels, index if index is not None else torch.empty(0),
                              t_rows, t_cos, log_z)
        ctx.has_index = index is not None
        ctx.margin, ctx.K = margin, K
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        emb_n, weight, labels, index, t_rows, t_cos, log_z = ctx.saved_tensors
        index = index if ctx.has_index else None
        margin, K = ctx.margin, ctx.K
        B = emb_n.shape[0]
        cols = weight.shape[0] if index is None else index.numel()
        coef = grad_loss.float() / B  # d loss / d logit = coef * (softmax - onehot)

        grad_emb = torch.zeros_like(emb_n)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

        # Non-target columns, chunk by chunk. With l = s * (e . w) / |w| and dl = coef * p:
        #   d e = sum_j dl * s / |w_j| * w_j
        #   d w_j = sum_i dl * s / |w_j| * e_i  -  w_j / |w_j|^2 * sum_i dl * l
        # computed from the weight rows themselves (no normalised copy of the chunk).
        for j0 in range(0, cols, K):
            j1 = min(j0 + K, cols)
            w = _weight_rows(weight, index, j0, j1)
            inv = _inv_norm(w)
            rows, cc = _chunk_targets(labels, j0, j1)
            logits, filtered = _scaled_cos(emb_n, w, inv, margin, rows, cc)
            dl = (logits - log_z[:, None]).exp_().mul_(coef)
            dl[rows, cc] = 0.0
            if filtered is not None:
                dl.masked_fill_(filtered, 0.0)
            radial = (dl * logits).sum(0)
            del logits
            dl.mul_(inv.mul(margin.s))  # now d(e . w_j)
            grad_emb.addmm_(dl, w)
            g = grad_w[j0:j1] if index is None else torch.empty_like(w)
            torch.mm(dl.t(), emb_n, out=g)
            del dl
            g.addcmul_(w, (radial * inv * inv)[:, None], value=-1.0)
            if index is not None:
                grad_w.index_copy_(0, index[j0:j1], g)  # sampled rows are unique

        # Target columns: d t = coef * (p_target - 1), through the margin and normalisation.
        if t_rows.numel():
            w_idx = labels[t_rows] if index is None else index[labels[t_rows]]
            wt_n, wt_norm = _normalised(weight[w_idx].float())
            with torch.enable_grad():
                tc = t_cos.detach().requires_grad_(True)
                t_logit = margin.target_logit(tc)
                p_t = torch.exp(t_logit.detach() - log_z[t_rows])
                (dt_cos,) = torch.autograd.grad(t_logit, tc, grad_outputs=coef * (p_t - 1.0))
            grad_emb.index_add_(0, t_rows, dt_cos[:, None] * wt_n)
            g_wn = dt_cos[:, None] * emb_n[t_rows]
            g_w = (g_wn - wt_n * (g_wn * wt_n).sum(1, keepdim=True)) / wt_norm
            grad_w.index_add_(0, w_idx, g_w)

        return grad_emb, grad_w.to(weight.dtype), None, None, None, None, None


def normalise_embeddings(emb: torch.Tensor) -> torch.Tensor:
    return F.normalize(emb.float(), dim=1, eps=_EPS)
