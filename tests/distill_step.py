"""A training step with distillation, built from a config by builders.py and distill/run.py as
train.py builds it, for the checks that count what one step does (tests/test_host_data.py on the
CPU, the GPU kit's sync-debug run): backbone -> [head] + distillation loss -> backward -> clip ->
optimizers -> EMA, fed batches from the run's own DataLoader (rows of a teacher file arrive with
them)."""

from __future__ import annotations

import torch

from shardface.builders import (
    build_backbone,
    build_data_parallel,
    build_head,
    build_head_optimizer,
    build_train_dataset,
)
from shardface.configs import get_config
from shardface.dataset import ResumableDistributedSampler, get_dataloader, normalize_images
from shardface.distill.run import build_distillation
from shardface.parallel import ShardedEMA
from tests.train_runs import train_argv


def distill_step(data: str, teacher: str, device: torch.device, *extra: str):
    """(step, batches): `step(batch)` runs one optimizer step on a batch from `batches` (an
    iterator over the run's loader), as train.py's loop does at gradient_acc 1 without a scaler.
    The head checks labels as it does on a GPU (on the device, no host read) on any device."""
    argv = train_argv(data, "unused", "--teacher", teacher, "--batch_size", "4", *extra)
    cfg = get_config(argv[0], argv[1:])
    torch.manual_seed(cfg.seed)
    backbone = build_backbone(cfg).to(device)
    head = build_head(cfg, device)
    if head is not None:
        head.raise_on_bad_labels = False  # the GPU's way: CPU labels are otherwise checked on the host
    distill = build_distillation(cfg, backbone, device)
    model, backbone_opt = build_data_parallel(cfg, backbone)
    head_opt = build_head_optimizer(cfg, head)
    optimizers = [opt for opt in (backbone_opt, head_opt) if opt is not None]
    ema = ShardedEMA(backbone, cfg.ema_decay, cfg.ema_tau, optimizer=backbone_opt if cfg.zero else None)
    dataset = build_train_dataset(cfg)
    distill.check_data(cfg, dataset)
    sampler = ResumableDistributedSampler(len(dataset), 1, 0, cfg.batch_size, cfg.seed)
    dataset.set_epoch(0, cfg.seed)
    loader = get_dataloader(dataset, sampler, 0, device, cfg.seed, teacher_rows=distill.teacher_rows)

    def step(batch) -> torch.Tensor:
        images, labels, *rows = batch
        images = normalize_images(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        loss = distill.loss(head, model(images), labels, images, rows)
        loss.backward()
        backbone_opt.clip_grad_norm_(cfg.max_grad_norm, extra_params=list(head.parameters()) if head else [])
        for opt in optimizers:
            opt.step()
        ema.update()
        for opt in optimizers:
            opt.zero_grad()
        return loss.detach()

    return step, iter(loader)
