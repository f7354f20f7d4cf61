"""Many photos at once: find the faces of every photo (with progress), keep each photo's largest
face, and name the photos where none was found, for the tools' `--align` and align-on-the-fly
training. A photo without a face is left out with a warning naming it, or, `strict`, refused
before anything is written."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from dataset.errors import DataError
from faces.align import ARCFACE_112, Template
from faces.detect import Detection, Face
from faces.stream import Crop, stream

logger = logging.getLogger("shardface")
SHOWN = 3  # photos named in a message
MAX_HINTED_UPSAMPLE = 3  # each doubling costs 4x the time: beyond this, no more is suggested


@dataclass
class Found:
    """The faces of a set of photos: `faces[path]`, largest first (empty: no face found)."""
    faces: dict[str, list[Face]] = field(default_factory=dict)
    detection: Detection = Detection()  # how they were searched (the hints of messages suggest more)

    @property
    def without_face(self) -> list[str]:
        return [p for p, f in self.faces.items() if not f]

    @property
    def extra_faces(self) -> int:
        """Faces beyond the largest of each photo (left unused where one face per photo is taken)."""
        return sum(max(0, len(f) - 1) for f in self.faces.values())

    def largest(self) -> dict[str, Face]:
        return {p: f[0] for p, f in self.faces.items() if f}

    def several_faces(self) -> str | None:
        """One line counting, per photo, the faces beyond the largest (None where no photo has
        several): each photo's largest face is used, the others are not."""
        several = [(p, len(f)) for p, f in self.faces.items() if len(f) > 1]
        if not several:
            return None
        more = f" and {len(several) - SHOWN} more" if len(several) > SHOWN else ""
        return (f"{len(several)} of {len(self.faces)} photos hold several faces, the largest of each used: "
                + ", ".join(f"{p} ({n} faces)" for p, n in several[:SHOWN]) + more)

    def summary(self) -> str:
        n = len(self.faces)
        return (f"faces found in {n - len(self.without_face)} of {n} photos; {self.extra_faces} further faces "
                "in photos with several (the largest of each is used)")


def find_faces(paths: Iterable[str], detection: Detection = Detection(),
               progress: Callable[[], None] | None = None, workers: int = 1) -> Found:
    """Detect the faces of every photo on `workers` processes (faces.workers: the same result
    whatever their number); an unreadable photo is an ImageDecodeError naming it."""
    found = Found(detection=detection)
    for photo in stream(paths, detection, workers=workers, progress=progress):
        found.faces[photo.name] = photo.faces
    return found


def no_face_message(paths: list[str], total: int, detection: Detection = Detection()) -> str:
    """Names the photos, with a hint of what was not tried yet (more upsampling, the other detector)."""
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    hints = []
    if detection.upsample < MAX_HINTED_UPSAMPLE:
        hints.append(f"--upsample {detection.upsample + 1} for small faces")
    if detection.detector != "mmod":
        hints.append("--detector mmod")
    hint = f" (try {', or '.join(hints)})" if hints else ""
    return f"no face found in {len(paths)} of {total} photos: {', '.join(paths[:SHOWN])}{more}{hint}"


def usable(found: Found, strict: bool) -> dict[str, Face]:
    """Each photo's largest face; photos without one are refused (`strict`) or left out with a
    warning naming them."""
    missing = found.without_face
    if missing and len(missing) == len(found.faces):
        raise DataError(no_face_message(missing, len(found.faces), found.detection))
    if missing:
        message = no_face_message(missing, len(found.faces), found.detection)
        if strict:
            raise DataError(f"{message}; --strict refuses them")
        logger.warning("%s; left out", message)
    return found.largest()


def aligned_pngs(paths: list[str], faces: dict[str, Face], template: Template = ARCFACE_112,
                 workers: int = 1) -> Iterator[bytes]:
    """Each photo's face (`faces[path]`) cut to `template`, as PNG bytes (lossless: no second
    compression), in order, on `workers` processes."""
    for photo in stream(paths, faces=[[faces[p]] for p in paths], cut=Crop(template, png=True), workers=workers):
        yield photo.cuts[0]


def align_groups(groups: list[list[str]], detection: Detection, strict: bool,
                 progress: Callable[[], None] | None = None, names: list[str] | None = None,
                 workers: int = 1, found: Found | None = None) -> tuple[list[list[str]], dict[str, Face]]:
    """Identity groups of photos -> (the groups without photos where no face was found, each kept
    photo's largest face), from `found` where the faces were found already (faces.ranked). An
    identity left without a photo is a DataError naming it: dropping it would renumber every
    later label."""
    if found is None:
        found = find_faces((p for g in groups for p in g), detection, progress, workers)
    faces = usable(found, strict)
    kept = [[p for p in g if p in faces] for g in groups]
    for label, (before, after) in enumerate(zip(groups, kept)):
        if before and not after:
            who = names[label] if names else f"label {label} ({before[0]}, ...)"
            raise DataError(f"{who}: no face found in any of its {len(before)} photos")
    if found.extra_faces:
        logger.warning("%s", found.summary())
    return kept, faces
