"""Training on a folder of raw photos (`--align true`): each item is its photo's largest face,
found once at start (builders.build_aligned_dataset, through faces/), cut when it is read."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from shardface.dataset.errors import DataLayoutError
from shardface.dataset.faces import FolderFaceDataset, SkipCounter


class AlignedFolderDataset(FolderFaceDataset):
    """Photos in identity groups (labels as FolderFaceDataset's; `classes` [] where label-free),
    each item `cut(path, faces[path])`: the photo's face aligned, H x W x 3 uint8, mirrored as
    every training set mirrors. `cut` is picklable: the loader's workers cut the faces."""

    def __init__(
        self,
        root_dir: str,
        classes: list[str],
        groups: list[list[str]],
        faces: dict,
        cut: Callable,
        train: bool = True,
        normalize: bool = True,
    ):
        self.train = train
        self.normalize = normalize
        self.skip_bad_images = False
        self.resize = False
        self.classes, self.faces, self.cut = classes, faces, cut
        self.samples = [(path, label) for label, paths in enumerate(groups) for path in paths]
        if not self.samples:
            raise DataLayoutError(f"{root_dir}: no photo with a face")
        self.num_classes = len(classes)
        self.skipped = SkipCounter()

    def load(self, index: int, mirror: bool = False):
        path, label = self.samples[index]
        pixels = self.cut(path, self.faces[path])
        pixels = pixels[:, ::-1] if mirror else pixels
        return torch.from_numpy(np.array(pixels)).permute(2, 0, 1).contiguous(), label  # a writable copy
