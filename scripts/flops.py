#!/usr/bin/env python
"""Parameters and GFLOPs of a backbone at 112x112, as arcface_torch's flops.py reports them.

    python -m scripts.flops r100 [--embedding_size 512]

"GFLOPs" follows arcface_torch's README and flops.py (ptflops): billions of
multiply-accumulates for one image, here those of convolutions, linear layers and the
attention products (arcface_torch's "Total-GFLOPs" for ViTs); normalisations and activations,
which ptflops adds, are left out (under 3%: mbf 0.44 here, 0.45 there). The model is built and
run on the meta device, so no memory is allocated and even r2060 takes seconds.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode

from shardface.backbones import get_model, list_models
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser


def complexity(network: str, num_features: int = 512) -> tuple[int, int]:
    """(parameters, multiply-accumulates) of `network` for one 3x112x112 image in eval mode."""
    with torch.device("meta"):
        model = get_model(network, num_features=num_features).eval()
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(torch.empty(1, 3, 112, 112))
    params = sum(p.numel() for p in model.parameters())
    return params, counter.get_total_flops() // 2  # the counter's FLOPs are 2 per multiply-add


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "network",
        choices=list_models(),
        metavar="NETWORK",
        help=f"a backbones.get_model name: {', '.join(list_models())}",
    )
    p.add_argument(
        "--embedding_size",
        type=int,
        default=512,
        help="embedding dimension (num_features), as the config's embedding_size",
    )
    args = p.parse_args(argv)
    params, macs = complexity(args.network, args.embedding_size)
    print(
        f"{args.network}: {macs / 1e9:.3f} GFLOPs (multiply-accumulates at 112x112), "
        f"{params / 1e6:.3f} Mparams ({params:,} parameters)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
