"""Face recognition training sets: MXNet RecordIO, image folders and a synthetic stand-in."""
from __future__ import annotations

import io
import logging
import os

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg

from dataset.recordio import IndexedRecordReader, RecordIOError, unpack

logger = logging.getLogger("shardface")


def to_tensor(chw: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """3xHxW uint8 -> float in [-1, 1], or kept as uint8 when the batch is normalised later on
    the training device (`normalize_batch`), which is cheaper."""
    return chw.sub(127.5).div_(127.5) if normalize else chw


def normalize_batch(images: torch.Tensor) -> torch.Tensor:
    """uint8 batches from `normalize=False` datasets -> float in [-1, 1]; float batches pass."""
    if images.dtype == torch.uint8:
        return images.float().sub_(127.5).div_(127.5)
    return images


def mirror_for(seed: int, epoch: int, index: int) -> bool:
    """A fair coin fixed by (seed, epoch, index): the same flips whatever the worker count
    and across a mid-epoch resume (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return bool((z ^ (z >> 31)) & 1)


class _MirrorsInTraining:
    train: bool = True
    seed: int = 0
    epoch: int = 0

    def set_epoch(self, epoch: int, seed: int | None = None) -> None:
        self.epoch = epoch
        if seed is not None:
            self.seed = seed

    def mirror(self, index: int) -> bool:
        return self.train and mirror_for(self.seed, self.epoch, index)


def decode_image(data: bytes, where: str, mirror: bool = False) -> np.ndarray:
    """Any image PIL reads -> HxWx3 uint8 (for `transform`s written for arcface_torch)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.mode != "RGB":
                img = img.convert("RGB")
            if mirror:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            return np.array(img)
    except Exception as exc:  # PIL raises many types for corrupt data
        raise RecordIOError(f"{where}: cannot decode image ({exc})") from None


def decode_chw(data: bytes, where: str, mirror: bool = False) -> torch.Tensor:
    """-> 3xHxW uint8. JPEGs go through torchvision's libjpeg-turbo decoder (about twice
    PIL's speed, same pixels, an error on truncated data); anything else through PIL."""
    if data[:2] == b"\xff\xd8":
        try:
            chw = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError as exc:
            raise RecordIOError(f"{where}: cannot decode image ({str(exc).splitlines()[-1]})") from None
        return chw.flip(2) if mirror else chw
    return torch.from_numpy(decode_image(data, where, mirror)).permute(2, 0, 1)


def read_property(root_dir: str) -> tuple[int, int, int]:
    path = os.path.join(root_dir, "property")
    if not os.path.isfile(path):
        raise RecordIOError(f"{path}: property file not found (expected 'num_classes,112,112')")
    try:
        num_classes, h, w = (int(v) for v in open(path).read().strip().split(","))
    except ValueError:
        raise RecordIOError(f"{path}: expected 'num_classes,height,width'") from None
    return num_classes, h, w


class MXFaceDataset(_MirrorsInTraining, Dataset):
    """`root_dir/train.rec` + `train.idx` (+ `property`), as insightface arcface_torch.

    insightface layout: record 0's header has flag > 0 and its labels give the key range of
    images, keys 1 .. label[0]-1. im2rec layout (record 0 flag 0): every key is an image.
    Items are `(3x112x112 float tensor in [-1, 1], int64 label)`; training mirrors half the
    items, chosen by (seed, epoch, index) so workers and resumed runs see the same flips.
    `transform`, when given, receives the (mirrored) HxWx3 uint8 array instead and must return
    a tensor. `normalize=False` returns 3x112x112 uint8 instead of floats (see
    `normalize_batch`): the training loop normalises whole batches on its device.
    """

    def __init__(self, root_dir: str, transform=None, train: bool = True, num_classes: int | None = None,
                 skip_bad_images: bool = False, normalize: bool = True):
        self.root_dir, self.transform, self.train, self.normalize = root_dir, transform, train, normalize
        self.skip_bad_images = skip_bad_images
        self.reader = IndexedRecordReader(os.path.join(root_dir, "train.idx"),
                                          os.path.join(root_dir, "train.rec"))
        self.num_classes = num_classes if num_classes is not None else read_property(root_dir)[0]
        first = self.reader.keys[0] if self.reader.keys else 0
        header, _ = unpack(self.reader.read(first), f"{self.reader.rec_path} key {first}")
        if header.flag > 0:
            self.keys = list(range(1, int(np.asarray(header.label).ravel()[0])))
            missing = [k for k in (self.keys[:1] + self.keys[-1:]) if k not in self.reader.index]
            if missing:
                raise RecordIOError(f"{self.reader.idx_path}: header record announces images up to key "
                                    f"{self.keys[-1]}, but key {missing[0]} is not in the index")
        else:
            self.keys = list(self.reader.keys)
        self.bad_images = 0
        self._labels: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def load(self, index: int, mirror: bool = False, as_array: bool = False):
        """(image, label): 3xHxW uint8 tensor, or HxWx3 array when `as_array`."""
        key = self.keys[index]
        header, payload = unpack(self.reader.read(key), f"{self.reader.rec_path} key {key}")
        label = int(header.label) if header.flag == 0 else int(header.label[0])
        if not 0 <= label < self.num_classes:
            raise RecordIOError(f"{self.reader.rec_path} key {key}: label {label} outside [0, {self.num_classes}) "
                                f"(num_classes from {os.path.join(self.root_dir, 'property')} or config)")
        decode = decode_image if as_array else decode_chw
        return decode(payload, f"{self.reader.rec_path} key {key}", mirror), label

    def __getitem__(self, index: int):
        flip = self.mirror(index)
        for attempt in range(len(self)):
            try:
                image, label = self.load((index + attempt) % len(self), flip, as_array=self.transform is not None)
                break
            except RecordIOError as exc:
                if not (self.skip_bad_images and "cannot decode" in str(exc)):
                    raise
                self.bad_images += 1
                logger.warning("skipping undecodable image (%d so far in this worker): %s", self.bad_images, exc)
        image = self.transform(image) if self.transform is not None else to_tensor(image, self.normalize)
        return image, self._label_tensor(label)

    def _label_tensor(self, label: int) -> torch.Tensor:
        # one shared tensor per label: batches copy them, nobody writes to them
        t = self._labels.get(label)
        if t is None:
            t = self._labels[label] = torch.tensor(label, dtype=torch.long)
        return t


class FolderFaceDataset(_MirrorsInTraining, Dataset):
    """One sub-folder per identity (sorted names -> labels 0..C-1), as torchvision ImageFolder."""

    EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")

    def __init__(self, root_dir: str, train: bool = True, normalize: bool = True):
        self.train, self.normalize = train, normalize
        self.classes = sorted(d for d in os.listdir(root_dir) if os.path.isdir(os.path.join(root_dir, d)))
        if not self.classes:
            raise RecordIOError(f"{root_dir}: no identity sub-folders and no train.rec")
        self.samples = [(os.path.join(root_dir, c, f), label) for label, c in enumerate(self.classes)
                        for f in sorted(os.listdir(os.path.join(root_dir, c)))
                        if f.lower().endswith(self.EXTENSIONS)]
        self.num_classes = len(self.classes)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        with open(path, "rb") as f:
            chw = decode_chw(f.read(), path, self.mirror(index))
        return to_tensor(chw, self.normalize), torch.tensor(label, dtype=torch.long)


class SyntheticFaceDataset(Dataset):
    """arcface_torch's 'synthetic' source: one fixed random image, for throughput tests."""

    def __init__(self, num_classes: int, length: int = 1_000_000):
        g = torch.Generator().manual_seed(0)
        self.image = torch.rand(3, 112, 112, generator=g).mul_(2).sub_(1)
        self.num_classes, self.length = num_classes, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.image, torch.tensor(index % self.num_classes, dtype=torch.long)


def build_dataset(rec: str, num_classes: int, train: bool = True, skip_bad_images: bool = False,
                  normalize: bool = True) -> Dataset:
    """Choose the source from `cfg.rec`: "synthetic", a RecordIO dir, or an image folder.
    `normalize=False` yields uint8 images for `normalize_batch` on the training device."""
    if rec == "synthetic":
        return SyntheticFaceDataset(num_classes)
    if not os.path.isdir(rec):
        raise RecordIOError(f"{rec}: data directory not found")
    if os.path.isfile(os.path.join(rec, "train.rec")):
        dataset = MXFaceDataset(rec, train=train, skip_bad_images=skip_bad_images, normalize=normalize)
        if dataset.num_classes != num_classes:
            raise RecordIOError(f"{os.path.join(rec, 'property')}: {dataset.num_classes} classes, "
                                f"config num_classes is {num_classes}")
        return dataset
    dataset = FolderFaceDataset(rec, train=train, normalize=normalize)
    if dataset.num_classes != num_classes:
        raise RecordIOError(f"{rec}: {dataset.num_classes} identity folders, config num_classes is {num_classes}")
    return dataset
