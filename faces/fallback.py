"""The face a photo is given where none was found, so that a pair protocol keeps every pair: the
set's typical face, placed where the set's faces sit in their photos, at their scale.

Each found face is the similarity transform carrying dlib's chip frame onto it (`face_transform`),
in coordinates relative to its photo: origin at its centre, unit its geometric mean side sqrt(w * h).
A photo's fallback is the set's median transform (per parameter), taken back to that photo's
pixels, applied to the chip frame's points: in centred portraits (LFW), an upright face at the
centre, of the median size. It is an ordinary `Face`: every crop (insightface's 112, dlib's chip)
is cut from it as from a detected one."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardface.faces.align import similarity_transform
from shardface.faces.detect import Face, five_from_dlib5
from shardface.faces.dlib_chip import DLIB_150, DLIB_150_SHAPE5

FALLBACK_SCORE = 0.0  # a fallback face is no detection: below any detector's kept score


def _frame(size: tuple[int, int]) -> tuple[np.ndarray, float]:
    """(centre, unit) of a w x h photo's relative coordinates (pixel centres)."""
    w, h = size
    return np.array([(w - 1) / 2, (h - 1) / 2]), float(np.sqrt(w * h))


def face_transform(face: Face, size: tuple[int, int], shape5: bool) -> np.ndarray:
    """(a, b, tx, ty): the similarity [[a, -b, tx], [b, a, ty]] from dlib's chip frame onto the face in
    its w x h photo's relative coordinates, fitted to dlib's 5-point shape (`shape5`) or the five points."""
    ref, target = (DLIB_150_SHAPE5.points, face.shape) if shape5 else (DLIB_150.points, face.points)
    centre, unit = _frame(size)
    m = similarity_transform(ref, (np.asarray(target, np.float64) - centre) / unit)
    return np.array([m[0, 0], m[1, 0], m[0, 2], m[1, 2]])


@dataclass(frozen=True)
class Fallback:
    """The set's median `face_transform` (a, b, tx, ty)."""

    transform: np.ndarray
    shape5: bool

    @classmethod
    def of(cls, found: list[tuple[Face, tuple[int, int]]]) -> "Fallback":
        """The fallback of a set from its found faces [(face, its photo's (w, h))], at least one; fitted
        to, and giving, dlib's 5-point shape where every found face has one."""
        if not found:
            raise ValueError("no found face to take the fallback's place and scale from")
        shape5 = all(f.shape is not None and len(f.shape) == 5 for f, _ in found)
        return cls(np.median(np.stack([face_transform(f, s, shape5) for f, s in found]), axis=0), shape5)

    def face(self, size: tuple[int, int]) -> Face:
        """The fallback face of a w x h photo: its five points (and dlib's shape, derived as for a
        detection) placed by the median transform, its box the chip frame's bounds."""
        a, b, tx, ty = self.transform
        centre, unit = _frame(size)
        m = np.array([[a, -b, tx], [b, a, ty]]) * unit
        m[:, 2] += centre

        def place(points: np.ndarray) -> np.ndarray:
            return np.asarray(points, np.float64) @ m[:, :2].T + m[:, 2]

        h, w = DLIB_150.size
        corners = place(np.array([[0, 0], [w, 0], [0, h], [w, h]]))
        box = tuple(float(v) for v in (*corners.min(0), *corners.max(0)))
        if self.shape5:
            shape = place(DLIB_150_SHAPE5.points)
            return Face(box, five_from_dlib5(shape), FALLBACK_SCORE, shape)
        return Face(box, place(DLIB_150.points), FALLBACK_SCORE, None)
