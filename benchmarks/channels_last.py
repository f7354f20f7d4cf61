#!/usr/bin/env python
"""What `config.channels_last` buys on this machine: each network's training step (forward and
backward) and embedding (inference) in images per second with the batch in the default NCHW
memory and in channels-last (NHWC), timed in turn in one process, and the ratio.

The parameters keep their layout either way (ZeRO's flat shards need it); only the activations
change. Run it with nothing else on the CPU:
`.venv/bin/python benchmarks/channels_last.py [--networks tiny mbf r18 dlib_resnet] [--threads 1]`
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch
from common import table

from shardface.backbones import get_model

# (batch of a training step, embedding width): the real-faces benchmark's networks
NETWORKS = {"tiny": (64, 128), "mbf": (32, 512), "r18": (16, 512), "dlib_resnet": (16, 128)}


def _rate(model: torch.nn.Module, x: torch.Tensor, train: bool) -> float:
    """Images per second of one call (a training step, or an embedding in inference mode)."""
    t = time.perf_counter()
    if train:
        model(x).square().mean().backward()
    else:
        with torch.inference_mode():
            model(x)
    return x.shape[0] / (time.perf_counter() - t)


def measure(name: str, rounds: int, batch: int | None = None) -> dict:
    default_batch, width = NETWORKS[name]
    torch.manual_seed(0)
    model = get_model(name, num_features=width)
    nchw = torch.randn(batch or default_batch, 3, 112, 112)
    layouts = {"NCHW": nchw, "NHWC": nchw.contiguous(memory_format=torch.channels_last)}
    best = {}
    for train in (True, False):
        model.train(train)
        for x in layouts.values():  # a warm-up call each: oneDNN builds its kernels on the first
            _rate(model, x, train)
        for _ in range(rounds):  # in turn, so that a slower spell of the machine hits both
            for layout, x in layouts.items():
                key = (train, layout)
                best[key] = max(best.get(key, 0.0), _rate(model, x, train))
    row = {"network": name}
    for train, what in ((True, "train"), (False, "embed")):
        a, b = best[(train, "NCHW")], best[(train, "NHWC")]
        row.update({f"{what} NCHW": f"{a:.1f}", f"{what} NHWC": f"{b:.1f}", f"{what} x": f"{b / a:.2f}"})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    p.add_argument("--threads", type=int, default=1, help="torch threads (a training rank's: 1 per core)")
    p.add_argument("--rounds", type=int, default=5, help="timed calls per layout; the best is kept")
    p.add_argument("--smoke", action="store_true", help="batch 2, one round (figures mean nothing)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(n, 1 if args.smoke else args.rounds, 2 if args.smoke else None) for n in args.networks]
    print(
        f"images/s, 112 x 112 crops, {args.threads} thread(s), best of {1 if args.smoke else args.rounds}; "
        "x: NHWC / NCHW"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
