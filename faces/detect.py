"""Faces in a photo: boxes from dlib's HOG detector (default) or its CNN (MMOD) detector, and five
landmarks per face in insightface's order (left eye centre, right eye centre, nose tip, left mouth
corner, right mouth corner; "left" is the photo's left) from dlib's landmark predictors.

`detect_faces(image)` -> [Face], largest first; `Detection` names how (the tools' face options).
Models load once per process; dlib's must not run in two threads at once, so a lock makes threads (a web
server's pool) take turns. A photo larger than `max_side` is searched at that size (boxes and landmarks in
its pixels, landmarks found at full resolution): a 24-megapixel photo costs what a 1600-pixel one does.
`upsample` doubles the searched size that many times, for faces under 80 pixels (HOG) or about 40 (MMOD).

The 68-point model gives the five points directly, but its training data (iBUG 300-W) excludes
commercial use; the public-domain 5-point model gives eye corners and the nose base only
(docs/photos.md). From it the eye centres are the middles of each eye's corners, and the five
points are `[1, u, v] @ FROM_NOSE_BASE` for the nose base at (u, v) in the eyes' frame: origin
midway between the eye centres, x the vector from the left to the right eye centre, y that turned
90 degrees (down the face), so unchanged by the face's position, size and roll. The constants are
the least-squares fit to the 68-point model's five points on real faces, made by
`python benchmarks/faces.py --fit`; the data it was fitted on and what the substitution costs are in
benchmarks/README.md ('Faces')."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image, ImageOps

from shardface.dataset.errors import ImageDecodeError
from shardface.dataset.images import to_rgb
from shardface.faces.models import ModelFileError, model_file

DETECTORS = ("hog", "mmod")
LANDMARKS = {"5": "shape_predictor_5_face_landmarks.dat", "68": "shape_predictor_68_face_landmarks.dat"}
MAX_SIDE = 1600
# rows: 1, u, v of the nose base; columns: (u, v) of left eye, right eye, nose tip, left mouth
# corner, right mouth corner, in the eyes' frame (see the module docstring)
FROM_NOSE_BASE = np.array(
    [
        [-0.4847, -0.0167, 0.4859, -0.0010, 0.0311, -0.3216, -0.5111, 0.5141, 0.4476, 0.5469],
        [0.0555, -0.0164, 0.0693, 0.0060, 1.4250, 0.0278, 0.2093, 0.0454, 0.2218, -0.0088],
        [-0.0177, 0.0160, 0.0164, -0.0057, -0.0446, 1.1314, 0.0918, 0.7403, -0.0010, 0.6984],
    ]
)


@dataclass(frozen=True)
class Face:
    """One face: `box` (x0, y0, x1, y1) in photo pixels, `points` 5 x 2 (x, y) in insightface's order, `score`
    the detector's (HOG: SVM margin, MMOD: CNN score; > 0 kept), `shape` dlib's landmarks (5 or 68 x 2, its
    order: faces.dlib_chip cuts from them), `embedding` the model's unit row once embedded (infer.stream)."""

    box: tuple[float, float, float, float]
    points: np.ndarray
    score: float
    shape: np.ndarray | None = None
    embedding: np.ndarray | None = None

    @property
    def area(self) -> float:
        x0, y0, x1, y1 = self.box
        return max(0.0, x1 - x0) * max(0.0, y1 - y0)

    def to_dict(self) -> dict:
        """The face as JSON values: floats in full (repr), so `from_dict` gives it back bit for bit."""
        return {
            "box": [float(v) for v in self.box],
            "points": self.points.tolist(),
            "score": float(self.score),
            "shape": None if self.shape is None else self.shape.tolist(),
            "embedding": None if self.embedding is None else self.embedding.tolist(),
        }

    @classmethod
    def from_dict(cls, record: dict) -> "Face":
        shape, embedding = record.get("shape"), record.get("embedding")
        return cls(
            tuple(record["box"]),
            np.asarray(record["points"], np.float64),
            record["score"],
            None if shape is None else np.asarray(shape, np.float64),
            None if embedding is None else np.asarray(embedding, np.float32),
        )


def _dlib():
    try:
        import dlib
    except ImportError:
        raise ModelFileError(
            "dlib is not installed: install it with `make setup` (pip install dlib-bin)"
        ) from None
    return dlib


_DLIB_LOCK = threading.RLock()  # dlib's detectors and predictors are not thread-safe (dlib issues 340, 1149)
_FROM_PARENT: dict[str, object] = {}  # detectors a worker process was handed (Detection.worker_setup)


@functools.lru_cache(maxsize=None)
def face_detector(name: str):
    """dlib's detector `name` ("hog" or "mmod"), loaded once per process."""
    if name not in DETECTORS:
        raise ValueError(f"detector {name!r}: one of {', '.join(DETECTORS)}")
    dlib = _dlib()
    if name == "hog":
        return _FROM_PARENT.pop(name, None) or dlib.get_frontal_face_detector()
    return dlib.cnn_face_detection_model_v1(model_file("mmod_human_face_detector.dat"))


def use_models_from_parent(models: dict[str, object]) -> None:
    """In a worker process: take `Detection.worker_setup`'s detectors when they are first needed."""
    _FROM_PARENT.update(models)


@functools.lru_cache(maxsize=None)
def landmark_predictor(points: str):
    """dlib's 5- or 68-point landmark predictor, loaded once per process."""
    if points not in LANDMARKS:
        raise ValueError(f"landmarks {points!r}: one of {', '.join(LANDMARKS)}")
    return _dlib().shape_predictor(model_file(LANDMARKS[points]))


def check_available(detector: str = "hog", landmarks: str = "5") -> None:
    """Load what `detect_faces` will need now, so a missing model file is one line at start."""
    face_detector(detector)
    landmark_predictor(landmarks)


