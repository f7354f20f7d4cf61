#!/usr/bin/env python
"""Images/s of MXFaceDataset (read from .rec + decode + flip + to tensor) against bare PIL
decoding of the same JPEG bytes held in memory; one process, and a DataLoader with 2
workers for both. Two dataset paths: uint8 tensors (what train.py uses; the batch is
normalised on the training device) and float tensors in [-1, 1] (the arcface_torch API)."""
from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time

import common  # noqa: F401,I001
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from dataset import MXFaceDataset
from dataset.recordio import unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BareDecode(Dataset):
    def __init__(self, payloads):
        self.payloads = payloads

    def __len__(self):
        return len(self.payloads)

    def __getitem__(self, i):
        with Image.open(io.BytesIO(self.payloads[i])) as img:
            return np.asarray(img.convert("RGB"))


def _rate(dataset, n, workers, batch=64):
    torch.set_num_threads(1)
    if workers == 0:
        t = time.perf_counter()
        for i in range(n):
            dataset[i]
        return n / (time.perf_counter() - t)
    loader = DataLoader(dataset, batch_size=batch, num_workers=workers, sampler=range(n),
                        collate_fn=(None if isinstance(dataset, MXFaceDataset) else list))
    it = iter(loader)
    next(it)  # workers started
    t = time.perf_counter()
    count = batch
    for b in it:
        count += len(b[0]) if isinstance(b, (list, tuple)) and torch.is_tensor(b[0]) else len(b)
    return (count - batch) / (time.perf_counter() - t)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rec", default=os.path.join(ROOT, "data/synthetic"))
    p.add_argument("--images", type=int, default=4000)
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.rec, "train.rec")):
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts/make_synthetic.py"), "--output", args.rec],
                       check=True)
    ds = MXFaceDataset(args.rec, train=True, normalize=False)
    floats = MXFaceDataset(args.rec, train=True)
    n = min(args.images, len(ds))
    payloads = [unpack(ds.reader.read(ds.keys[i]))[1] for i in range(n)]
    print(f"{n} JPEG images of 112x112 from {args.rec}")
    for workers in (0, 2):
        rates = {"uint8": [], "float": [], "bare": []}
        for _ in range(2):  # interleaved, best of each, so all see the same machine state
            rates["uint8"].append(_rate(ds, n, workers))
            rates["float"].append(_rate(floats, n, workers))
            rates["bare"].append(_rate(BareDecode(payloads), n, workers))
        u8, fl, bare = (max(rates[k]) for k in ("uint8", "float", "bare"))
        label = "one process" if workers == 0 else f"{workers} workers"
        print(f"  {label:12s} bare PIL decode {bare:7.0f} img/s | MXFaceDataset uint8 {u8:7.0f} img/s "
              f"({u8 / bare:.2f}x, target >= 0.9) | float {fl:7.0f} img/s ({fl / bare:.2f}x)")


if __name__ == "__main__":
    main()
