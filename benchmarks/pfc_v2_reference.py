"""The baseline: insightface arcface_torch's PFC v2 algorithm (sample_rate 1), restated.

All-gather embeddings, normalise the whole weight shard, materialise the shard's
B x n_local logits, margin, then a distributed softmax cross-entropy that keeps the
B x n_local probabilities for backward. Used only by benchmarks/head.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardface.heads.sharding import class_shard
from shardface.parallel.collectives import all_gather_no_grad, all_gather_rows
from shardface.parallel.dist import get_rank, get_world_size


class _DistSoftmaxCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels):
        B = logits.shape[0]
        row_max = logits.max(1, keepdim=True).values
        dist.all_reduce(row_max, dist.ReduceOp.MAX)
        logits.sub_(row_max).exp_()
        row_sum = logits.sum(1, keepdim=True)
        dist.all_reduce(row_sum)
        logits.div_(row_sum)  # probabilities, kept for backward
        rows = torch.nonzero(labels != -1, as_tuple=True)[0]
        target = torch.zeros(B, 1, device=logits.device)
        target[rows] = logits[rows].gather(1, labels[rows, None])
        dist.all_reduce(target)
        ctx.save_for_backward(rows, logits, labels)
        return target.clamp_min_(1e-30).log_().mean() * -1

    @staticmethod
    def backward(ctx, grad):
        rows, probs, labels = ctx.saved_tensors
        one_hot = torch.zeros((rows.numel(), probs.shape[1]), device=probs.device)
        one_hot.scatter_(1, labels[rows, None], 1)
        probs[rows] -= one_hot
        probs.div_(probs.shape[0])
        return probs * grad.item(), None


class PFCv2Reference(nn.Module):
    def __init__(self, margin_loss, embedding_size: int, num_classes: int):
        super().__init__()
        shard = class_shard(num_classes, get_world_size(), get_rank())
        self.class_start, self.num_local = shard.start, shard.size
        self.margin_loss = margin_loss
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))

    def forward(self, local_embeddings, local_labels):
        embeddings = all_gather_rows(local_embeddings)
        labels = all_gather_no_grad(local_labels.view(-1).long())
        local = labels - self.class_start
        local = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))
        logits = F.linear(F.normalize(embeddings), F.normalize(self.weight)).clamp(-1, 1)
        return _DistSoftmaxCE.apply(self.margin_loss(logits, local), local)
