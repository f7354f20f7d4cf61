"""Image bytes -> uint8 pixels, and uint8 pixels -> the [-1, 1] floats every backbone takes."""

from __future__ import annotations

import functools
import io
import logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from shardface.dataset.errors import ImageDecodeError
from shardface.errors import ConfigError

if TYPE_CHECKING:
    import torch

# every format Pillow reads that people keep photos in; the file's bytes decide the decoder
IMAGE_EXTENSIONS = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".pgm",
    ".ppm",
    ".pbm",
    ".pnm",
    ".tif",
    ".tiff",
    ".webp",
    ".gif",
)
FACE_SIZE = (112, 112)  # (height, width) every backbone takes: insightface's aligned crops
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
            cls.scratch = (
                os.fdopen(os.memfd_create("shardface-stderr"), "w+b")
                if hasattr(os, "memfd_create")
                else tempfile.TemporaryFile()
            )
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
    import torch  # here: the photo tools' workers decode with PIL and import no torch

    if images.dtype == torch.uint8:
        return images.float().sub_(127.5).div_(127.5)
    return images


def to_rgb(img: Image.Image, where: str = "image") -> Image.Image:
    """The one conversion of every Pillow mode to 8-bit RGB (the first frame of a multi-frame
    file):
    - 16-bit grayscale (I;16, I;16B, I;16L, and I, which is read as 0..65535 and clipped there)
      is scaled to 8 bits by round(v / 257), so 65535 -> 255; Pillow's own convert saturates it
      to white;
    - float F is clipped to [0, 255] and rounded; a NaN pixel has no defined value, so such an
      image is refused (ImageDecodeError naming `where`), never silently made black there;
    - transparency (RGBA, LA, PA, P or L with a transparent colour) is composited on black:
      transparent pixels become what alignment's warp puts outside a photo (zeros);
    - 1-bit, L, P, CMYK, YCbCr, LAB, HSV: Pillow's convert("RGB") (CMYK without ICC profile).
    """
    if img.mode == "RGB":
        return img
    if img.mode.startswith("I") or img.mode == "F":
        values = np.asarray(img, dtype=np.float64)
        if img.mode == "F":
            nans = int(np.isnan(values).sum())
            if nans:
                raise ImageDecodeError(
                    f"{where}: float image with {nans} NaN pixel(s) of {values.size}: "
                    f"they have no defined value; fix or remove the image"
                )
            gray = np.clip(values, 0, 255)
        else:
            gray = np.clip(values, 0, 65535) / 257.0
        return Image.fromarray(np.rint(gray).astype(np.uint8), "L").convert("RGB")
    if img.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in img.info:
        rgba = np.asarray(img.convert("RGBA"), dtype=np.float64)
        rgb = rgba[..., :3] * (rgba[..., 3:] / 255.0)
        return Image.fromarray(np.rint(rgb).astype(np.uint8), "RGB")
    return img.convert("RGB")


def resize_face(img: Image.Image, size: tuple[int, int] = FACE_SIZE) -> Image.Image:
    """Bilinear resize to (height, width) `size`: the one resize of `--resize`/`resize`."""
    h, w = size
    return img if img.size == (w, h) else img.resize((w, h), Image.BILINEAR)


def read_image_file(path: str) -> bytes:
    """An image file's bytes; a file that cannot be read is an ImageDecodeError naming it."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot read image ({exc.strerror or exc})") from None


def stored_bytes(path: str, resize: bool = False) -> bytes:
    """The bytes a packed set or a .bin keeps of an image file: the file's own, or with `resize`
    a 112x112 PNG of an image of another size (lossless: no second compression). The image is
    decoded here, whole: one that does not decode (a truncated JPEG passes a header check) is
    an ImageDecodeError naming the file, not a record that fails later in training."""
    with open(path, "rb") as f:
        data = f.read()
    chw = decode_chw(data, path)
    if resize and tuple(chw.shape[1:]) != FACE_SIZE:
        buf = io.BytesIO()
        resize_face(Image.fromarray(chw.permute(1, 2, 0).numpy(), "RGB")).save(buf, format="PNG")
        data = buf.getvalue()
    return data


def decode_image(
    data: bytes, where: str, mirror: bool = False, resize: tuple[int, int] | None = None
) -> np.ndarray:
    """Any image PIL reads -> HxWx3 uint8 (for `transform`s written for arcface_torch), converted
    by `to_rgb`; resized to (height, width) `resize` when given."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img = to_rgb(img, where)
            if resize is not None:
                img = resize_face(img, resize)
            if mirror:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
            return np.array(img)
    except ImageDecodeError:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data
        raise ImageDecodeError(f"{where}: cannot decode image ({exc})") from None


def image_size(data_or_path, where: str) -> tuple[int, int]:
    """(height, width) from the image's header alone (nothing decoded: fast on many files)."""
    try:
        src = io.BytesIO(data_or_path) if isinstance(data_or_path, (bytes, bytearray)) else data_or_path
        with Image.open(src) as img:
            return img.height, img.width
    except FileNotFoundError:
        raise ImageDecodeError(f"{where}: image file not found") from None
    except Exception as exc:  # unknown format, truncated header, unreadable file
        raise ImageDecodeError(f"{where}: cannot read image ({exc})") from None


@functools.cache
def jpeg_decoder():
    """torchvision's JPEG decoder (RGB out), imported at first use: torchvision's import takes
    about as long as torch's own, which a process that decodes no JPEG (a tool's --help, its
    errors, `plan`, `export_onnx`) need not pay. Loaders call it before forking their workers. A
    torchvision built for another torch is a ConfigError saying so in one line."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except (RuntimeError, ImportError, OSError) as exc:  # "operator torchvision::nms does not exist"
        import importlib.metadata

        import torch

        try:
            theirs = importlib.metadata.version("torchvision")
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(
                "torchvision is not installed: install the one built for this torch (make setup)"
            ) from None
        raise ConfigError(
            f"torch {torch.__version__} and torchvision {theirs} are different builds ({str(exc).splitlines()[0]}); "
            "install a matching pair (make setup)"
        ) from None
    return functools.partial(decode_jpeg, mode=ImageReadMode.RGB)


def check_torchvision() -> None:
    """`make setup`'s check: the one line of `jpeg_decoder`'s refusal, exit 1."""
    try:
        jpeg_decoder()
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None


def decode_chw(
    data: bytes, where: str, mirror: bool = False, resize: tuple[int, int] | None = None
) -> torch.Tensor:
    """-> 3xHxW uint8. JPEGs go through torchvision's libjpeg-turbo decoder (faster than
    PIL, same pixels, an error on truncated data); anything else through PIL. A JPEG whose body
    is damaged but decodable (libjpeg's "Corrupt JPEG data") is used, as every JPEG reader
    does, with a warning naming `where`. With `resize`, an image of another size goes through
    PIL's `resize_face` (one resize, whichever decoder)."""
    import torch

    if data[:2] == b"\xff\xd8":
        try:
            chw, said = _Stderr.run(jpeg_decoder(), torch.frombuffer(bytearray(data), dtype=torch.uint8))
        except RuntimeError as exc:
            said = str(exc).splitlines()[-1]  # "decode_jpeg, <source file>:<line>, <reason>": the reason
            raise ImageDecodeError(f"{where}: cannot decode image ({said.rsplit(', ', 1)[-1]})") from None
        if said:
            _report(said.decode(errors="replace"), where)
        if resize is None or tuple(chw.shape[1:]) == tuple(resize):
            return chw.flip(2) if mirror else chw
    return torch.from_numpy(decode_image(data, where, mirror, resize)).permute(2, 0, 1)


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
