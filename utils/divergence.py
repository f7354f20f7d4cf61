"""Stopping a run that has diverged, so no checkpoint after the last good one is written.

The rule for a checkpoint (`check_weights`, before every save): its weights are finite, give a
finite loss on the step's last batch, and the backbone's weight norm is at most
`EXPLODED_FACTOR` times its norm when the run was built (its initial or pretrained weights;
the same seed gives a resumed run the same reference). Finite is not enough: a too-high lr
multiplies the weights by orders of magnitude per step, and weights around 1e26 are finite,
still give a finite loss through the normalised head, yet poison every later step. A healthy
run moves the backbone's norm by a few times at most (the demo: 31.1 at start, 31.1 after 12
steps); lr 1e6 multiplies it by 1.5e5 in one step.

A network with no BatchNorm at its end (`dlib_resnet`) can diverge more quietly: each layer's
weights grow a few times, which no weight-norm limit flags, while the embeddings grow by their
product. Fine-tuning dlib's network at lr 0.1 took its embedding norm from 1.55 to 2.9e9, every
face pointing one way (LFW at chance), with the loss finite throughout. `EmbeddingNormWatch`
warns when the embeddings' mean norm grows `NORM_GROWTH_WARN` times over the run's first
logged value (a network ending in BatchNorm keeps it near sqrt(D) x its scale: mbf 20.7 and the
demo network 10.4 after training).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from shardface.parallel.dist import cpu_group, get_world_size

logger = logging.getLogger("shardface")

EXPLODED_FACTOR = (
    1000.0  # backbone weight norm over its norm at start beyond which the weights count as diverged
)
NORM_GROWTH_WARN = 100.0  # embedding norm over its first logged value beyond which the run is warned of


class TrainingStopped(RuntimeError):
    """The run cannot continue (diverged); the last checkpoint on disk is the last good one."""


def check_loss(loss_value: float, step: int, scaler, max_skipped: int = 20, label_errors: int = 0) -> None:
    """Stop on a label outside the classes (`label_errors`: batches the head met with one,
    `PartialFC.take_label_errors()`), a non-finite loss (fp32/bf16) or a loss scaler that
    keeps skipping (fp16). Call on every rank at the same steps: all ranks stop together. The
    label errors and the scaler's state are the same on every rank; the loss need not be (with
    distillation each rank's loss holds its own term), so without a scaler the ranks agree,
    over the CPU group, on whether every rank's loss is finite: a rank stopping alone would
    leave the others waiting in the next collective until `dist_timeout_min`."""
    if label_errors:
        raise TrainingStopped(
            f"{label_errors} batch(es) up to step {step} held a label outside the classes "
            f"(the rank that read it logged the label and its position above): fix the data "
            f"or num_classes; the last checkpoint was written before it"
        )
    if scaler is None:
        finite = math.isfinite(loss_value)
        if not _on_every_rank(finite):
            where = f"is {loss_value}" if not finite else "is not finite on another rank"
            raise TrainingStopped(
                f"loss {where} at step {step}: training diverged (or a label "
                f"was out of range: see any error above); resume from the last "
                f"checkpoint with a lower lr"
            )
    elif scaler.skipped_in_a_row >= max_skipped:
        raise TrainingStopped(
            f"fp16 loss scaler skipped {scaler.skipped_in_a_row} steps in a row "
            f"(scale {scaler.scale_value}) at step {step}: gradients stay non-finite"
        )


def _on_every_rank(holds: bool) -> bool:
    """Whether `holds` on every rank (one all-reduce over the CPU group: no device sync)."""
    if get_world_size() == 1:
        return holds
    flag = torch.full((1,), 0.0 if holds else 1.0)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
    return flag.item() == 0.0


@torch.no_grad()
def probe_loss(
    backbone: torch.nn.Module, head: torch.nn.Module | None, images: torch.Tensor, labels: torch.Tensor
) -> float:
    """The loss of a batch under the current weights, leaving no trace: no gradients, and
    the buffers (BatchNorm statistics, margin statistics) and RNG states put back, so an
    exact resume stays exact. The backbone runs in training mode, as the next step would;
    the head in eval mode, over all classes of its shard (no Partial FC sampling, so the
    rows its optimizer steps next are untouched). Collective (the head all-reduces). With no
    head (label-free) it is 0.0 when every rank's embeddings are finite, else nan (`_all_finite`):
    the teacher is not run again for a probe."""
    modules = [m for m in (backbone, head) if m is not None]
    buffers = [b for module in modules for b in module.buffers()]
    saved = [b.clone() for b in buffers]
    devices = [images.device] if images.device.type == "cuda" else []
    head_training = head is not None and head.training
    if head is not None:
        head.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            embeddings = backbone(images)
            loss = head(embeddings, labels) if head is not None else _all_finite(embeddings)
    finally:
        if head is not None:
            head.train(head_training)
        for b, s in zip(buffers, saved):
            b.copy_(s)
    return float(loss.item())


def _all_finite(embeddings: torch.Tensor) -> torch.Tensor:
    """0.0 when every rank's embeddings are finite, else nan, the same on every rank (as the
    head's all-reduce makes its loss), so all ranks stop or save alike."""
    bad = (~torch.isfinite(embeddings).all()).float()
    if get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return torch.where(bad > 0, float("nan"), 0.0)


