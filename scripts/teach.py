#!/usr/bin/env python
"""Precompute a teacher's embeddings for distillation: `python -m scripts.teach TEACHER DATA OUT`.

TEACHER: any MODEL the tools take (run or checkpoint directory, model.pt of ShardFace or
arcface_torch with --network, .onnx, dlib). DATA: a packed set (train.rec/train.idx) or an image
folder, as `rec` in training. OUT: the teacher file (distill/teacher_file.py describes it): one fp16
row per record, the L2-normalised sum of the record's and its mirror image's embeddings, with
the data set's fingerprint and how its images were read. The data is read as the run reads it
(builders.build_train_dataset, unaugmented): give the run's `--resize`, or `--align` (with its
`--align_detector`, `--align_strict`). Train with `--teacher OUT`; a file made from other data,
or from the same data read otherwise, is refused. An existing OUT is replaced only with
`--overwrite`, and never when it is one of the files teach reads."""

from __future__ import annotations

import os
import sys

from easydict import EasyDict

from shardface.builders import build_train_dataset
from shardface.configs.base import config as BASE
from shardface.dataset.errors import DataLayoutError
from shardface.dataset.folders import list_images
from shardface.distill.teacher import OnlineTeacher
from shardface.distill.teacher_file import data_transform, write_teacher_file
from shardface.faces.align import ARCFACE_112
from shardface.infer.model import model_files, tool_device
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import add_model_options, device_from, model_from
from shardface.utils.outputs import check_output_file, refuse_inputs

PACKED = ("train.rec", "train.idx", "property")


def data_config(args) -> EasyDict:
    """The run's data keys as teach was given them (base defaults for the rest): the set is read
    label-free (num_classes 0; a teacher needs no labels), so a packed set's labels are not read
    and a folder is every image under it, which for identity sub-folders is their order in
    training too (dataset.folders.list_images): one file serves a run with identities and a
    label-free one."""
    return EasyDict(
        {
            **BASE,
            "rec": args.data,
            "num_classes": 0,
            "align": args.align,
            "align_detector": args.align_detector,
            "align_strict": args.align_strict,
            "resize": args.resize,
            "skip_bad_images": False,
        }
    )


def data_files(path: str) -> list[str]:
    """Every file reading the data set at `path` opens (from its listing: nothing is decoded)."""
    if not os.path.isdir(path):
        raise DataLayoutError(f"{path}: data directory not found")
    if os.path.isfile(os.path.join(path, "train.rec")):
        return [os.path.join(path, name) for name in PACKED]
    return list_images(path)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p, what="TEACHER")
    p.add_argument("data", help="packed set (train.rec) or image folder, as the run's rec")
    p.add_argument("out", help="the teacher file to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--num_workers", type=int, default=2, help="image-decoding worker processes")
    p.add_argument(
        "--resize", action="store_true", help="as the run's resize true: images not 112x112 resized"
    )
    p.add_argument(
        "--align",
        action="store_true",
        help="as the run's align true: DATA is a folder of photos, "
        "each read as its largest face aligned to 112x112",
    )
    p.add_argument(
        "--align_detector",
        default=BASE.align_detector,
        choices=("hog", "mmod"),
        help="as the run's align_detector: with --align, dlib's face detector (default hog)",
    )
    p.add_argument(
        "--align_strict",
        action="store_true",
        help="as the run's align_strict: with --align, refuse photos without a face",
    )
    args = p.parse_args(argv)
    # the output rule (utils.atomic), before any work: its kind and place, --overwrite, no input
    check_output_file(args.out, overwrite=args.overwrite, what="OUT")
    refuse_inputs([args.out], [*model_files(args.model), *data_files(args.data)])
    cfg = data_config(args)
    data = build_train_dataset(cfg, train=False, normalize=False)  # as the run reads it, unaugmented
    device = device_from(args) or tool_device()  # --device, else the current GPU where there is one
    precision = None if args.precision == "fp32" else args.precision  # fp16/bf16: on a GPU only (model_from)
    teacher = OnlineTeacher(model_from(args, device=device), device, precision, made_for=ARCFACE_112)
    header = {
        "data": os.path.abspath(args.data),
        "data_fingerprint": data.fingerprint(),
        "transform": data_transform(cfg),
    }
    write_teacher_file(teacher, data, header, args.out, args.batch_size, args.num_workers)
    print(f"wrote {args.out} ({len(data)} x {teacher.dim} float16, teacher {args.model})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
