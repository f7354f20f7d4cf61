"""train.py runs for the tests: the arguments of a short run on the `drawn_faces` fixture
(conftest.py) and the tensors a resumed run must reproduce."""

from __future__ import annotations

import os

import torch

from shardface.checkpoint.folders import resolve_checkpoint

TRAIN_STEPS = 12  # 8 steps per epoch at W=2, b=8 on `drawn_faces`: crosses an epoch boundary


def train_argv(data_dir: str, output: str, *extra: str) -> list[str]:
    """train.py arguments for a 12-step run of the demo config on the `drawn_faces` fixture."""
    return [
        "configs/demo.py",
        "--rec",
        data_dir,
        "--num_classes",
        "16",
        "--batch_size",
        "8",
        "--num_workers",
        "0",
        "--frequent",
        "1",
        "--verbose",
        "0",
        "--val_targets",
        "[]",
        "--checkpoint_interval",
        "4",
        "--num_epoch",
        "3",
        "--warmup_epoch",
        "0",
        "--max_steps",
        str(TRAIN_STEPS),
        "--chunk_size",
        "5",
        "--ema",
        "true",
        "--ema_tau",
        "2",
        "--lr",
        "0.05",
        "--keep_checkpoints",
        "5",
        "--output",
        output,
        *extra,
    ]


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of a run's last checkpoint (or of the checkpoint `path`) that a resumed run
    must reproduce: backbone, EMA, and the head's rows and momentum in class order."""
    ckpt = resolve_checkpoint(path)
    out = {f"backbone.{k}": v for k, v in torch.load(os.path.join(ckpt, "backbone.pt")).items()}
    out.update({f"ema.{k}": v for k, v in torch.load(os.path.join(ckpt, "ema.pt"))["state"].items()})
    heads = sorted(f for f in os.listdir(ckpt) if f.startswith("head-"))
    out["head"] = torch.cat([torch.load(os.path.join(ckpt, f))["weight"] for f in heads])
    out["head_momentum"] = torch.cat(
        [torch.load(os.path.join(ckpt, f))["state"]["momentum_buffer"] for f in heads]
    )
    return out
