"""insightface's five landmarks (left eye centre, right eye centre, nose tip, left mouth corner,
right mouth corner; "left" is the photo's left) from dlib's landmark predictors.

dlib's 68-point model gives all five directly, but it was trained on iBUG 300-W, whose licence
excludes commercial use. dlib's 5-point model (public domain, trained on dlib's own annotations)
gives the four eye corners and the base of the nose, not the nose tip or the mouth: the eye
centres are the middles of each eye's corners, and the other points are predicted from where
the nose base sits relative to the eyes, by the linear relation `FROM_NOSE_BASE`.

The relation works in the eyes' frame: origin midway between the eye centres, x the vector from
the left to the right eye centre, y that vector turned 90 degrees (pointing down the face), so
1.0 is the distance between the eyes; it is unchanged by the face's position, size and roll.
In that frame each of the five points is `[1, u, v] @ FROM_NOSE_BASE` for the nose base at
(u, v): u follows the head turning left and right, v its tilting up and down. The constants are
the least-squares fit of the 68-point model's five points on 188 real faces (the 94 faces of
scikit-image's LFW subset that dlib's HOG detector finds, upscaled, and their mirror images;
`python benchmarks/faces.py --fit` prints them again). What the substitution costs is measured
there too and stated in benchmarks/README.md ('Faces')."""
from __future__ import annotations

import numpy as np

# rows: 1, u, v of the nose base; columns: (u, v) of left eye, right eye, nose tip, left mouth
# corner, right mouth corner, in the eyes' frame (see the module docstring)
FROM_NOSE_BASE = np.array([
    [-0.4847, -0.0167, 0.4859, -0.0010, 0.0311, -0.3216, -0.5111, 0.5141, 0.4476, 0.5469],
    [0.0555, -0.0164, 0.0693, 0.0060, 1.4250, 0.0278, 0.2093, 0.0454, 0.2218, -0.0088],
    [-0.0177, 0.0160, 0.0164, -0.0057, -0.0446, 1.1314, 0.0918, 0.7403, -0.0010, 0.6984],
])


def eyes_frame(left_eye: np.ndarray, right_eye: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(origin, x, y) of the eyes' frame in photo pixels."""
    x = np.asarray(right_eye, np.float64) - left_eye
    return (np.asarray(left_eye, np.float64) + right_eye) / 2, x, np.array([-x[1], x[0]])


def to_frame(points: np.ndarray, frame) -> np.ndarray:
    origin, x, y = frame
    d = np.asarray(points, np.float64) - origin
    return np.stack([d @ x, d @ y], -1) / (x @ x)


def from_frame(uv: np.ndarray, frame) -> np.ndarray:
    origin, x, y = frame
    uv = np.asarray(uv, np.float64)
    return origin + uv[..., :1] * x + uv[..., 1:] * y


def dlib5_frame_and_nose(parts: np.ndarray) -> tuple[tuple, np.ndarray]:
    """The eyes' frame of dlib's 5 points (right eye outer and inner corner, left eye outer and
    inner corner, nose base; "right" being the person's) and the nose base's (u, v) in it."""
    parts = np.asarray(parts, np.float64)
    frame = eyes_frame(parts[2:4].mean(0), parts[0:2].mean(0))
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
