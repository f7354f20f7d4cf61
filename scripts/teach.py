#!/usr/bin/env python
"""Precompute a teacher's embeddings for distillation: `python -m scripts.teach TEACHER DATA OUT`.

TEACHER: any MODEL the tools take (run or checkpoint directory, model.pt of ShardFace or
arcface_torch with --network, .onnx, dlib). DATA: a packed set (train.rec/train.idx) or an image
folder, as `rec` in training. OUT: the teacher file (eval/teacher.py describes it): one fp16
row per record, the L2-normalised sum of the record's and its mirror image's embeddings, with
the data set's fingerprint. Train with `--teacher OUT`; another data set's file is refused."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader

from configs.errors import ConfigError
from dataset import FolderFaceDataset, MXFaceDataset
from dataset.errors import DataLayoutError
from eval.embedder import load_embedder
from eval.teacher import OnlineTeacher, header_bytes
from faces.align import ARCFACE_112
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from utils.atomic import publishing
from utils.progress import Progress


def open_data(path: str, resize: bool):
    """The training set at `path` in record order, unmirrored uint8, read label-free (a teacher
    needs no labels): a packed set's labels are not read, and a folder is every image under it,
    which for identity sub-folders is their order in training too (dataset.folders.list_images).
    So one file serves a run with identities and a label-free one (num_classes 0)."""
    if not os.path.isdir(path):
        raise DataLayoutError(f"{path}: data directory not found")
    if os.path.isfile(os.path.join(path, "train.rec")):
        data = MXFaceDataset(path, train=False, normalize=False, resize=resize, label_free=True)
        data.check_geometry()
        return data
    return FolderFaceDataset(path, train=False, normalize=False, resize=resize, label_free=True)


@torch.no_grad()
def write_teacher_file(teacher: OnlineTeacher, data, data_path: str, out: str, batch_size: int = 64,
                       num_workers: int = 2) -> None:
    """Every record's row, written to a temporary file beside `out`, then published."""
    header = {"format": 1, "data": os.path.abspath(data_path), "data_fingerprint": data.fingerprint(),
              "data_size": len(data), "dim": teacher.dim, "teacher": teacher.name,
              "teacher_fingerprint": teacher.embedder.fingerprint, "template": teacher.embedder.template.name,
              "rows": "L2-normalised embedding of the record plus its mirror image's, float16"}
    progress = Progress(len(data), "teaching") if len(data) > batch_size else None
    with publishing(out) as tmp, open(tmp, "wb") as f:  # utils.atomic: staged, fsynced, replaced
        f.write(header_bytes(header))
        for images, _ in DataLoader(data, batch_size=batch_size, num_workers=num_workers):
            both = teacher.targets(images, None) + teacher.targets(images.flip(3), None)
            rows = torch.nn.functional.normalize(both, dim=1).cpu().numpy().astype("<f2")
            f.write(rows.tobytes())
            if progress is not None:
                progress.update(len(images))


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("teacher", help="MODEL: run output, checkpoint dir, model.pt, .onnx or dlib")
    p.add_argument("data", help="packed set (train.rec) or image folder, as the run's rec")
    p.add_argument("out", help="the teacher file to write")
    p.add_argument("--network", default=None, help="backbone name for an arcface_torch model.pt teacher")
    p.add_argument("--batch_size", type=int, default=64, help="images per forward pass")
    p.add_argument("--num_workers", type=int, default=2, help="image-decoding worker processes")
    p.add_argument("--resize", action="store_true", help="as training's --resize: images not 112x112 resized")
    args = p.parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise ConfigError(f"{out_dir}: output directory not found")
    if os.path.abspath(args.out) in (os.path.abspath(args.teacher), os.path.abspath(args.data)):
        raise ConfigError(f"{args.out}: the output is also an input")
    data = open_data(args.data, args.resize)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher = OnlineTeacher(load_embedder(args.teacher, args.network), device, made_for=ARCFACE_112)
    write_teacher_file(teacher, data, args.data, args.out, args.batch_size, args.num_workers)
    print(f"wrote {args.out} ({len(data)} x {teacher.dim} float16, teacher {args.teacher})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
