#!/usr/bin/env python
"""Images/s of MXFaceDataset (read from .rec + decode + flip + normalise) against bare PIL
decoding of the same JPEG bytes held in memory, through a DataLoader (batches of 64, the
default collate for all) in one process and with 2 workers. Dataset paths: float tensors in
[-1, 1] made per image (the arcface_torch API) and uint8 images (train.py's path: the batch
is normalised on the training device). Bare torchvision decoding is shown for reference."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
import warnings

import common  # noqa: F401,I001
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from shardface.dataset import MXFaceDataset
from shardface.dataset.recordio import unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # collating PIL's arrays


class BarePIL(Dataset):
    def __init__(self, payloads):
        self.payloads = payloads

    def __len__(self):
        return len(self.payloads)

    def __getitem__(self, i):
        with Image.open(io.BytesIO(self.payloads[i])) as img:
            return np.asarray(img.convert("RGB"))


class BareTorchvision(BarePIL):
    def __getitem__(self, i):
        return decode_jpeg(
            torch.frombuffer(bytearray(self.payloads[i]), dtype=torch.uint8), mode=ImageReadMode.RGB
        )


def _rate(dataset, n, workers, batch=64):
    torch.set_num_threads(1)
    loader = DataLoader(dataset, batch_size=batch, num_workers=workers, sampler=range(n))
    it = iter(loader)
    next(it)  # workers started, first batch out of the way
    t = time.perf_counter()
    count = 0
    for b in it:
        count += len(b[0]) if isinstance(b, (list, tuple)) else len(b)
    return count / (time.perf_counter() - t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rec", default=os.path.join(ROOT, "data/drawn_faces"))
    p.add_argument("--images", type=int, default=4000)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.rec, "train.rec")):
        subprocess.run(
            [sys.executable, "-m", "scripts.make_drawn_faces", "--output", args.rec], check=True, cwd=ROOT
        )
    raw = MXFaceDataset(args.rec, train=True, normalize=False)
    floats = MXFaceDataset(args.rec, train=True)
    n = min(args.images, len(raw))
    payloads = [unpack(raw.reader.read(raw.keys[i]))[1] for i in range(n)]
    print(f"{n} JPEG images of 112x112 from {args.rec}; DataLoader batches of 64")
    cases = {
        "bare PIL": BarePIL(payloads),
        "bare torchvision": BareTorchvision(payloads),
        "ours, float [-1,1]": floats,
        "ours, uint8": raw,
    }
    for workers in (0, 2):
        rates = {name: [] for name in cases}
        for _ in range(2):  # interleaved, best of each, so all see the same machine state
            for name, ds in cases.items():
                rates[name].append(_rate(ds, n, workers))
        best = {name: max(r) for name, r in rates.items()}
        label = "one process" if workers == 0 else f"{workers} workers"
        print(f"  {label}:")
        for name, r in best.items():
            print(f"    {name:18s} {r:8.0f} img/s   {r / best['bare PIL']:.2f}x bare PIL")


if __name__ == "__main__":
    main()