@torch.no_grad()
def weight_norm(module: torch.nn.Module) -> float:
    """The L2 norm of all of `module`'s parameters, in float64 (weights of 1e20 square past fp32)."""
    norms = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in module.parameters()]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def check_weights(
    step: int,
    backbone: torch.nn.Module,
    head: torch.nn.Module | None,
    batch=None,
    start_norm: float | None = None,
) -> None:
    """Raise TrainingStopped unless the weights about to be saved are finite on every rank,
    give a finite loss on `batch` (images, labels), and the backbone's norm is within
    `EXPLODED_FACTOR` of `start_norm` (the module docstring's rule): the loss the loop checks is
    the one before the update, so an update can poison the weights it then saves. Collective."""
    finite = all(
        bool(torch.isfinite(p).all())
        for module in (backbone, head)
        if module is not None
        for p in module.parameters()
    )
    norm = weight_norm(backbone) if finite and start_norm else 0.0
    # identical weights on every rank
    exploded = bool(start_norm) and not norm <= EXPLODED_FACTOR * start_norm
    if get_world_size() > 1:
        flag = torch.tensor([0.0 if finite else 1.0, 1.0 if exploded else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
        finite, exploded = flag[0].item() == 0.0, flag[1].item() == 1.0
    if finite and exploded:
        raise TrainingStopped(
            f"the weights after step {step} exploded: the backbone's weight norm is {norm:.3g}, "
            f"{norm / start_norm:.3g} times its {start_norm:.3g} at start (the limit is "
            f"{EXPLODED_FACTOR:g} times): training diverged and they are not saved; resume from "
            f"the last checkpoint with a lower lr"
        )
    loss = probe_loss(backbone, head, *batch) if finite and batch is not None else float("nan")
    if not finite or (batch is not None and not math.isfinite(loss)):
        what = "are not finite" if not finite else f"give loss {loss} on the last batch"
        raise TrainingStopped(
            f"the weights after step {step} {what}: training diverged and they are not "
            f"saved; resume from the last checkpoint with a lower lr"
        )


class EmbeddingNormWatch:
    """The mean L2 norm of the embeddings (this rank's batches): collected on the device each
    step (`add`), read by the host once per report (`__call__`, when the loss is read too),
    written to tensorboard as train/embedding_norm, and one warning when it first exceeds
    `NORM_GROWTH_WARN` times the first value this process logged (a resumed run measures from
    where it resumed)."""

    def __init__(self, writer=None, growth_warn: float = NORM_GROWTH_WARN):
        self.writer, self.growth_warn = writer, growth_warn
        self.pending: list[torch.Tensor] = []
        self.first: tuple[int, float] | None = None  # (step, mean norm) of the first report
        self.warned = False

    def add(self, embeddings: torch.Tensor) -> None:
        self.pending.append(torch.linalg.vector_norm(embeddings.detach().float(), dim=1).mean())

    def __call__(self, step: int) -> float | None:
        """The mean norm since the last call (None when nothing was added), warned of as above."""
        if not self.pending:
            return None
        value = float(torch.stack(self.pending).mean().cpu())
        self.pending.clear()
        if self.writer is not None:
            self.writer.add_scalar("train/embedding_norm", value, step)
        if self.first is None:
            self.first = (step, value)
        elif not self.warned and not value <= self.growth_warn * self.first[1]:
            self.warned = True
            first_step, first = self.first
            logger.warning(
                "the embeddings' mean norm is %.3g at step %d, %.3g times its %.3g at step %d: the "
                "backbone is diverging though the loss is finite (a network with no BatchNorm at its "
                "end, such as dlib_resnet, does so quietly); stop it and start again with a lower lr",
                value,
                step,
                value / max(first, 1e-30),
                first,
                first_step,
            )
        return value


def check_labels(labels, num_classes: int) -> str | None:
    """Describe the first label of a CPU batch outside [0, num_classes), or None. The head
    stops every rank (an error with CPU labels, a NaN loss on a device); this names the
    batch position on the rank that has it."""
    bad = (labels < 0) | (labels >= num_classes)
    if not bool(bad.any()):
        return None
    at = int(bad.int().argmax())
    return f"label {int(labels[at])} outside [0, {num_classes}) at batch position {at}"
