#!/usr/bin/env python
"""Detection and alignment on real faces available offline: scikit-image's astronaut (512x512,
one face) and its LFW subset (100 faces and 100 non-face patches, 25x25, upscaled to 150x150
and padded to 270x270 so the detectors' windows fit), each also mirrored.

Prints: faces found (HOG at upsample 0 and 1, MMOD) and detections on the non-face patches;
what the default 5-point landmarks cost against the 68-point model's (held-out half, pixels at
112); the alignment error (landmarks re-detected on the aligned crop against the template's,
and for a plain resize of the face box); and photos/s of `aligned_faces` per detector.
`--fit` prints `faces.detect.FROM_NOSE_BASE` fitted on all faces instead.
`--quick` uses 10 LFW faces (a check that the script runs)."""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401,I001
import numpy as np
from PIL import Image
from skimage import data

from shardface.faces.align import ARCFACE_112, similarity_transform
from shardface.faces.detect import (
    Detection,
    detect_faces,
    dlib5_frame_and_nose,
    face_detector,
    five_from_dlib5,
    five_from_dlib68,
    from_frame,
    landmark_predictor,
    to_frame,
)
from shardface.faces.stream import Crop, stream


def aligned_faces(photo, template, detector: str = "hog", upsample: int = 1, landmarks: str = "5"):
    """[(face, its aligned crop)] of one photo, largest first, through the face stream."""
    found = next(iter(stream([photo], Detection(detector, upsample, landmarks), cut=Crop(template))))
    return [(face, Image.fromarray(crop)) for face, crop in zip(found.faces, found.cuts)]


def lfw(first: int, count: int) -> list[np.ndarray]:
    out = []
    for patch in data.lfw_subset()[first : first + count]:
        big = Image.fromarray(np.rint(patch * 255).astype(np.uint8)).resize((150, 150), Image.BICUBIC)
        out.append(np.stack([np.pad(np.asarray(big), 60, mode="edge")] * 3, -1))
    return out


def with_mirrors(images: list[np.ndarray]) -> list[np.ndarray]:
    return [x for img in images for x in (img, np.ascontiguousarray(img[:, ::-1]))]


def both_landmarks(images: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(dlib 5-point parts, dlib 68-point parts) on the largest HOG box of each image with a face."""
    import dlib

    out = []
    for img in images:
        faces = detect_faces(img, upsample=0)
        if not faces:
            continue
        rect = dlib.rectangle(*(int(round(v)) for v in faces[0].box))
        parts = [
            np.array([(p.x, p.y) for p in landmark_predictor(k)(img, rect).parts()], np.float64)
            for k in ("5", "68")
        ]
        out.append(tuple(parts))
    return out


def fit(pairs) -> np.ndarray:
    rows, targets = [], []
    for p5, p68 in pairs:
        frame, (u, v) = dlib5_frame_and_nose(p5)
        rows.append([1.0, u, v])
        targets.append(to_frame(five_from_dlib68(p68), frame).ravel())
    return np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)[0]


def crop_error(points: np.ndarray, reference: np.ndarray) -> float:
    """Mean distance at 112 between where the reference five points land in the crop aligned by
    `points` and in the crop aligned by `reference` itself."""
    h = np.c_[reference, np.ones(5)]
    a, b = (
        similarity_transform(points, ARCFACE_112.points),
        similarity_transform(reference, ARCFACE_112.points),
    )
    return float(np.linalg.norm(h @ a.T - h @ b.T, axis=1).mean())


def redetected_eye_error(crop: Image.Image) -> float | None:
    """Mean distance of the eye centres found again on a crop (4x upscaled, 68-point model) from
    the template's; None when no face is found in the crop."""
    big = crop.resize((448, 448), Image.BICUBIC)
    faces = detect_faces(big, upsample=0, landmarks="68")
    if not faces:
        return None
    eyes = faces[0].points[:2] / 4 + 0.375  # pixel centres of the 4x image back at 112
    return float(np.linalg.norm(eyes - ARCFACE_112.points[:2], axis=1).mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fit", action="store_true", help="print FROM_NOSE_BASE fitted on every face")
    p.add_argument("--quick", action="store_true", help="10 LFW faces: check that the script runs")
    p.add_argument("--no_timing", action="store_true", help="the accuracy figures only (no photos/s)")
    args = p.parse_args()
    n = 10 if args.quick else 100
    faces = with_mirrors([data.astronaut()] + lfw(0, n))
    if args.fit:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        print(repr(fit(both_landmarks(faces))))
        return
    pairs = both_landmarks(faces)  # pairs 2k, 2k+1 are a photo and its mirror: split by photo
    train = [pr for i, pr in enumerate(pairs) if (i // 2) % 2 == 0]
    held = [pr for i, pr in enumerate(pairs) if (i // 2) % 2 == 1]
    coef = fit(train)
    errors = []
    for p5, p68 in held:
        frame, (u, v) = dlib5_frame_and_nose(p5)
        derived = np.array([1.0, u, v]) @ coef
        errors.append(crop_error(from_frame(derived.reshape(5, 2), frame), five_from_dlib68(p68)))
    shipped = [crop_error(five_from_dlib5(p5), five_from_dlib68(p68)) for p5, p68 in pairs]
    print(
        f"5-point vs 68-point five points, crop displacement at 112: held-out {len(held)} faces "
        f"mean {np.mean(errors):.2f} px, max {np.max(errors):.2f} px (fit on {len(train)}); "
        f"shipped constants on all {len(pairs)}: mean {np.mean(shipped):.2f} px"
    )

    for landmarks in ("5", "68"):
        aligned, resized = [], []
        for img in faces:
            found = aligned_faces(Image.fromarray(img), ARCFACE_112, upsample=0, landmarks=landmarks)
            if not found:
                continue
            face, crop = found[0]
            aligned.append(redetected_eye_error(crop))
            resized.append(redetected_eye_error(Image.fromarray(img).crop(face.box).resize((112, 112))))
        ok = [e for e in aligned if e is not None]
        ok_r = [e for e in resized if e is not None]
        print(
            f"alignment ({landmarks}-point landmarks): eye centres re-detected on {len(ok)}/{len(aligned)} "
            f"crops, mean {np.mean(ok):.2f} px from the template, max {np.max(ok):.2f}; the face box resized "
            f"to 112x112 instead: {len(ok_r)} re-detected, mean {np.mean(ok_r):.2f} px"
        )

    non_faces = with_mirrors(lfw(100, n))
    for detector, up in (("hog", 0), ("hog", 1), ("mmod", 0)):
        hits = sum(bool(detect_faces(img, detector, up)) for img in faces)
        false = sum(len(detect_faces(img, detector, up)) for img in non_faces)
        print(
            f"{detector} upsample {up}: faces found in {hits}/{len(faces)} face photos, "
            f"{false} detections in {len(non_faces)} non-face patches"
        )

    if args.no_timing:
        return
    photo = Image.fromarray(data.astronaut())
    for detector, up in (("hog", 1), ("mmod", 0)):
        face_detector(detector), landmark_predictor("5")
        start, reps = time.perf_counter(), 3 if args.quick or detector == "mmod" else 10
        for _ in range(reps):
            aligned_faces(photo, ARCFACE_112, detector=detector, upsample=up)
        print(
            f"aligned_faces {detector} upsample {up}, 512x512 photo, one process: "
            f"{reps / (time.perf_counter() - start):.2f} photos/s"
        )


if __name__ == "__main__":
    main()
