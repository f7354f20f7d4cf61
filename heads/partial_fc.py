"""PartialFC: the class-sharded margin-softmax head (model-parallel over classes)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardface.configs.schema import keys
from shardface.heads.sharded_ce import HeadPlan, ShardedMarginCE, rows_of_classes
from shardface.heads.sharding import check_world_fits, class_shard, initial_class_rows
from shardface.losses.base import MarginLoss
from shardface.parallel.collectives import all_gather_no_grad, all_gather_rows
from shardface.parallel.dist import get_rank, get_world_size

EPS = 1e-12


class SampledRows:
    """The weight rows Partial FC used since the head optimizer last stepped.

    Shared by the head, which adds each step's rows, and `SampledRowsOptimizer`, which steps
    exactly those rows and then clears them. Micro-steps of gradient accumulation add their
    rows one after another; a row may appear more than once (no `unique`, which would wait
    on the device): stepping a duplicated row computes the same new value twice.
    """

    def __init__(self):
        self._parts: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> None:
        self._parts.append(rows)

    def index(self) -> torch.Tensor | None:
        """Every row used since the last `clear()`, or None when the whole shard was used."""
        if not self._parts:
            return None
        return self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)

    def clear(self) -> None:
        self._parts.clear()


class PartialFC(nn.Module):
    """Margin-softmax classifier whose C classes are split in contiguous shards over ranks.

    Rank r holds `weight` (num_local * k x embedding_size; k = the margin's sub-centres per
    class, class-major) for classes [class_start, class_start + num_local).
    `forward(local_embeddings, local_labels)` all-gathers the raw embeddings and labels,
    computes cosine logits for the local shard only and returns the mean cross-entropy over
    the global batch (plus the margin's regulariser), identical on every rank. Must be called
    on every rank of the group. The loss and both gradients are formed in one pass (see
    heads/sharded_ce.py): `chunk_size` classes per GEMM tile, `row_block` rows of the global
    batch at a time beyond the first D rows (which are kept in the weight gradient's buffer;
    later blocks in a row_block x shard buffer), `precision`
    of the logits GEMM ("fp32", "tf32" on GPUs, or "bf16"). `fused_optimizer`: the head's
    optimizer steps each tile of rows during backward and no weight gradient is held (see
    HeadPlan); one extra GEMM per step buys the memory of the gradient.

    Initial weight: N(0, 0.01) rows drawn per class from `torch.initial_seed()` (the seed of
    the last `torch.manual_seed`; `heads.sharding.initial_class_rows`), so a job starts from
    the same head at any world size and no two shards start alike (arcface_torch draws each
    shard from the same generator state, repeating its rows in every shard).

    Gradient scale: the loss is the global-batch mean, and the gradient each rank receives
    for its own embeddings is multiplied by W. A backbone whose gradients are then averaged
    across ranks (DDP, Zero2Optimizer) gets exactly the gradient of one process with batch
    W*b. The head's weight gradient is already exact: no cross-rank reduction.

    Partial FC (`sample_rate` < 1): each training step keeps every class of the shard that
    appears in the global batch plus uniformly drawn other classes, a fixed number in all:
    `max(int(sample_rate * num_local), min(B, num_local))` for a global batch of B rows, so
    every positive always fits and no size depends on the data (nothing waits on the
    device). Unsampled rows get a zero gradient; `heads.SampledRowsOptimizer` then leaves
    them and their optimizer state untouched (the rows are shared through `self.sampled`).

    Labels are checked on the all-gathered batch, which every rank holds, so a bad label
    raises the same ValueError on every rank without communication when labels are on the
    CPU. On a GPU, where raising would wait on the device, the loss becomes NaN and the
    forward is counted: `take_label_errors()` reads the count where the loop reads its loss
    (every rank gets the same count, so all stop together; a NaN loss alone would not stop
    an fp16 run, whose loss scaler allows NaN losses). `raise_on_bad_labels` overrides the
    choice (None: raise when the labels are on the CPU).

    Arguments: the positional ones are arcface_torch's `PartialFC_V2(margin_loss,
    embedding_size, num_classes, sample_rate=1.0, fp16=False)`, so its calls build this head
    unchanged; `fp16=True` (its logits GEMM under fp16 autocast) selects `precision="bf16"`
    here. Everything ShardFace adds is keyword-only; `chunk_size` (None or 0: the whole shard in
    one tile) and `row_block` default to the config's (configs/schema.py).
    """

    def __init__(
        self,
        margin_loss: MarginLoss,
        embedding_size: int,
        num_classes: int,
        sample_rate: float = 1.0,
        fp16: bool = False,
        *,
        chunk_size: int | None = keys()["chunk_size"].default,
        process_group=None,
        validate: bool = True,
        row_block: int = keys()["row_block"].default,
        precision: str | None = None,
        fused_optimizer: bool = False,
    ):
        super().__init__()
        if not 0.0 <= sample_rate <= 1.0:  # 0: only the batch's classes (arcface_torch allows it)
            raise ValueError(f"sample_rate must be in [0, 1], got {sample_rate}")
        if precision is None:  # PartialFC_V2's fp16: its logits GEMM at 16 bits; ours has bf16 for that
            precision = "bf16" if fp16 else "fp32"
        elif fp16 and precision != "bf16":
            raise ValueError(
                f"fp16=True asks for 16-bit logits but precision={precision!r}: pass one of them"
            )
        self.margin_loss = margin_loss
        self.embedding_size = embedding_size
        self.num_classes = num_classes
        self.sample_rate = sample_rate
        self.chunk_size = chunk_size or None
        self.plan = HeadPlan(
            tile=self.chunk_size or 2**62, row_block=row_block, precision=precision, fused=fused_optimizer
        )
        self.step_rows = None  # set by SampledRowsOptimizer on a fused head
        self.group = process_group
        self.world_size = get_world_size(process_group)
        check_world_fits(num_classes, self.world_size)
        shard = class_shard(num_classes, self.world_size, get_rank(process_group))
        self.class_start, self.num_local = shard.start, shard.size
        self.subcenters = margin_loss.subcenters
        self.num_sample = self.num_local if sample_rate >= 1.0 else int(sample_rate * self.num_local)
        # N(0, 0.01) rows drawn per class from torch's seed: the same head at any world size
        self.weight = nn.Parameter(
            initial_class_rows(shard, self.subcenters, embedding_size, torch.initial_seed())
        )
        self.validate = validate
        self.raise_on_bad_labels: bool | None = None
        self._label_errors: torch.Tensor | None = None  # device count of forwards with a bad label
        self.sampled = SampledRows()
        self._shapes_checked = False

    def extra_repr(self) -> str:
        return (
            f"classes [{self.class_start}, {self.class_start + self.num_local}) of {self.num_classes}, "
            f"D={self.embedding_size}, k={self.subcenters}, sample_rate={self.sample_rate}, "
            f"chunk_size={self.chunk_size}, row_block={self.plan.row_block}, precision={self.plan.precision}"
        )

    def _check_shapes(self, emb: torch.Tensor, labels: torch.Tensor) -> None:
        """Once: every rank passes (b, D) embeddings with b labels and the same b (a mismatch
        would otherwise hang or garble the all-gather)."""
        problem = ""
        if emb.dim() != 2 or emb.shape[1] != self.embedding_size:
            problem = f"embeddings of shape {tuple(emb.shape)}, expected (b, {self.embedding_size})"
        elif labels.numel() != emb.shape[0]:
            problem = f"{labels.numel()} labels for {emb.shape[0]} embeddings"
        if self.world_size > 1:
            b = emb.shape[0] if emb.dim() else -1
            status = torch.tensor([b, -b, int(bool(problem))], dtype=torch.int64, device=emb.device)
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.group)
            high, neg_low, bad = status.tolist()
            if not problem and bad:
                problem = "another rank received invalid inputs (see its error)"
            elif not problem and high != -neg_low:
                problem = f"batch sizes differ across ranks ({-neg_low} to {high}); every rank must pass the same number"
        if problem:
            raise ValueError(f"PartialFC (rank {get_rank(self.group)}): {problem}")
        self._shapes_checked = True

    def _check_labels(self, labels: torch.Tensor) -> None:
        """Global labels (identical on every rank): every rank raises the same error."""
        bad = (labels < 0) | (labels >= self.num_classes)
        if bool(bad.any()):
            at = int(bad.int().argmax())
            b = labels.numel() // self.world_size
            raise ValueError(
                f"PartialFC: label {int(labels[at])} outside [0, {self.num_classes}) at position "
                f"{at % b} of rank {at // b}'s batch"
            )

    def sample(self, local_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick the shard classes for this step; return (sorted index, labels remapped into it)."""
        n = self.num_local
        size = min(n, max(self.num_sample, local_labels.numel()))
        has = local_labels >= 0
        score = torch.rand(n + 1, device=local_labels.device)  # the last slot takes rows without a class here
        score.scatter_(0, torch.where(has, local_labels, n), 2.0)
        index = torch.topk(score[:n], k=size, sorted=False).indices.sort().values
        remapped = torch.where(has, torch.searchsorted(index, local_labels.clamp_min(0)), -1)
        return index, remapped

    def gather(self, local_embeddings: torch.Tensor) -> torch.Tensor:
        """The global batch's raw embeddings, as forward gathers them (backward: the gradient of
        every rank's rows summed and scaled by W). Another loss over the global batch
        (distill/head.py) passes the result to forward as `gathered`: one all-gather serves both."""
        return all_gather_rows(local_embeddings, self.group, grad_scale=float(self.world_size))

    def forward(
        self, local_embeddings: torch.Tensor, local_labels: torch.Tensor, gathered: torch.Tensor | None = None
    ) -> torch.Tensor:
        local_labels = local_labels.reshape(-1).long()
        if self.validate and not self._shapes_checked:
            self._check_shapes(local_embeddings, local_labels)
        embeddings = self.gather(local_embeddings) if gathered is None else gathered
        labels = all_gather_no_grad(local_labels, self.group)
        on_host = (
            labels.device.type == "cpu" if self.raise_on_bad_labels is None else self.raise_on_bad_labels
        )
        if self.validate and on_host:
            self._check_labels(labels)

        emb = embeddings.float()
        norms = torch.linalg.vector_norm(emb, dim=1)
        emb_n = emb / norms.clamp_min(EPS)[:, None]
        local = labels - self.class_start
        local = torch.where((local >= 0) & (local < self.num_local), local, -1)
        index = None
        if self.num_sample < self.num_local and self.training:
            index, local = self.sample(local)
            self.sampled.add(rows_of_classes(index, self.subcenters))
        margin = self.margin_loss
        weight = self.weight
        if not torch.is_grad_enabled():  # evaluation: statistics only (autograd would still flag the inputs)
            emb_n, norms, weight = emb_n.detach(), norms.detach(), weight.detach()
        loss = ShardedMarginCE.apply(
            emb_n,
            norms if margin.uses_norms else norms.detach(),
            weight,
            local,
            index,
            margin,
            self.plan,
            self.group,
            self.step_rows,
        )
        reg = margin.regularizer(norms)
        if reg is not None:  # identical on every rank: its gradient must count once in the sum over ranks
            share = 1.0 / self.world_size
            loss = loss + (reg * share + reg.detach() * (1.0 - share))
        if self.validate and not on_host:
            valid = ((labels >= 0) & (labels < self.num_classes)).all()
            self.add_label_errors(valid.logical_not().int())
            loss = torch.where(valid, loss, float("nan"))
        return loss

    def add_label_errors(self, bad: torch.Tensor) -> None:
        """Count a forward that met a bad label (`bad`: 0 or 1 on the device; heads.graph adds
        each replay's)."""
        self._label_errors = bad if self._label_errors is None else self._label_errors + bad

    def take_label_errors(self) -> int:
        """How many forwards since the last call met a label outside [0, num_classes) that was
        not raised at once (labels on a device). Reads the device: call where the loop waits."""
        count, self._label_errors = self._label_errors, None
        return 0 if count is None else int(count.item())
