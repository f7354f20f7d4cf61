#!/usr/bin/env python
"""After sub-center ArcFace training: keep each class's dominant sub-centre, list noisy images.

    python -m scripts.drop_subcenters work_dirs/ms1mv3_r50_subcenter_arcface --out clean/

Embeds the training set with the run's backbone, finds for every class the sub-centre most
of its images are nearest to (Deng et al., ECCV 2020), and writes `head_dominant.pt` (the
C x D weight of those centres) and `noisy_images.txt` (dataset indices of images more than
`--max_degrees` from their class's dominant centre, which the paper drops before retraining).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch
from easydict import EasyDict

from shardface.builders import build_train_dataset
from shardface.checkpoint.files import CheckpointError, safe_load
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.configs.base import config as BASE
from shardface.errors import ConfigError, OutputError
from shardface.infer.weights import load_backbone
from shardface.losses.subcenter import dominant_subcenters, drop_subcenters, far_from_dominant
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.utils.atomic import publishing_set
from shardface.utils.outputs import check_output_file, refuse_inputs


def full_head_weight(checkpoint: str) -> tuple[torch.Tensor, int]:
    """The whole C*k x D head weight from a checkpoint's per-rank files, and k."""
    parts = [safe_load(p) for p in sorted(glob.glob(os.path.join(checkpoint, "head-*.pt")))]
    if not parts:
        raise CheckpointError(f"{checkpoint}: no head-*.pt files")
    return torch.cat([p["weight"] for p in parts]), parts[0].get("subcenters", 1)


def _training_config(run: str, checkpoint: str) -> dict:
    """The run's config.json, or (a checkpoint directory given) the config its meta.pt holds."""
    path = os.path.join(run, "config.json")
    if os.path.isfile(path):
        try:
            with open(path) as f:
                return json.load(f)
        except ValueError as exc:
            raise CheckpointError(
                f"{path}: unreadable ({exc}); the config in {checkpoint}/meta.pt is used if you "
                f"pass the checkpoint directory instead"
            ) from None
    return safe_load(os.path.join(checkpoint, "meta.pt")).get("config") or {}


def _files_under(*folders: str) -> list[str]:
    """The files the run's weights are read from (an output must not be one of them)."""
    return [
        os.path.join(folder, name)
        for folder in folders
        if os.path.isdir(folder)
        for name in os.listdir(folder)
    ]


@exits_on_user_error
@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a training output directory (config.json and checkpoints)")
    p.add_argument("--out", required=True, help="directory for head_dominant.pt and noisy_images.txt")
    p.add_argument(
        "--max_degrees",
        type=float,
        default=75.0,
        help="list images farther than this angle from their dominant centre (default 75)",
    )
    p.add_argument("--batch_size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace head_dominant.pt and noisy_images.txt in --out"
    )
    args = p.parse_args(argv)
    if not 0 < args.max_degrees <= 180:  # nan fails too
        raise ConfigError(f"--max_degrees {args.max_degrees:g}: an angle above 0 and at most 180 degrees")
    if args.batch_size < 1:
        raise ConfigError(f"--batch_size {args.batch_size}: at least 1")
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # found now, not after the whole pass
        raise OutputError(
            f"--out {args.out}: a file is in its place; give a directory (it receives "
            f"head_dominant.pt and noisy_images.txt)"
        )
    outputs = [os.path.join(args.out, "head_dominant.pt"), os.path.join(args.out, "noisy_images.txt")]
    if os.path.isdir(args.out):
        for path in outputs:
            check_output_file(path, overwrite=args.overwrite)
    checkpoint = resolve_checkpoint(args.run)
    refuse_inputs(outputs, _files_under(args.run, checkpoint))
    cfg = EasyDict({**BASE, **_training_config(args.run, checkpoint)})  # keys newer than the run: defaults
    weight, k = full_head_weight(checkpoint)
    if k < 2:
        raise CheckpointError(f"{args.run}: the head has one centre per class; nothing to drop")
    model = load_backbone(args.run).eval()
    # as trained: align, resize, skipped images
    dataset = build_train_dataset(cfg, train=False, normalize=True)
    os.makedirs(args.out, exist_ok=True)  # an unwritable --out fails here, before the pass
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, num_workers=cfg.num_workers)
    embeddings, labels = [], []
    for i, (images, y) in enumerate(loader):
        embeddings.append(model(images))
        labels.append(y.long())
        print(f"\rembedded {min((i + 1) * args.batch_size, len(dataset))}/{len(dataset)}", end="", flush=True)
    embeddings, labels = torch.cat(embeddings), torch.cat(labels)
    dominant = dominant_subcenters(weight, embeddings, labels, k)
    noisy = far_from_dominant(weight, dominant, embeddings, labels, k, args.max_degrees)
    # one set (utils.atomic), the list last: a head_dominant.pt without its noisy_images.txt is an interrupted run
    with publishing_set(outputs) as (head_tmp, noisy_tmp):
        torch.save(drop_subcenters(weight, dominant, k), head_tmp)
        with open(noisy_tmp, "w") as f:
            f.writelines(f"{i}\n" for i in noisy.tolist())
    print(
        f"\n{len(dominant)} classes kept one centre each; {len(noisy)} of {len(labels)} images are more "
        f"than {args.max_degrees:g} degrees from it (listed in noisy_images.txt)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
