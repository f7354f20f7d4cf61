"""Image bytes -> uint8 pixels, and uint8 pixels -> the [-1, 1] floats every backbone takes."""
from __future__ import annotations

import io
import logging
import os
import sys
import tempfile

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from dataset.errors import ImageDecodeError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
logger = logging.getLogger("shardface")


class _Stderr:
    """Catches what C code writes to file descriptor 2 while a block runs (libjpeg prints
    "Corrupt JPEG data: ..." there and decodes anyway, so the message never names the image).
    One scratch file per process: DataLoader workers are forked and must not share it."""
    pid = -1
    scratch = None
    saved = -1

    @classmethod
    def _open(cls):
        if cls.pid != os.getpid():
            cls.scratch = (os.fdopen(os.memfd_create("shardface-stderr"), "w+b") if hasattr(os, "memfd_create")
                           else tempfile.TemporaryFile())
            cls.saved, cls.pid = os.dup(2), os.getpid()

    @classmethod
    def run(cls, fn, *args):
        """-> (fn(*args), bytes written to fd 2 meanwhile)."""
        cls._open()
        sys.stderr.flush()
        os.dup2(cls.scratch.fileno(), 2)
        try:
            out = fn(*args)
        finally:
            os.dup2(cls.saved, 2)
        fd = cls.scratch.fileno()
        if os.fstat(fd).st_size == 0:
            return out, b""
        written = os.pread(fd, os.fstat(fd).st_size, 0)
        os.ftruncate(fd, 0)
        return out, written


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 images (any shape) -> float32 in [-1, 1], (x - 127.5) / 127.5 as arcface_torch;
    float images are taken as already normalised and returned unchanged."""
    if images.dtype == torch.uint8:
        return images.float().sub_(127.5).div_(127.5)
    return images


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
        raise ImageDecodeError(f"{where}: cannot decode image ({exc})") from None


def decode_chw(data: bytes, where: str, mirror: bool = False) -> torch.Tensor:
    """-> 3xHxW uint8. JPEGs go through torchvision's libjpeg-turbo decoder (faster than
    PIL, same pixels, an error on truncated data); anything else through PIL. A JPEG whose body
    is damaged but decodable (libjpeg's "Corrupt JPEG data") is used, as every JPEG reader
    does, with a warning naming `where`."""
    if data[:2] == b"\xff\xd8":
        try:
            chw, said = _Stderr.run(decode_jpeg, torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                    ImageReadMode.RGB)
        except RuntimeError as exc:
            raise ImageDecodeError(f"{where}: cannot decode image ({str(exc).splitlines()[-1]})") from None
        if said:
            _report(said.decode(errors="replace"), where)
        return chw.flip(2) if mirror else chw
    return torch.from_numpy(decode_image(data, where, mirror)).permute(2, 0, 1)


def _report(said: str, where: str) -> None:
    """libjpeg's lines become one warning naming the image; anything else another thread
    wrote to fd 2 meanwhile goes on to stderr unchanged."""
    lines = said.splitlines()
    jpeg = [ln for ln in lines if "JPEG" in ln]
    other = [ln for ln in lines if "JPEG" not in ln]
    if jpeg:
        logger.warning("%s: damaged JPEG data, decoded anyway (%s)", where, "; ".join(jpeg))
    if other:
        sys.stderr.write("\n".join(other) + "\n")
