"""The one way from a photo to an embedding: photo -> faces -> crops -> embeddings, for the
Python API (`Model.faces`, `Model.embed`), every tool's `--align`, the gallery and the teacher.

A photo is a path, a PIL image or an H x W x 3 uint8 RGB array, as a user has them. Faces are
found by faces.detect under the model's `Detection`; each is cut to the model's crop by
`Model.crop` (dlib's own chip for MODEL `dlib`, the five-point alignment otherwise); crops are
embedded a batch at a time by infer.embed. Inputs that are files already cropped for the model
(no alignment) are read at the model's template size, or refused by name before any work."""
from __future__ import annotations

import functools
import os
from typing import Callable, Iterator

import numpy as np
import torch
from PIL import Image

from dataset.errors import DataError, DataLayoutError
from dataset.folders import not_regular, regular_file, walk_images
from dataset.geometry import check_files
from dataset.images import IMAGE_EXTENSIONS, decode_chw, to_rgb
from faces.detect import Face, check_available
from faces.photos import Detection, Found, load_photo
from faces.workers import map_photos
from infer.model import Cropper, Model, as_model
from utils.progress import Progress


def image_files(inputs: list[str]) -> list[str]:
    """Image files and the images under folders (recursively, sorted), in the order given."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(walk_images(item))  # links followed, hidden folders skipped (named)
            if not found:
                raise DataLayoutError(f"{item}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            odd = not_regular(found)  # a FIFO named like an image would block the read forever
            if odd is not None:
                raise odd
            files.extend(found)
        elif regular_file(item):
            files.append(item)
        elif os.path.exists(item):
            raise DataLayoutError(f"{item}: not a regular file (a FIFO, socket or device); only image files are read")
        else:
            raise DataLayoutError(f"{item}: no such image file or folder")
    return files


def photo_name(photo, index: int = 0) -> str:
    """How messages name a photo: its path, or its place in the list given."""
    return photo if isinstance(photo, (str, os.PathLike)) else f"photo {index} ({type(photo).__name__})"


def open_image(photo, index: int = 0) -> Image.Image:
    """A photo (path, PIL image, H x W x 3 or H x W uint8 array) as an RGB PIL image; anything
    else is a DataError naming it."""
    if isinstance(photo, (str, os.PathLike)):
        return load_photo(os.fspath(photo))
    if isinstance(photo, Image.Image):
        return to_rgb(photo)
    if isinstance(photo, np.ndarray):
        if photo.dtype != np.uint8 or photo.ndim not in (2, 3) or (photo.ndim == 3 and photo.shape[2] != 3):
            raise DataError(f"{photo_name(photo, index)}: an array photo must be H x W x 3 (RGB) or H x W uint8, "
                            f"got {photo.dtype} of shape {photo.shape}")
        return to_rgb(Image.fromarray(photo))
    raise DataError(f"{photo_name(photo, index)}: a photo is a file path, a PIL image or a uint8 array")


def faces_in(photo, detection: Detection = Detection(), index: int = 0) -> list[Face]:
    """The faces of one photo, largest first."""
    check_available(detection.detector, detection.landmarks)
    return detection.faces(open_image(photo, index))


def face_crop(model: Model, image: Image.Image, face: Face) -> torch.Tensor:
    """The face's crop for `model` out of the RGB photo `image`, 3 x h x w uint8."""
    return chw(model.crop(image, face))


def chw(image: Image.Image | np.ndarray) -> torch.Tensor:
    """An RGB PIL image (or H x W x 3 uint8 array) as a 3 x h x w uint8 tensor."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()  # np.array: writable, torch shares it


def crop_files(paths: list[str], model: Model, resize: bool = False) -> None:
    """Refuse, from their headers, files that are not crops of the model's size (unless `resize`)."""
    check_files(paths, resize, size=tuple(model.template.size))


def file_crop(model: Model, path: str, resize: bool = False) -> torch.Tensor:
    """A file taken as a crop already aligned for `model` (resized to its size with `resize`)."""
    with open(path, "rb") as f:
        return decode_chw(f.read(), path, resize=tuple(model.template.size) if resize else None)


