"""Builders and run-time helpers for train.py: models and optimizers from a config, stop
signals, progress logging, fault checks."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from backbones import get_model
from heads import PartialFC, SampledRowsOptimizer
from losses import build_margin
from parallel.ddp import DDPOptimizer
from parallel.dist import cpu_group, get_world_size
from parallel.dist import get_rank as dist_rank
from parallel.zero import Zero2Optimizer
from utils.progress import format_seconds

logger = logging.getLogger("shardface")

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


class TrainingStopped(RuntimeError):
    """The run cannot continue (diverged); the last checkpoint on disk is the last good one."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_backbone(cfg) -> torch.nn.Module:
    return get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout,
                     fp16=cfg.fp16, bf16=cfg.bf16, grad_checkpoint=cfg.grad_checkpoint)


def build_head(cfg) -> PartialFC:
    margin = build_margin(cfg)
    if cfg.head_fused_optimizer:
        # the head's rows are stepped inside backward: refuse what that cannot serve exactly
        refuse = {"gradient_acc > 1 (rows would step every micro-batch)": cfg.gradient_acc > 1,
                  "fp16 (a step the loss scaler skips would already have moved the head)": cfg.fp16,
                  "clip_head true with max_grad_norm > 0 (the global norm is not known yet; set "
                  "clip_head false to clip the backbone only)": cfg.clip_head and cfg.max_grad_norm > 0}
        bad = [why for why, hit in refuse.items() if hit]
        if bad:
            raise ValueError("head_fused_optimizer true cannot serve: " + "; ".join(bad))
    return PartialFC(margin, cfg.embedding_size, cfg.num_classes, cfg.sample_rate, cfg.chunk_size or None,
                     row_block=cfg.row_block, precision=cfg.head_precision,
                     fused_optimizer=cfg.head_fused_optimizer)


def optimizer_kwargs(cfg) -> tuple[type, dict]:
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer '{cfg.optimizer}' ({', '.join(OPTIMIZERS)})")
    kw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        kw["momentum"] = cfg.momentum
    return OPTIMIZERS[cfg.optimizer], kw


def build_optimizers(cfg, backbone, head):
    """(backbone optimizer: ZeRO-2 or DDP, head optimizer stepping only sampled rows)."""
    cls, kw = optimizer_kwargs(cfg)
    backbone_opt = Zero2Optimizer(backbone, cls, **kw) if cfg.zero else DDPOptimizer(backbone, cls, **kw)
    return backbone_opt, SampledRowsOptimizer(head, cls, **kw)


def save_config(cfg, output: str) -> None:
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(dict(cfg), f, indent=2, sort_keys=True, default=list)


class StopSignal:
    """SIGTERM / SIGINT set a flag; `requested()` agrees on it across ranks (one tiny
    all-reduce over a CPU group), so every rank saves and exits at the same step.

    Create it first thing, before any thread exists: it blocks the signals in the calling
    thread, so every thread started later (gloo's, the data loader's) inherits the block and
    no blocking call in them is interrupted mid-collective; one waiter thread receives them.
    """

    SIGNALS = {signal.SIGTERM, signal.SIGINT}

    def __init__(self):
        self.flag = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        self.previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self.closed = False
        self.waiter = threading.Thread(target=self._wait, name="stop-signal", daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        while True:
            signal.sigwait(self.SIGNALS)
            if self.closed:
                return
            self.flag = True

    def _handle(self, signum, frame) -> None:  # a thread started before us took the signal
        self.flag = True

    def requested(self) -> bool:
        if get_world_size() == 1:
            return self.flag
        t = torch.tensor([float(self.flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
        return bool(t.item())

    def restore(self) -> None:
        """Give the signals back to their previous handlers (in-process callers, tests)."""
        self.closed = True
        signal.pthread_kill(self.waiter.ident, signal.SIGTERM)  # wakes the waiter, which exits
        self.waiter.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def check_labels(labels: torch.Tensor, num_classes: int) -> str | None:
    """Describe the first label of a CPU batch outside [0, num_classes), or None. The head
    raises the same error on every rank; this names the position on the rank that has it."""
    bad = (labels < 0) | (labels >= num_classes)
    if not bool(bad.any()):
        return None
    at = int(bad.int().argmax())
    return f"label {int(labels[at])} outside [0, {num_classes}) at batch position {at} of rank {dist_rank()}"


class ProgressLogger:
    """Rank 0's progress line every `frequent` steps: loss, lr, global samples/s, ETA.

    Losses are collected as device tensors (`add`) and read by the host only when a line is
    due, so the training loop waits on the device once per `frequent` steps."""

    def __init__(self, total_steps: int, frequent: int, samples_per_step: int, writer=None, first_step: int = 0):
        self.total, self.frequent, self.samples_per_step = total_steps, frequent, samples_per_step
        self.writer = writer
        self.pending: list[torch.Tensor] = []
        self.mark_time, self.mark_step = time.time(), first_step

    def add(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)

    def due(self, step: int) -> bool:
        return step % self.frequent == 0 or step == self.total

    def mean_loss(self) -> float:
        """The mean of the losses since the last line (one read from the device); a non-finite
        loss anywhere in the window makes it non-finite."""
        losses = torch.stack(self.pending).float().cpu()
        self.window = losses.tolist()
        self.pending.clear()
        return float(losses.mean())

    def __call__(self, step: int, epoch: int, loss: float, lr: float, scale: float | None) -> None:
        if self.writer is not None:
            for i, value in enumerate(self.window):
                self.writer.add_scalar("train/loss", value, step - len(self.window) + 1 + i)
            self.writer.add_scalar("train/lr", lr, step)
        now = time.time()
        rate = (step - self.mark_step) * self.samples_per_step / max(now - self.mark_time, 1e-9)
        eta = (self.total - step) * self.samples_per_step / max(rate, 1e-9)
        scale_txt = f"  scale {scale:.0f}" if scale is not None else ""
        logger.info("step %d/%d  epoch %d  loss %.4f  lr %.5f  %.1f samples/s  ETA %s%s",
                    step, self.total, epoch, loss, lr, rate, format_seconds(eta), scale_txt)
        if self.writer is not None:
            self.writer.add_scalar("train/samples_per_second", rate, step)
        self.mark_time, self.mark_step = now, step


def check_loss(loss_value: float, step: int, scaler, max_skipped: int = 20) -> None:
    """Stop on a non-finite loss (fp32/bf16) or a loss scaler that keeps skipping (fp16).
    The loss is the global mean, identical on every rank, so all ranks stop together."""
    if scaler is None:
        if not np.isfinite(loss_value):
            raise TrainingStopped(f"loss is {loss_value} at step {step}: training diverged (or a label "
                                  f"was out of range: see any error above); resume from the last "
                                  f"checkpoint with a lower lr")
    elif scaler.skipped_in_a_row >= max_skipped:
        raise TrainingStopped(f"fp16 loss scaler skipped {scaler.skipped_in_a_row} steps in a row "
                              f"(scale {scaler.scale_value}) at step {step}: gradients stay non-finite")
