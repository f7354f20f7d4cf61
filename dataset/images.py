"""Image bytes -> uint8 pixels, and uint8 pixels -> the [-1, 1] floats every backbone takes."""
from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from dataset.errors import ImageDecodeError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")


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
    PIL, same pixels, an error on truncated data); anything else through PIL."""
    if data[:2] == b"\xff\xd8":
        try:
            chw = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        except RuntimeError as exc:
            raise ImageDecodeError(f"{where}: cannot decode image ({str(exc).splitlines()[-1]})") from None
        return chw.flip(2) if mirror else chw
    return torch.from_numpy(decode_image(data, where, mirror)).permute(2, 0, 1)
