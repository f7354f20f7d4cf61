"""Stopping a run that has diverged, so no checkpoint after the last good one is written."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from parallel.dist import cpu_group, get_world_size


class TrainingStopped(RuntimeError):
    """The run cannot continue (diverged); the last checkpoint on disk is the last good one."""


def check_loss(loss_value: float, step: int, scaler, max_skipped: int = 20, label_errors: int = 0) -> None:
    """Stop on a label outside the classes (`label_errors`: batches the head met with one,
    `PartialFC.take_label_errors()`), a non-finite loss (fp32/bf16) or a loss scaler that
    keeps skipping (fp16). Every input is identical on every rank, so all ranks stop together."""
    if label_errors:
        raise TrainingStopped(f"{label_errors} batch(es) up to step {step} held a label outside the classes "
                              f"(the rank that read it logged the label and its position above): fix the data "
                              f"or num_classes; the last checkpoint was written before it")
    if scaler is None:
        if not math.isfinite(loss_value):
            raise TrainingStopped(f"loss is {loss_value} at step {step}: training diverged (or a label "
                                  f"was out of range: see any error above); resume from the last "
                                  f"checkpoint with a lower lr")
    elif scaler.skipped_in_a_row >= max_skipped:
        raise TrainingStopped(f"fp16 loss scaler skipped {scaler.skipped_in_a_row} steps in a row "
                              f"(scale {scaler.scale_value}) at step {step}: gradients stay non-finite")


@torch.no_grad()
def probe_loss(backbone: torch.nn.Module, head: torch.nn.Module, images: torch.Tensor,
               labels: torch.Tensor) -> float:
    """The loss of a batch under the current weights, leaving no trace: no gradients, and
    the buffers (BatchNorm statistics, margin statistics) and RNG states put back, so an
    exact resume stays exact. The backbone runs in training mode, as the next step would;
    the head in eval mode, over all classes of its shard (no Partial FC sampling, so the
    rows its optimizer steps next are untouched). Collective (the head all-reduces)."""
    buffers = [b for module in (backbone, head) for b in module.buffers()]
    saved = [b.clone() for b in buffers]
    devices = [images.device] if images.device.type == "cuda" else []
    head_training = head.training
    head.eval()
    try:
        with torch.random.fork_rng(devices=devices):
            loss = head(backbone(images), labels)
    finally:
        head.train(head_training)
        for b, s in zip(buffers, saved):
            b.copy_(s)
    return float(loss.item())


def check_weights(step: int, backbone: torch.nn.Module, head: torch.nn.Module, batch=None) -> None:
    """Raise TrainingStopped unless the weights about to be saved are finite on every rank
    and give a finite loss on `batch` (images, labels): the loss the loop checks is the one
    before the update, so an update can poison the weights it then saves. Collective."""
    finite = all(bool(torch.isfinite(p).all()) for module in (backbone, head) for p in module.parameters())
    if get_world_size() > 1:
        flag = torch.tensor([0.0 if finite else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=cpu_group())
        finite = flag.item() == 0.0
    loss = probe_loss(backbone, head, *batch) if finite and batch is not None else float("nan")
    if not finite or (batch is not None and not math.isfinite(loss)):
        what = "are not finite" if not finite else f"give loss {loss} on the last batch"
        raise TrainingStopped(f"the weights after step {step} {what}: training diverged and they are not "
                              f"saved; resume from the last checkpoint with a lower lr")


def check_labels(labels, num_classes: int) -> str | None:
    """Describe the first label of a CPU batch outside [0, num_classes), or None. The head
    stops every rank (an error with CPU labels, a NaN loss on a device); this names the
    batch position on the rank that has it."""
    bad = (labels < 0) | (labels >= num_classes)
    if not bool(bad.any()):
        return None
    at = int(bad.int().argmax())
    return f"label {int(labels[at])} outside [0, {num_classes}) at batch position {at}"
