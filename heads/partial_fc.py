"""PartialFC: the class-sharded margin-softmax head (model-parallel over classes)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from heads.sharded_ce import ShardedMarginCE, normalise_embeddings
from heads.sharding import class_shard
from losses.margin import CombinedMarginLoss
from parallel.collectives import all_gather_no_grad, all_gather_rows
from parallel.dist import cpu_group, get_rank, get_world_size


class PartialFC(nn.Module):
    """Margin-softmax classifier whose C classes are split in contiguous shards over ranks.

    Rank r holds `weight` (num_local x embedding_size) for classes
    [class_start, class_start + num_local). `forward(local_embeddings, local_labels)`
    all-gathers embeddings and labels, computes cosine logits for the local shard only
    (chunk_size classes at a time when set) and returns the mean cross-entropy over the
    global batch, identical on every rank. Must be called on every rank of the group.

    Gradient scale: the loss is the global-batch mean, and the gradient each rank receives
    for its own embeddings is multiplied by W. A backbone whose gradients are then
    averaged across ranks (DDP, Zero2Optimizer) gets exactly the gradient of one process
    with batch W*b. The head's weight gradient is already exact: no cross-rank reduction.

    Partial FC (`sample_rate` < 1): each step keeps every class of the shard that appears
    in the global batch plus uniformly drawn other classes, `max(int(sample_rate *
    num_local), positives)` in all. Unsampled rows get a zero gradient; pair the head with
    `heads.SampledRowsOptimizer` so they are neither decayed nor moved by momentum and keep
    their optimizer state unchanged (`sampled_index` tells it which rows took part since the
    optimizer's last `zero_grad()`, so gradient accumulation over micro-steps is covered).
    """

    def __init__(self, margin_loss: CombinedMarginLoss, embedding_size: int, num_classes: int,
                 sample_rate: float = 1.0, chunk_size: int | None = None, process_group=None,
                 validate: bool = True):
        super().__init__()
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.margin_loss = margin_loss
        self.embedding_size = embedding_size
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.chunk_size = chunk_size or None
        self.group = process_group
        self.world_size = get_world_size(process_group)
        shard = class_shard(num_classes, self.world_size, get_rank(process_group))
        self.class_start, self.num_local = shard.start, shard.size
        self.num_sample = self.num_local if sample_rate >= 1.0 else int(sample_rate * self.num_local)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size)))
        self.validate = validate
        self.sampled_index: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"classes [{self.class_start}, {self.class_start + self.num_local}) of {self.num_classes}, "
                f"D={self.embedding_size}, sample_rate={self.sample_rate}, chunk_size={self.chunk_size}")

    def _check_inputs(self, emb: torch.Tensor, labels: torch.Tensor) -> None:
        """Agree across ranks on whether the inputs are valid, so that all raise or none does."""
        problem = ""
        if emb.dim() != 2 or emb.shape[1] != self.embedding_size:
            problem = f"embeddings of shape {tuple(emb.shape)}, expected (b, {self.embedding_size})"
        elif labels.numel() != emb.shape[0]:
            problem = f"{labels.numel()} labels for {emb.shape[0]} embeddings"
        elif labels.device.type == "cpu":
            bad = (labels < 0) | (labels >= self.num_classes)
            if bool(bad.any()):
                problem = (f"label {int(labels[bad][0])} outside [0, {self.num_classes}) "
                           f"at batch position {int(torch.nonzero(bad)[0])}")
        else:
            torch._assert_async(((labels >= 0) & (labels < self.num_classes)).all(),
                                "PartialFC: label outside [0, num_classes)")
        if self.world_size == 1:
            if problem:
                raise ValueError(f"PartialFC: {problem}")
            return
        b = emb.shape[0] if emb.dim() else -1
        status = torch.tensor([b, -b, int(bool(problem))], dtype=torch.int64)
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=cpu_group(self.group))
        if problem:
            raise ValueError(f"PartialFC (rank {get_rank(self.group)}): {problem}")
        if status[2]:
            raise ValueError("PartialFC: another rank received invalid inputs (see its error)")
        if status[0] != -status[1]:
            raise ValueError(f"PartialFC: batch sizes differ across ranks ({-int(status[1])} to "
                             f"{int(status[0])}); every rank must pass the same number of rows")

    def clear_sampled(self) -> None:
        """Forget the rows sampled so far (the head optimizer calls this in zero_grad)."""
        self.sampled_index = None

    def sample(self, local_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick the shard rows for this step; return (sorted index, labels remapped into it)."""
        positive = torch.unique(local_labels[local_labels >= 0], sorted=True)
        if self.num_sample > positive.numel():
            score = torch.rand(self.num_local, device=local_labels.device)
            score[positive] = 2.0
            index = torch.topk(score, k=self.num_sample).indices.sort().values
        else:
            index = positive
        remapped = torch.where(local_labels >= 0,
                               torch.searchsorted(index, local_labels.clamp_min(0)),
                               torch.full_like(local_labels, -1))
        return index, remapped

    def forward(self, local_embeddings: torch.Tensor, local_labels: torch.Tensor) -> torch.Tensor:
        local_labels = local_labels.reshape(-1).long()
        if self.validate:
            self._check_inputs(local_embeddings, local_labels)
        embeddings = all_gather_rows(local_embeddings, self.group, grad_scale=float(self.world_size))
        labels = all_gather_no_grad(local_labels, self.group)

        local = labels - self.class_start
        local = torch.where((local >= 0) & (local < self.num_local), local, torch.full_like(local, -1))
        index = None
        if self.num_sample < self.num_local and self.training:
            index, local = self.sample(local)
            if self.sampled_index is not None:  # gradient accumulation: rows of earlier micro-steps
                self.sampled_index = torch.unique(torch.cat([self.sampled_index, index]))
            else:
                self.sampled_index = index
        return ShardedMarginCE.apply(normalise_embeddings(embeddings), self.weight, local, index,
                                     self.margin_loss, self.chunk_size, self.group)