def _boxes(pixels: np.ndarray, detector: str, upsample: int) -> list[tuple[tuple[float, ...], float]]:
    found = face_detector(detector)
    if detector == "hog":
        rects, scores, _ = found.run(pixels, upsample, 0.0)
        return [((r.left(), r.top(), r.right(), r.bottom()), float(s)) for r, s in zip(rects, scores)]
    return [
        ((d.rect.left(), d.rect.top(), d.rect.right(), d.rect.bottom()), float(d.confidence))
        for d in found(pixels, upsample)
    ]


def detect_faces(
    img: Image.Image | np.ndarray,
    detector: str = "hog",
    upsample: int = 1,
    landmarks: str = "5",
    min_score: float = 0.0,
    max_side: int = MAX_SIDE,
) -> list[Face]:
    """The faces of a photo (PIL image of any mode, or H x W (x 3) uint8 array) scoring at least
    `min_score`, largest first; `landmarks` "68" is not for commercial use (module docstring)."""
    rgb = to_rgb(img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, np.uint8)))
    pixels = np.ascontiguousarray(np.asarray(rgb, np.uint8))
    scale = min(1.0, max_side / max(rgb.size))
    searched = (
        pixels
        if scale == 1.0
        else np.asarray(
            rgb.resize((max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))), Image.BILINEAR)
        )
    )
    landmark_predictor(landmarks)  # a missing model file is one error, faces or not
    with _DLIB_LOCK:
        found = _boxes(np.ascontiguousarray(searched), detector, upsample)
        faces = [
            face_in_box(pixels, tuple(float(v) / scale for v in box), score, landmarks)
            for box, score in found
            if score >= min_score
        ]
    return sorted(faces, key=lambda f: (-f.area, -f.score))


def face_in_box(pixels: np.ndarray, box: tuple[float, ...], score: float, landmarks: str = "5") -> Face:
    """The Face of a detector's `box` (x0, y0, x1, y1, photo pixels) in an H x W x 3 uint8 photo:
    dlib's shape found in it (the `landmarks` model) and insightface's five points from that."""
    with _DLIB_LOCK:
        shape = landmark_predictor(landmarks)(pixels, _dlib().rectangle(*(int(round(v)) for v in box)))
    parts = np.array([(p.x, p.y) for p in shape.parts()], np.float64)
    return Face(box, (five_from_dlib5 if landmarks == "5" else five_from_dlib68)(parts), score, parts)


@dataclass(frozen=True)
class Detection:
    """How faces are found: the detector, its upsampling, the landmark model, the score kept."""

    detector: str = "hog"
    upsample: int = 1
    landmarks: str = "5"
    min_score: float = 0.0
    max_side: int = MAX_SIDE

    def faces(self, img: Image.Image) -> list[Face]:
        return detect_faces(img, self.detector, self.upsample, self.landmarks, self.min_score, self.max_side)

    def worker_setup(self) -> Callable[[], None]:
        """Loads the models here (a missing file: one line at start); returns the setup of
        faces.workers.map_photos' workers: each takes this process's HOG detector (built in 1.5 s,
        unpickled from 155 KB in ms; the other models load from file as fast, or do not pickle)."""
        check_available(self.detector, self.landmarks)
        models = {"hog": face_detector("hog")} if self.detector == "hog" else {}
        return functools.partial(use_models_from_parent, models)


def load_photo(path: str) -> Image.Image:
    """The photo at `path` as RGB, turned by its EXIF (phones store portraits sideways); else an ImageDecodeError."""
    try:
        with Image.open(path) as img:
            return to_rgb(ImageOps.exif_transpose(img))
    except FileNotFoundError:
        raise ImageDecodeError(f"{path}: image file not found") from None
    except Exception as exc:  # PIL raises many types for corrupt data
        raise ImageDecodeError(f"{path}: cannot read image ({exc})") from None


def to_frame(points: np.ndarray, frame) -> np.ndarray:
    origin, x, y = frame
    d = np.asarray(points, np.float64) - origin
    return np.stack([d @ x, d @ y], -1) / (x @ x)


def from_frame(uv: np.ndarray, frame) -> np.ndarray:
    origin, x, y = frame
    uv = np.asarray(uv, np.float64)
    return origin + uv[..., :1] * x + uv[..., 1:] * y


def dlib5_frame_and_nose(parts: np.ndarray) -> tuple[tuple, np.ndarray]:
    """The eyes' frame (origin, x, y in photo pixels) of dlib's 5 points (the person's right eye's
    outer and inner corner, the left eye's, the nose base) and the nose base's (u, v) in it."""
    parts = np.asarray(parts, np.float64)
    left, right = parts[2:4].mean(0), parts[0:2].mean(0)
    x = right - left
    frame = ((left + right) / 2, x, np.array([-x[1], x[0]]))
    return frame, to_frame(parts[4], frame)


def five_from_dlib5(parts: np.ndarray) -> np.ndarray:
    """insightface's five points (5 x 2, photo pixels) from dlib's 5-point model's parts."""
    frame, (u, v) = dlib5_frame_and_nose(parts)
    return from_frame((np.array([1.0, u, v]) @ FROM_NOSE_BASE).reshape(5, 2), frame)


def five_from_dlib68(parts: np.ndarray) -> np.ndarray:
    """insightface's five points from dlib's 68 (iBUG numbering): the mean of each eye's six
    contour points, the nose tip (30) and the mouth corners (48, 54)."""
    parts = np.asarray(parts, np.float64)
    return np.stack([parts[36:42].mean(0), parts[42:48].mean(0), parts[30], parts[48], parts[54]])
