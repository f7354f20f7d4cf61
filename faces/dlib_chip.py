"""dlib's face chip (150x150, padding 0.25: what its face descriptor was trained on) as
templates of the one alignment function, and the chip exactly as dlib cuts it from its own
5-point landmarks.

dlib places faces with a mean face shape in a unit square, padded on every side by `padding`
times its width: (padding + p) / (1 + 2 * padding) * size. Its 5-point chip uses the shape's
eye corners and nose base; its 68-point mean shape is in the same frame, so the points
insightface's five landmarks name (eye centres, nose tip, mouth corners) have a place in the
same chip: `DLIB_150` (insightface's order, for every detector) is built from those;
`DLIB_150_SHAPE5` holds dlib's own five reference points, in its 5-point predictor's order."""
from __future__ import annotations

import numpy as np
from PIL import Image

from dataset.images import to_rgb
from faces.align import Template, similarity_transform

SIZE, PADDING = 150, 0.25

# dlib's 5-point reference (get_face_chip_details): outer and inner corner of the eye on the
# image's right, outer and inner corner of the other eye, base of the nose; unit-square coords
_SHAPE5 = np.array([[0.8595674595992, 0.2134981538014], [0.6460604764104, 0.2289674387677],
                    [0.1205750620789, 0.2137274526848], [0.3340850613712, 0.2290642403242],
                    [0.4901123135679, 0.6277975316475]])
# dlib's 68-point mean face, the points insightface's five landmarks name: the contour of the
# eye on the image's left (36-41) and right (42-47), the nose tip (30), mouth corners (48, 54)
_LEFT_EYE = np.array([[0.121737, 0.216423], [0.187122, 0.178758], [0.265825, 0.179852],
                      [0.334606, 0.231733], [0.260918, 0.245099], [0.182743, 0.244077]])
_RIGHT_EYE = np.array([[0.645647, 0.231733], [0.714428, 0.179852], [0.793132, 0.178758],
                       [0.858516, 0.216423], [0.79751, 0.244077], [0.719335, 0.245099]])
_FIVE = np.array([_LEFT_EYE.mean(0), _RIGHT_EYE.mean(0), [0.490127, 0.515625],
                  [0.254149, 0.780233], [0.726104, 0.780233]])


def _placed(unit: np.ndarray, size: int = SIZE, padding: float = PADDING) -> np.ndarray:
    return (padding + unit) / (1 + 2 * padding) * size


DLIB_150 = Template("dlib-150", (SIZE, SIZE), _placed(_FIVE))
DLIB_150_SHAPE5 = Template("dlib-150-shape5", (SIZE, SIZE), _placed(_SHAPE5))


def chip_transform(shape5: np.ndarray, size: int = SIZE, padding: float = PADDING) -> np.ndarray:
    """2x3 chip pixel -> photo pixel of dlib's chip for its 5-point landmarks (pixel centres).
    dlib fits the similarity, then cuts the chip through a rectangle whose corner pixels sit
    at +-(size * scale - 1) / 2 from the image of the chip's centre point (size/2, size/2):
    a scale of (size * scale - 1) / (size - 1) about pixel (size - 1) / 2, which this repeats."""
    m = similarity_transform(_placed(_SHAPE5, size, padding), shape5)
    scale = float(np.hypot(*m[:, 0]))
    rotation = m[:, :2] / scale
    centre = m[:, :2] @ np.array([size / 2, size / 2]) + m[:, 2]
    linear = rotation * (size * scale - 1) / (size - 1)
    return np.hstack([linear, (centre - linear @ np.array([(size - 1) / 2] * 2))[:, None]])


def dlib_chip(img: Image.Image, shape5: np.ndarray, size: int = SIZE, padding: float = PADDING) -> Image.Image:
    """dlib's face chip (extract_image_chip of get_face_chip_details) for a 5-point shape in
    dlib's order, bilinear. dlib first halves the photo with its image pyramid when the chip is
    more than 2x smaller than the face; this does not, so faces over ~300 pixels wide differ
    slightly (cut them from a photo scaled down first)."""
    to_image = chip_transform(np.asarray(shape5, np.float64), size, padding)
    # Pillow's affine transform works in continuous coordinates (pixel i's centre at i + 0.5)
    to_image[:, 2] += 0.5 - to_image[:, :2].sum(1) * 0.5
    return to_rgb(img).transform((size, size), Image.AFFINE, to_image.ravel().tolist(), Image.BILINEAR)
