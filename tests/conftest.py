"""Shared test helpers and fixtures. Helpers are imported (`from tests.conftest import jpeg`);
fixtures are found by pytest. Tests marked `gpu` need CUDA: without it they are skipped (so
`make test` needs no GPU); `make test-gpu` selects only them."""
from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from scripts.make_drawn_faces import main as make_drawn_faces

TRAIN_STEPS = 12  # 8 steps per epoch at W=2, b=8 on `drawn_faces`: crosses an epoch boundary


def jpeg(color, size: int = 112) -> bytes:
    """A solid-colour JPEG."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def train_argv(data_dir: str, output: str, *extra: str) -> list[str]:
    """train.py arguments for a 12-step run of the demo config on the `drawn_faces` fixture."""
    return ["configs/demo.py", "--rec", data_dir, "--num_classes", "16", "--batch_size", "8",
            "--num_workers", "0", "--frequent", "1", "--verbose", "0", "--val_targets", "[]",
            "--checkpoint_interval", "4", "--num_epoch", "3", "--warmup_epoch", "0",
            "--max_steps", str(TRAIN_STEPS), "--chunk_size", "5", "--ema", "true", "--ema_tau", "2",
            "--lr", "0.05", "--keep_checkpoints", "5", "--output", output, *extra]


def shardface_messages(call) -> list[str]:
    """What `call()` logs through the "shardface" logger, message by message (any level)."""
    import logging
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("shardface")
    logger.addHandler(handler)
    try:
        call()
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records]


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of a run's last checkpoint (or of the checkpoint `path`) that a resumed run
    must reproduce: backbone, EMA, and the head's rows and momentum in class order."""
    import os

    from checkpoint.folders import resolve_checkpoint
    ckpt = resolve_checkpoint(path)
    out = {f"backbone.{k}": v for k, v in torch.load(os.path.join(ckpt, "backbone.pt")).items()}
    out.update({f"ema.{k}": v for k, v in torch.load(os.path.join(ckpt, "ema.pt"))["state"].items()})
    heads = sorted(f for f in os.listdir(ckpt) if f.startswith("head-"))
    out["head"] = torch.cat([torch.load(os.path.join(ckpt, f))["weight"] for f in heads])
    out["head_momentum"] = torch.cat([torch.load(os.path.join(ckpt, f))["state"]["momentum_buffer"] for f in heads])
    return out


@pytest.fixture(scope="session")
def drawn_faces(tmp_path_factory) -> str:
    """A tiny drawn-faces RecordIO set: 16 identities x 8 images, and a verification .bin."""
    root = str(tmp_path_factory.mktemp("data") / "drawn_faces")
    make_drawn_faces(["--output", root, "--num-ids", "16", "--per-id", "8", "--val-ids", "6",
                      "--val-per-id", "4", "--val-pairs", "40", "--workers", "1"])
    return root


@pytest.fixture(scope="session")
def teacher_pt(tmp_path_factory) -> str:
    """A distillation teacher: a 64-D tiny network's model.pt (the demo student is 128-D, so the
    cosine loss trains a projection)."""
    from backbones import get_model
    torch.manual_seed(5)
    path = str(tmp_path_factory.mktemp("teacher") / "model.pt")
    torch.save(get_model("tiny", num_features=64).state_dict(), path)
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
