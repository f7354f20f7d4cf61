"""dlib's face chip (150x150, padding 0.25: what its descriptor was trained on) as templates of the one
alignment function, and `dlib_chip`: the chip exactly as dlib cuts it from its 5-point landmarks, pyramid too.

dlib places faces by a mean face shape in a unit square, padded on every side by `PADDING` times
its width. Its 5-point and 68-point mean shapes share that frame: `DLIB_150_SHAPE5` holds dlib's
five reference points (its 5-point predictor's order), `DLIB_150` insightface's five (for every
detector), taken from the 68-point shape."""

from __future__ import annotations

import numpy as np
from PIL import Image

from shardface.dataset.images import to_rgb
from shardface.faces.align import Template, similarity_transform, warp

SIZE, PADDING = 150, 0.25

# dlib's 5-point reference (get_face_chip_details): outer and inner corner of the eye on the
# image's right, outer and inner corner of the other eye, base of the nose; unit-square coords
_SHAPE5 = np.array(
    [
        [0.8595674595992, 0.2134981538014],
        [0.6460604764104, 0.2289674387677],
        [0.1205750620789, 0.2137274526848],
        [0.3340850613712, 0.2290642403242],
        [0.4901123135679, 0.6277975316475],
    ]
)
# dlib's 68-point mean face, the points insightface's five landmarks name: the contour of the
# eye on the image's left (36-41) and right (42-47), the nose tip (30), mouth corners (48, 54)
_LEFT_EYE = np.array(
    [
        [0.121737, 0.216423],
        [0.187122, 0.178758],
        [0.265825, 0.179852],
        [0.334606, 0.231733],
        [0.260918, 0.245099],
        [0.182743, 0.244077],
    ]
)
_RIGHT_EYE = np.array(
    [
        [0.645647, 0.231733],
        [0.714428, 0.179852],
        [0.793132, 0.178758],
        [0.858516, 0.216423],
        [0.79751, 0.244077],
        [0.719335, 0.245099],
    ]
)
_FIVE = np.array(
    [_LEFT_EYE.mean(0), _RIGHT_EYE.mean(0), [0.490127, 0.515625], [0.254149, 0.780233], [0.726104, 0.780233]]
)


def _placed(unit: np.ndarray, size: int = SIZE) -> np.ndarray:
    return (PADDING + unit) / (1 + 2 * PADDING) * size


DLIB_150 = Template("dlib-150", (SIZE, SIZE), _placed(_FIVE))
DLIB_150_SHAPE5 = Template("dlib-150-shape5", (SIZE, SIZE), _placed(_SHAPE5))


def _pyramid_down(rgb: np.ndarray) -> np.ndarray:
    """dlib's pyramid_down<2> of H x W x 3 uint8: the separable filter (1 4 6 4 1) / 16 on every other row
    and column (output (r, c) centred on input (2r + 2, 2c + 2)), integer sums divided by 256 rounding down."""
    a = rgb.astype(np.int32)
    rows, cols = (a.shape[0] - 3) // 2, (a.shape[1] - 3) // 2
    taps = (1, 4, 6, 4, 1)
    across = sum(k * a[:, j : j + 2 * cols : 2] for j, k in enumerate(taps))
    down = sum(k * across[i : i + 2 * rows : 2] for i, k in enumerate(taps))
    return (down // 256).astype(np.uint8)


def chip_transform(shape5: np.ndarray) -> np.ndarray:
    """2x3 chip pixel -> photo pixel of dlib's chip for its 5-point landmarks (pixel centres). dlib fits the
    similarity, then cuts through a rectangle whose corner pixels sit +-(size * scale - 1) / 2 from the image
    of the chip's centre (size/2, size/2): a scale of (size * scale - 1) / (size - 1) about pixel (size - 1) / 2."""
    return _to_photo(*_chip_frame(shape5, SIZE), SIZE)


def _to_photo(centre: np.ndarray, linear: np.ndarray, size: int) -> np.ndarray:
    """The 2x3 chip pixel -> photo pixel map of the linear map about the chip's centre pixel."""
    return np.hstack([linear, (centre - linear @ np.array([(size - 1) / 2] * 2))[:, None]])


def _chip_frame(shape5: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(photo point of the chip's centre, 2x2 chip -> photo linear map) of dlib's chip."""
    m = similarity_transform(_placed(_SHAPE5, size), shape5)
    scale = float(np.hypot(*m[:, 0]))
    centre = m[:, :2] @ np.array([size / 2, size / 2]) + m[:, 2]
    return centre, m[:, :2] / scale * (size * scale - 1) / (size - 1)


def dlib_chip(img: Image.Image, shape5: np.ndarray, size: int = SIZE) -> Image.Image:
    """dlib's chip (extract_image_chip of get_face_chip_details) for a 5-point shape in dlib's order,
    bilinear. While the face is over twice the chip's size, dlib halves the part of the photo around
    it with its image pyramid; so does this, with dlib's filter, crop and coordinates."""
    rgb = np.asarray(to_rgb(img))
    centre, linear = _chip_frame(np.asarray(shape5, np.float64), size)
    span = float(np.hypot(*linear[:, 0])) * (size - 1)  # the extraction rectangle's side, less one
    levels = 0
    while (span / 2 ** (levels + 1) + 1) ** 2 > size * size:
        levels += 1
    if levels:
        grow = 2.0 ** (levels + 2) - 2  # 2, then twice that plus 2 at each level
        rotation = linear / np.hypot(*linear[:, 0])
        corners = centre + np.array([[-1, -1], [1, -1], [-1, 1], [1, 1]]) * span / 2 @ rotation.T
        lo = np.maximum(np.floor(corners.min(0) - grow + 0.5), 0).astype(int)
        hi = np.minimum(np.floor(corners.max(0) + grow + 0.5), [rgb.shape[1] - 1, rgb.shape[0] - 1]).astype(
            int
        )
        rgb = rgb[lo[1] : hi[1] + 1, lo[0] : hi[0] + 1]
        centre = centre - lo
        for _ in range(levels):
            if min(rgb.shape[:2]) <= 8:  # dlib's pyramid leaves nothing of so small a part: a black chip
                return Image.new("RGB", (size, size))
            # dlib's offsets one level down
            rgb, centre = (
                _pyramid_down(rgb),
                centre / 2 - np.array([1.25, 0.75]),
            )
        linear = linear / 2**levels
    return warp(Image.fromarray(rgb), _to_photo(centre, linear, size), (size, size))
