"""Faces in a photo: boxes from dlib's HOG detector (default) or its CNN (MMOD) detector, five
landmarks per face in insightface's order, and the aligned crops of a photo.

`detect_faces(image)` -> [Face], largest first; `Detection` names how (the tools' face options).
Detectors and landmark predictors are loaded once per process and kept; dlib's must not run in
two threads at once, so a lock lets threads (a web server's pool) call in turn. A photo larger than
`max_side` pixels is searched at that size (boxes and landmarks come back in the photo's own
pixels, the landmarks found on the full-resolution photo), so a 24-megapixel photo costs what a
1600-pixel one does; `upsample` doubles the searched size that many times, for faces smaller
than the detectors' 80 pixels (HOG) or about 40 (MMOD)."""
from __future__ import annotations

import functools
import pickle
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image, ImageOps

from dataset.errors import ImageDecodeError
from dataset.images import to_rgb
from faces.landmarks import five_from_dlib5, five_from_dlib68
from faces.models import ModelFileError, model_file

DETECTORS = ("hog", "mmod")
LANDMARKS = {"5": "shape_predictor_5_face_landmarks.dat", "68": "shape_predictor_68_face_landmarks.dat"}
MAX_SIDE = 1600


@dataclass(frozen=True)
class Face:
    """One face: `box` (x0, y0, x1, y1) in photo pixels, `points` 5 x 2 (x, y) in insightface's
    order (left eye, right eye, nose tip, left mouth corner, right mouth corner, "left" being the
    photo's left), `score` the detector's confidence (HOG: SVM margin, MMOD: CNN score; > 0 kept),
    `shape` dlib's own landmarks in its predictor's order (5 or 68 x 2), from which dlib cuts its
    face chip (faces.dlib_chip), and `embedding` the model's unit row, where one embedded it
    (infer.stream)."""
    box: tuple[float, float, float, float]
    points: np.ndarray
    score: float
    shape: np.ndarray | None = None
    embedding: np.ndarray | None = None

    @property
    def area(self) -> float:
        x0, y0, x1, y1 = self.box
        return max(0.0, x1 - x0) * max(0.0, y1 - y0)


def _dlib():
    try:
        import dlib
    except ImportError:
        raise ModelFileError("dlib is not installed: install it with `make setup` (pip install dlib-bin)") from None
    return dlib


_DLIB_LOCK = threading.Lock()  # dlib's detectors and predictors are not thread-safe (dlib issues 340, 1149)
_FROM_PARENT: dict[str, bytes] = {}  # detectors a worker process was handed, pickled (see models_for_workers)


@functools.lru_cache(maxsize=None)
def face_detector(name: str):
    """dlib's detector `name` ("hog" or "mmod"), loaded once per process."""
    if name not in DETECTORS:
        raise ValueError(f"detector {name!r}: one of {', '.join(DETECTORS)}")
    dlib = _dlib()
    if name == "hog":
        handed = _FROM_PARENT.pop(name, None)
        return pickle.loads(handed) if handed is not None else dlib.get_frontal_face_detector()
    return dlib.cnn_face_detection_model_v1(model_file("mmod_human_face_detector.dat"))


def models_for_workers(detector: str | None) -> dict[str, bytes]:
    """What a worker process takes from this one to start faster: dlib's HOG detector, pickled
    (building it takes 1.5 s, unpickling its 155 KB a few ms; the landmark models and MMOD load
    from their files as fast as they unpickle, or do not pickle). Empty unless `detector` is hog."""
    return {"hog": pickle.dumps(face_detector("hog"))} if detector == "hog" else {}


def use_models_from_parent(models: dict[str, bytes]) -> None:
    """In a worker process: take `models_for_workers`' detectors when they are first needed."""
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
    return [((d.rect.left(), d.rect.top(), d.rect.right(), d.rect.bottom()), float(d.confidence))
            for d in found(pixels, upsample)]


def detect_faces(img: Image.Image | np.ndarray, detector: str = "hog", upsample: int = 1,
                 landmarks: str = "5", min_score: float = 0.0, max_side: int = MAX_SIDE) -> list[Face]:
    """The faces of a photo (PIL image of any mode, or H x W (x 3) uint8 array), largest first:
    `detector` "hog" or "mmod", `landmarks` "5" (public domain) or "68" (iBUG 300-W: not for
    commercial use), detections scoring below `min_score` dropped."""
    rgb = to_rgb(img if isinstance(img, Image.Image) else Image.fromarray(np.asarray(img, np.uint8)))
    pixels = np.ascontiguousarray(np.asarray(rgb, np.uint8))
    scale = min(1.0, max_side / max(rgb.size))
    searched = pixels if scale == 1.0 else np.asarray(rgb.resize(
        (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))), Image.BILINEAR))
    dlib, predictor = _dlib(), landmark_predictor(landmarks)
    derive = five_from_dlib5 if landmarks == "5" else five_from_dlib68
    faces = []
    with _DLIB_LOCK:
        for box, score in _boxes(np.ascontiguousarray(searched), detector, upsample):
            if score < min_score:
                continue
            box = tuple(float(v) / scale for v in box)
            rect = dlib.rectangle(*(int(round(v)) for v in box))
            shape = predictor(pixels, rect)
            parts = np.array([(p.x, p.y) for p in shape.parts()], np.float64)
            faces.append(Face(box, derive(parts), score, parts))
    return sorted(faces, key=lambda f: (-f.area, -f.score))


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

    def check(self) -> None:
        """Load the models now, so that a missing model file is one line at start."""
        check_available(self.detector, self.landmarks)

    def worker_setup(self) -> Callable[[], None]:
        """For faces.workers.map_photos: each worker takes this process's detector instead of
        building it again."""
        return functools.partial(use_models_from_parent, models_for_workers(self.detector))


def load_photo(path: str) -> Image.Image:
    """The photo at `path` as RGB, EXIF rotation applied (phones store portraits sideways); an
    unreadable file is an ImageDecodeError naming it."""
    try:
        with Image.open(path) as img:
            return to_rgb(ImageOps.exif_transpose(img))
    except FileNotFoundError:
        raise ImageDecodeError(f"{path}: image file not found") from None
    except Exception as exc:  # PIL raises many types for corrupt data
        raise ImageDecodeError(f"{path}: cannot read image ({exc})") from None
