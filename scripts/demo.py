#!/usr/bin/env python
"""`make demo`: generate the drawn-faces set (if absent), verify the untrained backbone, train
configs/demo.py on N gloo ranks, verify the trained model on unseen identities, export ONNX.
`python -m scripts.demo [--nproc 2]` from the repository root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import torch

from shardface.backbones import get_model
from shardface.configs import get_config
from shardface.eval.verification import load_bin, test
from shardface.infer.weights import load_backbone
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/demo.py"


def run(cmd: list[str], env=None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks to train on (default 2)")
    p.add_argument(
        "--min_accuracy",
        type=float,
        default=0.90,
        help="fail when the trained verification accuracy is below this (default 0.90)",
    )
    p.add_argument("--margin", default="", help="train with this margin head instead (see configs/schema.py)")
    args = p.parse_args(argv)
    overrides = ["--margin", args.margin, "--output", f"work_dirs/demo_{args.margin}"] if args.margin else []
    start = time.time()

    cfg = get_config(os.path.join(ROOT, CONFIG), overrides)
    data = os.path.join(ROOT, cfg.rec)
    if not os.path.isfile(os.path.join(data, "train.rec")):
        run([sys.executable, "-m", "scripts.make_drawn_faces", "--output", cfg.rec])
    val_bin = os.path.join(data, f"{cfg.val_targets[0]}.bin")
    val = load_bin(val_bin)

    torch.manual_seed(cfg.seed)
    untrained = get_model(cfg.network, num_features=cfg.embedding_size)
    before = test(val, untrained, 200).accuracy_flip
    print(f"untrained {cfg.network}: verification accuracy on unseen identities {before:.4f}", flush=True)

    shutil.rmtree(os.path.join(ROOT, cfg.output), ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--standalone"]
        if args.nproc > 1
        else [sys.executable]
    )
    run(torchrun + ["train.py", CONFIG, *overrides], env=env)
    run([sys.executable, "-m", "scripts.verify", cfg.output, "--bin", val_bin])
    onnx_path = os.path.join(cfg.output, "model.onnx")
    run([sys.executable, "-m", "scripts.export_onnx", cfg.output, onnx_path])

    after = test(val, load_backbone(os.path.join(ROOT, cfg.output)), 200).accuracy_flip
    print(
        f"\ndemo done in {time.time() - start:.0f}s: verification accuracy on unseen identities "
        f"{before:.4f} untrained -> {after:.4f} trained (EMA weights); ONNX model at {onnx_path}"
    )
    if after < args.min_accuracy:
        print(f"FAILED: accuracy {after:.4f} below {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
