#!/usr/bin/env python
"""Precompute a teacher's embeddings for distillation: `python -m scripts.teach TEACHER DATA OUT`.

TEACHER: any MODEL the tools take (run or checkpoint directory, model.pt of ShardFace or
arcface_torch with --network, .onnx, dlib). DATA: a packed set (train.rec/train.idx) or an image
folder, as `rec` in training. OUT: the teacher file (eval/teacher.py describes it): one fp16
row per record, the L2-normalised sum of the record's and its mirror image's embeddings, with
the data set's fingerprint and how its images were read. The data is read as the run reads it
(builders.build_train_dataset, unaugmented): give the run's `--resize`, or `--align` (with its
`--align_detector`, `--align_strict`). Train with `--teacher OUT`; a file made from other data,
or from the same data read otherwise, is refused. An existing OUT is replaced only with
`--overwrite`, and never when it is one of the files teach reads."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

import numpy as np
import torch
from easydict import EasyDict
from torch.utils.data import DataLoader

from builders import build_train_dataset
from configs.base import config as BASE
from dataset.errors import DataLayoutError
from dataset.folders import list_images
from eval.embedder import load_embedder, model_files, tool_device
from eval.teacher import FORMAT, OnlineTeacher, data_transform, header_bytes
from faces.align import ARCFACE_112
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from utils.atomic import check_output_file, publishing, refuse_inputs
from utils.checkpoint import CheckpointError
from utils.progress import Progress

PACKED = ("train.rec", "train.idx", "property")


def data_config(args) -> EasyDict:
    """The run's data keys as teach was given them (base defaults for the rest): the set is read
    label-free (num_classes 0; a teacher needs no labels), so a packed set's labels are not read
    and a folder is every image under it, which for identity sub-folders is their order in
    training too (dataset.folders.list_images): one file serves a run with identities and a
    label-free one."""
    return EasyDict({**BASE, "rec": args.data, "num_classes": 0, "align": args.align,
                     "align_detector": args.align_detector, "align_strict": args.align_strict,
                     "resize": args.resize, "skip_bad_images": False})


def data_files(path: str) -> list[str]:
    """Every file reading the data set at `path` opens (from its listing: nothing is decoded)."""
    if not os.path.isdir(path):
        raise DataLayoutError(f"{path}: data directory not found")
    if os.path.isfile(os.path.join(path, "train.rec")):
        return [os.path.join(path, name) for name in PACKED]
    return list_images(path)


@torch.no_grad()
def write_teacher_file(teacher: OnlineTeacher, data, header: dict, out: str, batch_size: int = 64,
                       num_workers: int = 2) -> None:
    """Every record's row, written to a temporary file beside `out`, then published. A record
    whose row is not finite stops it, naming the record: the file is never written."""
    header = {**header, "format": FORMAT, "data_size": len(data), "dim": teacher.dim, "teacher": teacher.name,
              "teacher_fingerprint": teacher.embedder.fingerprint, "template": teacher.embedder.template.name,
              "rows": "L2-normalised embedding of the record plus its mirror image's, float16"}
    progress = Progress(len(data), "teaching") if len(data) > batch_size else None
    done = 0
    with publishing(out) as tmp, open(tmp, "wb") as f:  # utils.atomic: staged, fsynced, replaced
        f.write(header_bytes(header))
        for images, _ in DataLoader(data, batch_size=batch_size, num_workers=num_workers):
            both = teacher.targets(images, None) + teacher.targets(images.flip(3), None)
            rows = torch.nn.functional.normalize(both, dim=1).cpu().numpy().astype("<f2")
            bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
            if len(bad):
                raise CheckpointError(f"teacher {teacher.name}: its embedding of record {done + int(bad[0])} of "
                                      f"{header['data']} is not finite (NaN or inf); the teacher's output is unusable")
            f.write(rows.tobytes())
            done += len(images)
            if progress is not None:
                progress.update(len(images))


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("teacher", help="MODEL: run output, checkpoint dir, model.pt, .onnx or dlib")
    p.add_argument("data", help="packed set (train.rec) or image folder, as the run's rec")
    p.add_argument("out", help="the teacher file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--network", default=None, help="backbone name for an arcface_torch model.pt teacher")
    p.add_argument("--batch_size", type=int, default=64, help="images per forward pass")
    p.add_argument("--num_workers", type=int, default=2, help="image-decoding worker processes")
    p.add_argument("--resize", action="store_true", help="as the run's resize true: images not 112x112 resized")
    p.add_argument("--align", action="store_true", help="as the run's align true: DATA is a folder of photos, "
                                                        "each read as its largest face aligned to 112x112")
    p.add_argument("--align_detector", default=BASE.align_detector, choices=("hog", "mmod"),
                   help="as the run's align_detector: with --align, dlib's face detector (default hog)")
    p.add_argument("--align_strict", action="store_true",
                   help="as the run's align_strict: with --align, refuse photos without a face")
    args = p.parse_args(argv)
    # the output rule (utils.atomic), before any work: its kind and place, --overwrite, no input
    check_output_file(args.out, overwrite=args.overwrite, what="OUT")
    refuse_inputs([args.out], [*model_files(args.teacher), *data_files(args.data)])
    cfg = data_config(args)
    data = build_train_dataset(cfg, train=False, normalize=False)  # as the run reads it, unaugmented
    device = tool_device()  # the current GPU where there is one, explicitly
    teacher = OnlineTeacher(load_embedder(args.teacher, args.network), device, made_for=ARCFACE_112)
    header = {"data": os.path.abspath(args.data), "data_fingerprint": data.fingerprint(),
              "transform": data_transform(cfg)}
    write_teacher_file(teacher, data, header, args.out, args.batch_size, args.num_workers)
    print(f"wrote {args.out} ({len(data)} x {teacher.dim} float16, teacher {args.teacher})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
