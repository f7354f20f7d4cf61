"""The model files of face-recognition-models (dlib's detectors, landmark predictors and face
descriptor), found on disk without importing that package: its `__init__` imports
`pkg_resources`, which a fresh virtual environment may lack."""

from __future__ import annotations

import importlib.util
import os

from shardface.errors import ModelError

PACKAGE = "face_recognition_models"
INSTALL_HINT = "install it with `make setup` (pip install face-recognition-models)"

# file name -> what it is, its licence as the package's authors state it
FILES = {
    "mmod_human_face_detector.dat": "dlib's CNN (MMOD) face detector",
    "shape_predictor_5_face_landmarks.dat": "dlib's 5-point landmark predictor",
    "shape_predictor_68_face_landmarks.dat": "dlib's 68-point landmark predictor (iBUG 300-W data: "
    "not for commercial use)",
    "dlib_face_recognition_resnet_model_v1.dat": "dlib's 128-D ResNet face descriptor",
}


class ModelFileError(ModelError, FileNotFoundError):
    """A model file that is missing or unreadable."""


def models_dir() -> str:
    """The folder holding face-recognition-models' `.dat` files."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"the package {PACKAGE} is not installed: {INSTALL_HINT}")
    return os.path.join(list(spec.submodule_search_locations)[0], "models")


def model_file(name: str) -> str:
    """The path of one of FILES, checked to exist and be non-empty."""
    if name not in FILES:
        raise ModelFileError(f"{name}: not one of {PACKAGE}'s model files ({', '.join(sorted(FILES))})")
    path = os.path.join(models_dir(), name)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        raise ModelFileError(f"{path}: {FILES[name]} not found or empty: {INSTALL_HINT}")
    return path
