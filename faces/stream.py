"""The one face stream: photos in, and out, in their order, each photo's faces (largest first:
box, five points, score) with what was cut of them (a crop, a PNG), found and cut on `workers`
processes (faces.workers), the same whatever their number.

    for photo in stream(paths, Detection(), cut=Crop(ARCFACE_112), workers=4):
        photo.name, photo.size, photo.faces, photo.cuts

Every user of faces goes through `stream` (docs/architecture.md): the tools, the pair protocols, infer.stream
(which adds embeddings) and training's aligned folders (whose loader cuts with the same `Crop`). A photo is a
path, a PIL image or an H x W (x 3) uint8 array; faces known already (`faces=`: fallback faces, an earlier
search) are cut, not searched. Built on it: `find_faces`, `usable`, `align_groups`, `aligned_pngs`."""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
from PIL import Image

from shardface.dataset.errors import DataError
from shardface.dataset.images import decode_chw, read_image_file, resize_face, to_rgb
from shardface.faces.align import ARCFACE_112, Template, align
from shardface.faces.detect import Detection, Face, load_photo
from shardface.faces.dlib_chip import dlib_chip
from shardface.faces.workers import map_photos

logger = logging.getLogger("shardface")
SHOWN = 3  # photos named in a message
MAX_HINTED_UPSAMPLE = 3  # each doubling costs 4x the time: beyond this, no more is suggested


def photo_name(photo, index: int = 0) -> str:
    """How messages name a photo: its path, or its place in the list given."""
    return (
        os.fsdecode(photo)
        if isinstance(photo, (str, os.PathLike))
        else f"photo {index} ({type(photo).__name__})"
    )


def open_image(photo, index: int = 0) -> Image.Image:
    """A photo (path, PIL image, H x W (x 3) uint8 array) as RGB; anything else, or an empty image: DataError."""
    if isinstance(photo, (str, os.PathLike)):
        image = load_photo(os.fspath(photo))
    elif isinstance(photo, Image.Image):
        image = to_rgb(photo)
    elif isinstance(photo, np.ndarray):
        if photo.dtype != np.uint8 or photo.ndim not in (2, 3) or (photo.ndim == 3 and photo.shape[2] != 3):
            raise DataError(
                f"{photo_name(photo, index)}: an array photo must be H x W x 3 (RGB) or H x W uint8, "
                f"got {photo.dtype} of shape {photo.shape}"
            )
        image = to_rgb(Image.fromarray(photo))
    else:
        raise DataError(
            f"{photo_name(photo, index)}: a photo is a file path, a PIL image or a uint8 array, "
            f"not a {type(photo).__name__}"
        )
    if 0 in image.size:
        raise DataError(f"{photo_name(photo, index)}: an empty ({image.size[0]}x{image.size[1]}) image")
    return image


@dataclass(frozen=True)
class Crop:
    """Cuts a face's crop for a template, H x W x 3 uint8, from anything `open_image` takes: the five-point
    alignment, or with `dlib_chip` (MODEL dlib) dlib's own chip from its 5-point shape, as face_recognition
    cuts it (with 68 landmarks: the five points on the chip's template). `png`: PNG bytes (lossless) instead."""

    template: Template
    dlib_chip: bool = False
    png: bool = False

    def __call__(self, photo, face: Face):
        image = open_image(photo)
        if self.dlib_chip and face.shape is not None and len(face.shape) == 5:
            crop = dlib_chip(image, face.shape, size=self.template.size[0])
        else:
            crop = align(image, face.points, self.template)
        if not self.png:
            return np.asarray(crop)
        buf = io.BytesIO()
        crop.save(buf, format="PNG")
        return buf.getvalue()


@dataclass
class Photo:
    """One photo's faces, largest first ([]: none found), and `cuts[i]`, the cut of `faces[i]`
    (the largest only with `largest_only`; none without a cut)."""

    name: str
    size: tuple[int, int]  # (width, height)
    faces: list[Face]
    cuts: list

    @property
    def face(self) -> Face | None:
        """The largest face, or None."""
        return self.faces[0] if self.faces else None


def crop_pixels(photo, index: int = 0, resize: tuple[int, int] | None = None) -> np.ndarray:
    """A photo that is a crop already, H x W x 3 uint8, resized to (h, w) `resize` where given: a file
    decoded as training decodes one (dataset.images), a PIL image or array as `open_image`."""
    if isinstance(photo, (str, os.PathLike)):
        path = os.fspath(photo)
        return decode_chw(read_image_file(path), path, resize=resize).permute(1, 2, 0).numpy()
    image = open_image(photo, index)
    return np.asarray(resize_face(image, resize) if resize is not None else image)


@dataclass(frozen=True)
class _Task:
    """What a worker does to one (index, photo, its known faces or None)."""

    detection: Detection | None  # None: each photo is a crop already (its one face: the whole image)
    cut: Callable | None
    largest_only: bool
    resize: tuple[int, int] | None = None  # crops already: resized to this (h, w)

    def __call__(self, item) -> Photo:
        index, photo, known = item
        name = photo_name(photo, index)
        if self.detection is None and known is None:
            pixels = crop_pixels(photo, index, self.resize)
            h, w = pixels.shape[:2]
            whole = Face((0.0, 0.0, float(w), float(h)), np.full((5, 2), np.nan), float("nan"))
            return Photo(name, (w, h), [whole], [pixels])
        image = open_image(photo, index)
        faces = list(known) if known is not None else self.detection.faces(image)
        cuts = [self.cut(image, f) for f in (faces[:1] if self.largest_only else faces)] if self.cut else []
        return Photo(name, image.size, faces, cuts)


