"""A gallery folder of people, the model that embeds it and scripts.identify run as a test
calls it: the inputs of the identification and gallery tests."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from PIL import Image

from shardface.backbones import get_model
from shardface.scripts.identify import main as identify


def seeded_model(folder, seed):
    torch.manual_seed(seed)
    os.makedirs(folder, exist_ok=True)
    torch.save(get_model("tiny", num_features=32).eval().state_dict(), os.path.join(folder, "model.pt"))
    json.dump({"network": "tiny"}, open(os.path.join(folder, "config.json"), "w"))
    return os.path.join(folder, "model.pt")


def noise_face(path, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(path)
    return str(path)


def gallery_folder(root, per_person=(1, 2, 3)):
    for p, n in enumerate(per_person):
        os.makedirs(root / f"person{p}")
        for i in range(n):
            noise_face(root / f"person{p}" / f"{i}.png", 10 * p + i)
    return str(root)


def run_identify(capsys, *argv):
    """identify, naming everyone (--threshold -1) unless the test gives its own threshold."""
    argv = list(argv) if any(a.startswith("--threshold") for a in argv) else [*argv, "--threshold", "-1"]
    code = identify(argv)
    out = capsys.readouterr()
    return code, out.out, out.err
