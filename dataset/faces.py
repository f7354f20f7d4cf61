"""Face recognition training sets: MXNet RecordIO, image folders, and arcface_torch's
"synthetic" throughput stand-in."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch
from torch.utils.data import Dataset

from shardface.dataset.errors import DataLayoutError, ImageDecodeError, ImageSizeError, LabelError
from shardface.dataset.fingerprint import folder_fingerprint, recordio_fingerprint, synthetic_fingerprint
from shardface.dataset.folders import list_identity_folders, list_images
from shardface.dataset.geometry import check_files, check_records
from shardface.dataset.images import FACE_SIZE, decode_chw, decode_image, normalize_images, read_image_file
from shardface.dataset.layout import class_count, image_keys
from shardface.dataset.pack import recover_rec_set
from shardface.dataset.recordio import IndexedRecordReader, unpack

logger = logging.getLogger("shardface")


def mirror_for(seed: int, epoch: int, index: int) -> bool:
    """A fair coin fixed by (seed, epoch, index): the same flips whatever the worker count
    and across a mid-epoch resume (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return bool((z ^ (z >> 31)) & 1)


class SkipCounter:
    """Images skipped, counted across DataLoader worker processes: a shared-memory tensor
    with one slot per worker, so no two processes write the same slot."""

    SLOTS = 64

    def __init__(self):
        self.counts = torch.zeros(self.SLOTS + 1, dtype=torch.int64).share_memory_()

    def add(self) -> None:
        info = torch.utils.data.get_worker_info()
        self.counts[self.SLOTS if info is None else info.id % self.SLOTS] += 1

    def total(self) -> int:
        return int(self.counts.sum())


class _MirrorsInTraining:
    """Every training set has `set_epoch` (its mirroring is fixed by (seed, epoch, index))
    and `skipped`, the SkipCounter of images it skipped."""

    train: bool = True
    seed: int = 0
    epoch: int = 0

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        self.epoch = epoch
        if seed is not None:
            self.seed = seed

    def mirror(self, index: int) -> bool:
        return self.train and mirror_for(self.seed, self.epoch, index)

    resize: bool = False  # resize images that are not 112x112 instead of refusing them
    skip_bad_images: bool = False

    @property
    def bad_images(self) -> int:
        """Images skipped so far by this process and its loader workers."""
        return self.skipped.total()

    def _first_readable(self, index: int, load):
        """`load(index)`, or with `skip_bad_images` the next index that decodes (counted)."""
        for attempt in range(len(self)):
            try:
                return load((index + attempt) % len(self))
            except ImageDecodeError as exc:
                if not self.skip_bad_images:
                    raise
                self.skipped.add()
                logger.warning("skipping undecodable image: %s", exc)
        raise ImageDecodeError("no image of the data set decodes")

    def _decoded(self, decode, data: bytes, where: str, mirror: bool):
        """Decoded at 112x112: resized when asked, else another size is an ImageSizeError
        naming `where` (a record the check at start did not sample)."""
        image = decode(data, where, mirror, FACE_SIZE if self.resize else None)
        hw = tuple(image.shape[:2] if isinstance(image, np.ndarray) else image.shape[1:])
        if hw != FACE_SIZE:
            raise ImageSizeError(
                f"{where}: image is {hw[1]}x{hw[0]}, not {FACE_SIZE[1]}x{FACE_SIZE[0]}; "
                "repack with `python -m scripts.pack_rec SRC OUT --resize` or train with "
                "`--resize true`"
            )
        return image


def read_property(root_dir: str) -> tuple[int, int, int]:
    path = os.path.join(root_dir, "property")
    if not os.path.isfile(path):
        raise DataLayoutError(f"{path}: property file not found (expected 'num_classes,112,112')")
    try:
        with open(path, encoding="utf-8-sig") as f:  # an editor's BOM is not part of num_classes
            num_classes, h, w = (int(v) for v in f.read().strip().split(","))
    except (ValueError, UnicodeDecodeError):
        raise DataLayoutError(f"{path}: expected 'num_classes,height,width'") from None
    return num_classes, h, w


class MXFaceDataset(_MirrorsInTraining, Dataset):
    """`root_dir/train.rec` + `train.idx` (+ `property`), as insightface arcface_torch.

    insightface layout: record 0 is a header whose labels give the key range of images, keys
    1 .. label[0]-1; im2rec layout: every key is an image (dataset/layout.py tells them apart).
    Items are `(3x112x112 float tensor in [-1, 1], int64 label)`; training mirrors half the
    items, chosen by (seed, epoch, index) so workers and resumed runs see the same flips.
    `transform`, when given, receives the (mirrored) HxWx3 uint8 array instead and must return
    a tensor. `normalize=False` returns 3x112x112 uint8 instead of floats (see
    `normalize_images`): the training loop normalises whole batches on its device.
    `label_free`: the records' labels are ignored (every item's label is 0; no class count needed).
    """

    def __init__(
        self,
        root_dir: str,
        transform=None,
        train: bool = True,
        num_classes: int | None = None,
        skip_bad_images: bool = False,
        normalize: bool = True,
        resize: bool = False,
        label_free: bool = False,
    ):
        self.root_dir = root_dir
        self.transform = transform
        self.train = train
        self.normalize = normalize
        self.resize = resize
        self.skip_bad_images = skip_bad_images
        self.reader = IndexedRecordReader(
            os.path.join(root_dir, "train.idx"), os.path.join(root_dir, "train.rec")
        )
        if not self.reader.keys:
            raise DataLayoutError(f"{self.reader.idx_path}: no records; the data set is empty")
        prop = os.path.join(root_dir, "property")
        declared = read_property(root_dir)[0] if os.path.isfile(prop) else None
        self.keys = image_keys(self.reader, prop, declared)
        # the set's own count (property, or an insightface header), and where it came from
        self.own_classes, self.classes_from = class_count(self.reader, self.keys, prop, declared)
        self.label_free = label_free
        if label_free:
            num_classes = 0
        elif num_classes is None and self.own_classes is None:
            raise DataLayoutError(
                f"{prop}: property file not found, and {self.reader.rec_path} has no insightface "
                f"header (key 0) that counts the identities: set num_classes in the config"
            )
        self.num_classes = num_classes if num_classes is not None else self.own_classes
        if self.own_classes is None:
            self.classes_from = "config num_classes"
        self.skipped = SkipCounter()
        self._labels: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def fingerprint(self) -> str:
        """Which samples the indices name (dataset/fingerprint.py): checkpoints record it."""
        return recordio_fingerprint(self.reader, self.keys)

    def load(self, index: int, mirror: bool = False, as_array: bool = False):
        """(image, label): 3xHxW uint8 tensor, or HxWx3 array when `as_array`."""
        key = self.keys[index]
        header, payload = unpack(self.reader.read(key), f"{self.reader.rec_path} key {key}")
        label = 0 if self.label_free else int(header.label) if header.flag == 0 else int(header.label[0])
        if not self.label_free and not 0 <= label < self.num_classes:
            raise LabelError(
                f"{self.reader.rec_path} key {key}: label {label} outside [0, {self.num_classes}) "
                f"(num_classes from {self.classes_from})"
            )
        decode = decode_image if as_array else decode_chw
        return self._decoded(decode, payload, f"{self.reader.rec_path} key {key}", mirror), label

    def check_geometry(self) -> None:
        """At start: `property`'s height and width and a sample of records are 112x112 (see
        dataset.geometry.check_records)."""
        path = os.path.join(self.root_dir, "property")
        hw = read_property(self.root_dir)[1:] if os.path.isfile(path) else FACE_SIZE

        def payload(key: int) -> bytes:
            return unpack(self.reader.read(key), f"{self.reader.rec_path} key {key}")[1]

        check_records(payload, self.keys, self.reader.rec_path, path, hw, self.resize, self.skip_bad_images)

    def __getitem__(self, index: int):
        flip = self.mirror(index)
        image, label = self._first_readable(
            index, lambda i: self.load(i, flip, as_array=self.transform is not None)
        )
        image = self.transform(image) if self.transform is not None else self._pixels(image)
        return image, self._label_tensor(label)

    def _pixels(self, chw: torch.Tensor) -> torch.Tensor:
        return normalize_images(chw) if self.normalize else chw

    def _label_tensor(self, label: int) -> torch.Tensor:
        # one shared tensor per label: batches copy them, nobody writes to them
        t = self._labels.get(label)
        if t is None:
            t = self._labels[label] = torch.tensor(label, dtype=torch.long)
        return t


class FolderFaceDataset(_MirrorsInTraining, Dataset):
    """One sub-folder per identity (sorted names -> labels 0..C-1), as torchvision ImageFolder;
    `label_free`: every image under the folder at any depth (`list_images`), label 0 for all.
    At start every file's header is read: unreadable files are errors (left out with
    `skip_bad_images`), and images that are not 112x112 are refused unless `resize`."""

    def __init__(
        self,
        root_dir: str,
        train: bool = True,
        normalize: bool = True,
        skip_bad_images: bool = False,
        resize: bool = False,
        label_free: bool = False,
    ):
        self.train = train
        self.normalize = normalize
        self.skip_bad_images = skip_bad_images
        self.resize = resize
        self.classes, groups = (
            ([], [list_images(root_dir)]) if label_free else list_identity_folders(root_dir)
        )
        usable = set(check_files((p for g in groups for p in g), resize, skip_bad_images))
        self.samples = [
            (path, label) for label, paths in enumerate(groups) for path in paths if path in usable
        ]
        if not self.samples:
            raise DataLayoutError(f"{root_dir}: no readable images")
        self.num_classes = len(self.classes)
        self.skipped = SkipCounter()

    def __len__(self) -> int:
        return len(self.samples)

    def fingerprint(self) -> str:
        """Which images the indices name, by name and content (dataset/fingerprint.py): read once."""
        if getattr(self, "_fingerprint", None) is None:
            self._fingerprint = folder_fingerprint([path for path, _ in self.samples])
        return self._fingerprint

    def load(self, index: int, mirror: bool = False):
        path, label = self.samples[index]
        return self._decoded(decode_chw, read_image_file(path), path, mirror), label

    def __getitem__(self, index: int):
        flip = self.mirror(index)
        chw, label = self._first_readable(index, lambda i: self.load(i, flip))
        return (normalize_images(chw) if self.normalize else chw), torch.tensor(label, dtype=torch.long)


class SyntheticDataset(_MirrorsInTraining, Dataset):
    """arcface_torch's `rec = "synthetic"`: one fixed random image, for throughput tests.
    (Not the demo's drawn faces: those are a real RecordIO set, see dataset/drawn_faces.py.)"""

    def __init__(self, num_classes: int, length: int = 1_000_000):
        g = torch.Generator().manual_seed(0)
        self.image = torch.rand(3, 112, 112, generator=g).mul_(2).sub_(1)
        self.num_classes, self.length = num_classes, length
        self.skipped = SkipCounter()  # one valid image: nothing to skip

    def __len__(self) -> int:
        return self.length

    def fingerprint(self) -> str:
        return synthetic_fingerprint(self.length, self.num_classes)

    def __getitem__(self, index: int):
        return self.image, torch.tensor(index % self.num_classes if self.num_classes else 0, dtype=torch.long)


def build_dataset(
    rec: str,
    num_classes: int,
    train: bool = True,
    skip_bad_images: bool = False,
    normalize: bool = True,
    resize: bool = False,
) -> Dataset:
    """Choose the source from `cfg.rec`: "synthetic", a RecordIO dir, or an image folder.
    `normalize=False` yields uint8 images for `normalize_images` on the training device.
    Images that are not 112x112 are refused here, before training, unless `resize`.
    `num_classes` 0: label-free (labels ignored; a folder is every image under it, label 0)."""
    if rec == "synthetic":
        return SyntheticDataset(num_classes)
    if not os.path.isdir(rec):
        raise DataLayoutError(f"{rec}: data directory not found")
    if os.path.isfile(os.path.join(rec, "train.rec")):
        idx = os.path.join(rec, "train.idx")
        if not os.path.exists(idx):  # pack_rec publishes train.idx last (utils.atomic)
            try:
                restored = recover_rec_set(rec)
            except OSError as e:
                raise DataLayoutError(
                    f"{idx}: missing beside train.rec, and the earlier set journaled by the "
                    f"pack_rec that stopped while replacing it could not be put back ({e})"
                ) from None
            if not restored:
                raise DataLayoutError(
                    f"{idx}: missing beside train.rec, so the set is incomplete (a pack_rec "
                    f"stopped while replacing the set leaves it so): pack the set again"
                )
            logger.warning(
                "%s: a pack_rec stopped while replacing this set; the earlier set was put back", rec
            )
        dataset = MXFaceDataset(
            rec,
            train=train,
            num_classes=num_classes,
            skip_bad_images=skip_bad_images,
            normalize=normalize,
            resize=resize,
            label_free=num_classes == 0,
        )
        if num_classes == 0:
            logger.info("%s: label-free (num_classes 0), its labels are not read", rec)
        elif dataset.own_classes is not None and dataset.own_classes != num_classes:
            raise DataLayoutError(
                f"{dataset.classes_from}: {dataset.own_classes} classes, config num_classes is {num_classes}"
            )
        elif dataset.classes_from != os.path.join(rec, "property"):
            logger.info("%s: %d classes, from the %s", rec, num_classes, dataset.classes_from)
        dataset.check_geometry()
        return dataset
    dataset = FolderFaceDataset(
        rec,
        train=train,
        normalize=normalize,
        skip_bad_images=skip_bad_images,
        resize=resize,
        label_free=num_classes == 0,
    )
    if num_classes and dataset.num_classes != num_classes:
        raise DataLayoutError(
            f"{rec}: {dataset.num_classes} identity folders, config num_classes is {num_classes}"
        )
    return dataset
