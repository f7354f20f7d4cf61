"""The one alignment function: the least-squares similarity transform mapping five landmarks (left eye,
right eye, nose tip, left and right mouth corner; image pixels) onto a template's, and the crop it warps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from shardface.dataset.images import to_rgb


@dataclass(frozen=True)
class Template:
    """Where a network wants the five landmarks in its input crop of `size` (height, width)."""

    name: str
    size: tuple[int, int]
    points: np.ndarray  # 5 x 2, (x, y) in crop pixels

    def scaled(self, side: int) -> "Template":
        """The same template on a square crop of `side` pixels."""
        factor = side / self.size[1]
        return Template(self.name, (round(self.size[0] * factor), side), self.points * factor)


# insightface's 112x112 ArcFace template (the crops of MS1M, Glint360K, WebFace and the .bin sets).
ARCFACE_112 = Template(
    "arcface-112",
    (112, 112),
    np.array(
        [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]],
        dtype=np.float64,
    ),
)


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """2x3 matrix of the least-squares similarity (rotation, scale, shift) mapping src -> dst. In
    the plane, points as complex numbers, it is z -> a z + t, and the least-squares `a` of the
    centred points is their inner product over the source's squared norm (Umeyama's result)."""
    s, d = (np.asarray(p, np.float64) @ np.array([1, 1j]) for p in (src, dst))
    a = np.vdot(s - s.mean(), d - d.mean()) / np.vdot(s - s.mean(), s - s.mean())
    t = d.mean() - a * s.mean()
    return np.array([[a.real, -a.imag, t.real], [a.imag, a.real, t.imag]])


def warp(img: Image.Image, to_image: np.ndarray, size: tuple[int, int]) -> Image.Image:
    """The crop of (h, w) `size` whose pixel p is the photo's at `to_image` @ (p, 1) (2x3; bilinear; black outside)."""
    # Coordinates name pixel centres (as detectors, insightface and OpenCV do); Pillow's
    # transform works in continuous coordinates, where pixel i's centre is at i + 0.5.
    m = np.array(to_image, np.float64)
    m[:, 2] += 0.5 - m[:, :2].sum(1) * 0.5
    return img.transform(size[::-1], Image.AFFINE, m.ravel().tolist(), Image.BILINEAR)


def align(img: Image.Image, landmarks: np.ndarray, template: Template = ARCFACE_112) -> Image.Image:
    """The RGB crop of `template.size` in which the five landmarks land on the template's points."""
    return warp(to_rgb(img), similarity_transform(template.points, landmarks), template.size)
