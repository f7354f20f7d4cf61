"""An LFW-layout folder of the astronaut's face (and photos without one) and pair lists over it:
the inputs of the pair-list verification tests and of benchmarks/lfw_anchor.py's test."""

from __future__ import annotations

import os

from PIL import Image, ImageDraw, ImageEnhance

from tests.astronaut import astronaut_head

GREY = (90, 90, 90)


def _small(head: Image.Image) -> Image.Image:
    """The head at a quarter of its size in a small photo: a face HOG finds only upsampled twice."""
    photo = Image.new("RGB", (80, 80), GREY)
    photo.paste(head.resize((50, 55), Image.BILINEAR), (15, 12))
    return photo


def _masked(head: Image.Image) -> Image.Image:
    """The head with its mouth and chin covered: HOG finds no face, dlib's CNN does."""
    photo = head.copy()
    ImageDraw.Draw(photo).rectangle((56, 115, 145, 150), fill=GREY)
    return photo


def lfw_folder(root) -> str:
    """`root` as an LFW-layout folder: Eileen and Mirror (three photos of a face each), Wall (two
    photos without a face), Tiny (a face found only with --retry_upsample 2), Masked (only by MMOD)."""
    head = astronaut_head()
    photos = {
        "Eileen": [
            head,
            ImageEnhance.Brightness(head).enhance(0.7),
            head.rotate(12, resample=Image.BILINEAR, fillcolor=GREY),
        ],
        "Wall": [Image.new("RGB", head.size, (120, 140, 160)), Image.new("RGB", head.size, (200, 180, 160))],
        "Tiny": [_small(head)],
        "Masked": [_masked(head)],
    }
    photos["Mirror"] = [p.transpose(Image.FLIP_LEFT_RIGHT) for p in photos["Eileen"]]
    for name, images in photos.items():
        os.makedirs(root / name)
        for i, image in enumerate(images, 1):
            image.save(root / name / f"{name}_{i:04d}.jpg", quality=95)
    return str(root)


SAME = [
    "Eileen 1 2",
    "Eileen 1 3",
    "Eileen 2 3",
    "Mirror 1 2",
    "Mirror 1 3",
    "Mirror 2 3",
    "Wall 1 2",
    "Eileen 3 1",
    "Mirror 3 2",
    "Eileen 2 1",
]
DIFF = [
    "Eileen 1 Mirror 1",
    "Eileen 2 Wall 1",
    "Tiny 1 Eileen 3",
    "Mirror 3 Wall 2",
    "Mirror 2 Tiny 1",
    "Eileen 3 Mirror 2",
    "Wall 1 Mirror 1",
    "Eileen 1 Tiny 1",
    "Mirror 1 Eileen 2",
    "Wall 2 Eileen 1",
]


def lfw_list(path, same=SAME, diff=DIFF) -> str:
    """An LFW pairs.txt of 10 folds, each one same pair and one different pair."""
    lines = ["10\t1"] + [line.replace(" ", "\t") for s, d in zip(same, diff) for line in (s, d)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)