def embed_files(paths: list[str], model, batch_size: int = 64, resize: bool = False,
                show_progress: bool = True, flip: bool = True, faces: dict[str, Face] | None = None) -> np.ndarray:
    """Embeddings of image files, one row per path, read a batch at a time. Without `faces` the
    files are crops of the model's template size: every file's header is read first, and images
    of another size are refused (unless `resize`) before any is embedded. With `faces` (path ->
    Face, from faces.photos.find_faces) they are photos of any size, each cut to the model's crop
    as its batch is read. A bare module is taken for a 112x112 insightface-crop network."""
    model = as_model(model)
    if faces is None:
        crop_files(paths, model, resize)

    def load(path: str) -> torch.Tensor:
        return face_crop(model, load_photo(path), faces[path]) if faces is not None else file_crop(model, path, resize)

    progress = Progress(len(paths), "embedding") if show_progress and len(paths) > batch_size else None
    out = []
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        out.append(model.embed_crops(torch.stack([load(p) for p in chunk]), flip=flip, batch_size=batch_size))
        if progress is not None:
            progress.update(len(chunk))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def image_crops(model: Model, image: Image.Image, align: bool, name: str,
                largest_only: bool = False) -> list[torch.Tensor]:
    """The crops of one RGB photo for `model`, 3 x h x w uint8: its faces' (the largest only, or
    every one, largest first) with `align`; without, the photo itself as one crop (of the model's size, else a DataError naming
    it as `name`)."""
    if align:
        faces = model.detection.faces(image)
        return [face_crop(model, image, face) for face in (faces[:1] if largest_only else faces)]
    if tuple(image.size[::-1]) != tuple(model.template.size):
        h, w = model.template.size
        raise DataError(f"{name}: a {image.size[0]}x{image.size[1]} image is not a {w}x{h} crop aligned for "
                        f"{model.name}; pass align=True to find and align its face")
    return [chw(image)]


def embed_photos(model: Model, photos: list, align: bool = True, flip: bool = True,
                 batch_size: int = 64) -> np.ndarray:
    """The Python API's embedding (`Model.embed`): one row per photo, its largest face with
    `align` (a photo without a face is refused, naming it), else the photo as a crop."""
    if align:
        check_available(model.detection.detector, model.detection.landmarks)
    crops = []
    for i, photo in enumerate(photos):
        found = image_crops(model, open_image(photo, i), align, photo_name(photo, i), largest_only=True)
        if not found:
            raise DataError(f"{photo_name(photo, i)}: no face found")
        crops.append(found[0])
    if not crops:
        return np.zeros((0, 0), np.float32)
    return model.embed_crops(torch.stack(crops), flip=flip, batch_size=batch_size)


def photo_crops(path: str, detection: Detection, cropper: Cropper,
                largest_only: bool = True) -> tuple[list[Face], list[np.ndarray]]:
    """A worker's task: the faces of the photo at `path`, largest first, and the crops (H x W x 3
    uint8) of the largest (`largest_only`) or of every one."""
    image = load_photo(path)
    faces = detection.faces(image)
    return faces, [np.asarray(cropper(image, face)) for face in (faces[:1] if largest_only else faces)]


def stream_crops(paths: list[str], model: Model, workers: int = 1, progress: Callable[[], None] | None = None,
                 largest_only: bool = True) -> Iterator[tuple[str, list[Face], list[torch.Tensor]]]:
    """(path, faces, 3 x h x w uint8 crops) of each photo, in order, found and cut by `workers`
    processes (faces.workers) while the caller embeds what came back."""
    check_available(model.detection.detector, model.detection.landmarks)
    task = functools.partial(photo_crops, detection=model.detection, cropper=model.cropper, largest_only=largest_only)
    for path, (faces, crops) in zip(paths, map_photos(task, paths, workers, progress,
                                                      setup=model.detection.worker_setup())):
        yield path, faces, [chw(c) for c in crops]


def embed_photo_files(paths: list[str], model: Model, workers: int = 1, batch_size: int = 64, flip: bool = True,
                      progress: Callable[[], None] | None = None) -> tuple[np.ndarray, Found]:
    """(one row per photo with a face, in order: its largest face's embedding; every photo's
    faces): a batch is embedded as soon as its crops are back, while the workers go on finding
    the next ones, so the model never waits for one photo at a time."""
    found, rows, batch = Found(detection=model.detection), [], []
    for path, faces, crops in stream_crops(paths, model, workers, progress):
        found.faces[path] = faces
        batch += crops
        if len(batch) == batch_size:
            rows.append(model.embed_crops(torch.stack(batch), flip=flip, batch_size=batch_size))
            batch = []
    if batch:
        rows.append(model.embed_crops(torch.stack(batch), flip=flip, batch_size=batch_size))
    return (np.concatenate(rows) if rows else np.zeros((0, 0), np.float32)), found
