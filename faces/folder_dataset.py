"""Training on a folder of raw photos (`--align true`): the faces are found once, at start, and
each item is its photo's largest face warped onto the 112x112 template when it is read."""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from torch.utils.data import Dataset

from dataset.errors import DataLayoutError
from dataset.faces import FolderFaceDataset, SkipCounter
from dataset.folders import list_identity_folders, list_images
from faces.align import ARCFACE_112
from faces.detect import Detection
from faces.photos import align_groups
from faces.stream import Crop, stream
from faces.workers import default_workers
from utils.progress import Progress

logger = logging.getLogger("shardface")


class AlignedFolderDataset(FolderFaceDataset):
    """One sub-folder of photos per identity (labels as FolderFaceDataset; `label_free`: every
    photo under the folder, label 0). At start every photo is searched for faces (with progress, on
    every core; on every rank, so for large folders run scripts.align once and train on its output instead);
    photos without a face are left out and named, or refused with `strict`. Items are 3x112x112 crops of each photo's largest face, aligned by
    the five-point similarity transform, mirrored as every training set mirrors."""

    def __init__(self, root_dir: str, train: bool = True, normalize: bool = True, detection: Detection = Detection(),
                 strict: bool = False, label_free: bool = False):
        self.train, self.normalize, self.skip_bad_images, self.resize = train, normalize, False, False
        self.classes, groups = ([], [list_images(root_dir)]) if label_free else list_identity_folders(root_dir)
        total = sum(len(g) for g in groups)
        groups, self.faces = align_groups(groups, detection, strict, Progress(total, "finding faces").update,
                                          self.classes or [root_dir], default_workers())
        self.samples = [(path, label) for label, paths in enumerate(groups) for path in paths]
        if not self.samples:
            raise DataLayoutError(f"{root_dir}: no photo with a face")
        self.template = ARCFACE_112
        self.num_classes = len(self.classes)
        self.skipped = SkipCounter()

    def load(self, index: int, mirror: bool = False):
        path, label = self.samples[index]
        (photo,) = stream([path], faces=[[self.faces[path]]], cut=Crop(self.template))
        pixels = photo.cuts[0][:, ::-1] if mirror else photo.cuts[0]
        return torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous(), label  # a writable copy


def build_aligned_dataset(rec: str, num_classes: int, detector: str = "hog", train: bool = True,
                          normalize: bool = True, strict: bool = False) -> Dataset:
    """The AlignedFolderDataset of the image folder `rec` (a RecordIO set holds crops already:
    refused), checked against `num_classes` (0: label-free, every photo under the folder)."""
    if not os.path.isdir(rec) or os.path.isfile(os.path.join(rec, "train.rec")):
        raise DataLayoutError(f"{rec}: align true needs an image folder of photos (one sub-folder per "
                              "identity); a RecordIO set holds aligned crops already")
    dataset = AlignedFolderDataset(rec, train=train, normalize=normalize, detection=Detection(detector), strict=strict,
                                   label_free=num_classes == 0)
    if num_classes and dataset.num_classes != num_classes:
        raise DataLayoutError(f"{rec}: {dataset.num_classes} identity folders, config num_classes is {num_classes}")
    return dataset
