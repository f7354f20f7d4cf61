#!/usr/bin/env python
"""Verify a checkpoint on LFW-format .bin sets and print a table of results."""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from backbones.load import load_backbone  # noqa: E402
from eval.verification import load_bin, test  # noqa: E402


def main(argv=None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("checkpoint", help="run output, checkpoint dir or model.pt")
    p.add_argument("--bin", action="append", required=True, help="a .bin file (repeatable)")
    p.add_argument("--network", default=None)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--no-ema", action="store_true")
    args = p.parse_args(argv)
    model = load_backbone(args.checkpoint, args.network, ema=not args.no_ema)
    model = model.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for path in args.bin:
        acc, std, acc_flip, std_flip, xnorm, _ = test(load_bin(path), model, args.batch_size)
        rows.append((os.path.basename(path), acc, acc_flip, std_flip, xnorm))
    print(f"{'set':<20} {'acc':>8} {'acc-flip':>9} {'std':>7} {'XNorm':>8}")
    for name, acc, acc_flip, std_flip, xnorm in rows:
        print(f"{name:<20} {acc:8.4f} {acc_flip:9.4f} {std_flip:7.4f} {xnorm:8.3f}")
    return rows


if __name__ == "__main__":
    main()
