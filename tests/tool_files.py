"""Small inputs for the command-line tools' tests: photo folders, a tiny model, a .bin."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import torch
from PIL import Image

from shardface import backbones

RNG = np.random.default_rng(7)


def noise_jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(
        buf, format="JPEG", quality=90
    )
    return buf.getvalue()


def truncated_jpeg(seed: int = 99) -> bytes:
    """A JPEG cut in half: its header reads (112x112), its pixels do not decode."""
    data = noise_jpeg(seed)
    return data[: len(data) // 2]


def jpeg(color, size: int = 112) -> bytes:
    """A solid-colour JPEG."""
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def photos(root, ids: int = 3, per_id: int = 4, first_seed: int = 0) -> str:
    """`root/id<i>/<j>.jpg`: 112x112 noise JPEGs, one sub-folder per identity."""
    for i in range(ids):
        os.makedirs(os.path.join(root, f"id{i}"), exist_ok=True)
        for j in range(per_id):
            with open(os.path.join(root, f"id{i}", f"{j}.jpg"), "wb") as f:
                f.write(noise_jpeg(first_seed + 100 * i + j))
    return str(root)


def tiny_model(folder, nan_key: str | None = None) -> str:
    """`folder/model.pt` of the tiny backbone (64-D), with the config.json naming it; with
    `nan_key`, that weight holds a NaN."""
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    state = backbones.get_model("tiny", num_features=64).state_dict()
    if nan_key is not None:
        state[nan_key].view(-1)[0] = float("nan")
    path = os.path.join(folder, "model.pt")
    torch.save(state, path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"network": "tiny"}, f)
    return path


def dead_pid() -> int:
    """The pid of a process that has exited."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