def stream(
    photos: Iterable,
    detection: Detection | None = Detection(),
    cut: Callable | None = None,
    workers: int = 1,
    largest_only: bool = False,
    faces: list[list[Face]] | None = None,
    progress: Callable[[], None] | None = None,
    resize: tuple[int, int] | None = None,
) -> Iterator[Photo]:
    """Each photo's `Photo`, in order (module docstring). `detection` None: each photo is a crop already,
    its one face and its cut the whole image (resized to `resize` where given). `faces[i]`: photo i's
    faces, known already. `cut(image, face)` runs in the workers, on every face or the largest only."""
    photos = list(photos)
    if faces is not None and len(faces) != len(photos):
        raise ValueError(f"{len(faces)} face lists for {len(photos)} photos")
    task = _Task(detection, cut, largest_only, resize)
    items = [(i, p, None if faces is None else faces[i]) for i, p in enumerate(photos)]
    setup = detection.worker_setup() if detection is not None and faces is None else None
    return map_photos(
        task,
        items,
        workers=workers,
        progress=progress,
        name=lambda item: photo_name(item[1], item[0]),
        setup=setup,
    )


@dataclass
class Found:
    """The faces of a set of photos: `faces[path]`, largest first (empty: no face found)."""

    faces: dict[str, list[Face]] = field(default_factory=dict)
    detection: Detection = Detection()  # how they were searched (the hints of messages suggest more)

    @property
    def without_face(self) -> list[str]:
        return [p for p, f in self.faces.items() if not f]

    def several_faces(self) -> str | None:
        """One line naming the photos with several faces, of which the largest is used; None where none has."""
        several = [(p, len(f)) for p, f in self.faces.items() if len(f) > 1]
        if not several:
            return None
        more = f" and {len(several) - SHOWN} more" if len(several) > SHOWN else ""
        return (
            f"{len(several)} of {len(self.faces)} photos hold several faces, the largest of each used: "
            + ", ".join(f"{p} ({n} faces)" for p, n in several[:SHOWN])
            + more
        )


def find_faces(
    paths: Iterable[str],
    detection: Detection = Detection(),
    progress: Callable[[], None] | None = None,
    workers: int = 1,
) -> Found:
    return Found(
        {p.name: p.faces for p in stream(paths, detection, workers=workers, progress=progress)}, detection
    )


def no_face_message(paths: list[str], total: int, detection: Detection = Detection()) -> str:
    """Names the photos, hinting at what was not tried yet (more upsampling, the other detector)."""
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    hints = []
    if detection.upsample < MAX_HINTED_UPSAMPLE:
        hints.append(f"--upsample {detection.upsample + 1} for small faces")
    if detection.detector != "mmod":
        hints.append("--detector mmod")
    hint = f" (try {', or '.join(hints)})" if hints else ""
    return f"no face found in {len(paths)} of {total} photos: {', '.join(paths[:SHOWN])}{more}{hint}"


def usable(found: Found, strict: bool) -> dict[str, Face]:
    """Each photo's largest face; a photo without one is left out with a warning naming it, or with
    `strict` refused (before anything is written); DataError where no photo has one."""
    missing = found.without_face
    if missing:
        message = no_face_message(missing, len(found.faces), found.detection)
        if len(missing) == len(found.faces):
            raise DataError(message)
        if strict:
            raise DataError(f"{message}; --strict refuses them")
        logger.warning("%s; left out", message)
    return {p: f[0] for p, f in found.faces.items() if f}


def aligned_pngs(paths: list[str], faces: dict[str, Face], workers: int = 1) -> Iterator[bytes]:
    """Each photo's face (`faces[path]`) cut to insightface's 112x112 template, as PNG bytes, in order."""
    for photo in stream(
        paths, faces=[[faces[p]] for p in paths], cut=Crop(ARCFACE_112, png=True), workers=workers
    ):
        yield photo.cuts[0]


def align_groups(
    groups: list[list[str]],
    detection: Detection,
    strict: bool,
    progress: Callable[[], None] | None = None,
    names: list[str] | None = None,
    workers: int = 1,
    found: Found | None = None,
) -> tuple[list[list[str]], dict[str, Face]]:
    """Identity groups of photos -> (the groups less photos without a face, each kept photo's largest face),
    from `found` where found already (infer.ranked). An identity left without a photo is a DataError
    naming it: dropping it would renumber every later label."""
    if found is None:
        found = find_faces((p for g in groups for p in g), detection, progress, workers)
    faces = usable(found, strict)
    kept = [[p for p in g if p in faces] for g in groups]
    for label, (before, after) in enumerate(zip(groups, kept)):
        if before and not after:
            who = names[label] if names else f"label {label} ({before[0]}, ...)"
            raise DataError(f"{who}: no face found in any of its {len(before)} photos")
    extra = sum(max(0, len(f) - 1) for f in found.faces.values())
    if extra:
        logger.warning(
            "faces found in %d of %d photos; %d further faces in photos with several (the largest of "
            "each is used)",
            len(faces),
            len(found.faces),
            extra,
        )
    return kept, faces
