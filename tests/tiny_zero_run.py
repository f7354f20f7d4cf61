"""A tiny run of every training part on one rank of a gloo group: backbone under ZeRO-2 (small
buckets, reductions in flight), the margin head with Partial FC over uneven class shards, both
optimizers, the sharded EMA and the fp16 loss scaler; and one training step of it."""

from __future__ import annotations

import torch
from torch import nn

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.losses import CombinedMarginLoss
from shardface.parallel import DynamicLossScaler, ShardedEMA, Zero2Optimizer

NUM_CLASSES, D, B = 50, 16, 4  # 50 % 8 != 0: uneven class shards


def build_parts(rank, exchange):
    torch.manual_seed(0)  # the same backbone on every rank
    backbone = nn.Sequential(
        nn.Flatten(),
        nn.Linear(3 * 8 * 8, 40),
        nn.BatchNorm1d(40),
        nn.PReLU(40),
        nn.Linear(40, D),
        nn.BatchNorm1d(D),
    )
    head = PartialFC(CombinedMarginLoss(16.0, 1.0, 0.5, 0.0), D, NUM_CLASSES, sample_rate=0.5, chunk_size=3)
    # 8 KB buckets: the backbone (35 KB) spans five, two reductions in flight
    opt = Zero2Optimizer(
        backbone,
        torch.optim.SGD,
        lr=0.1,
        momentum=0.9,
        weight_decay=5e-4,
        bucket_cap_mb=0.008,
        max_inflight_buckets=2,
        exchange=exchange,
    )
    head_opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
    ema = ShardedEMA(backbone, 0.9, 1.0, optimizer=opt)
    torch.manual_seed(100 + rank)  # each rank its own data and Partial FC sample
    return dict(
        backbone=backbone,
        backbone_opt=opt,
        head=head,
        head_opt=head_opt,
        ema=ema,
        scaler=DynamicLossScaler(init_scale=2.0**8),
    )


def train_step(parts):
    x = torch.randn(B, 3, 8, 8)
    labels = torch.randint(0, NUM_CLASSES, (B,))
    opt, head, scaler = parts["backbone_opt"], parts["head"], parts["scaler"]
    loss = head(parts["backbone"](x), labels)
    scaler.scale(loss).backward()
    if scaler.unscale_(opt, extra_params=head.parameters()):
        opt.clip_grad_norm_(5.0, extra_params=head.parameters())
        opt.step()
        parts["head_opt"].step()
        parts["ema"].update()
    opt.zero_grad()
    parts["head_opt"].zero_grad()
