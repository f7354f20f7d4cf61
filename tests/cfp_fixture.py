"""A small folder in CFP's own layout (Data/Images/NNN/{frontal,profile}/NN.jpg, Protocol's two
photo lists and Split/{FF,FP}/01..10/{same,diff}.txt), made of the astronaut's face: the input of
the CFP protocol tests. Each fold holds one same and one different pair; one profile photo holds
no face (a fallback crop)."""

from __future__ import annotations

import os

from PIL import Image, ImageEnhance

from tests.astronaut import astronaut_head

PEOPLE, FRONTAL, PROFILE = 3, 3, 2


def _photos(person: int) -> tuple[list[Image.Image], list[Image.Image]]:
    head = ImageEnhance.Brightness(astronaut_head()).enhance(0.7 + 0.15 * person)
    if person % 2:
        head = head.transpose(Image.FLIP_LEFT_RIGHT)
    frontal = [head.rotate(4 * i, resample=Image.BILINEAR, fillcolor=(90, 90, 90)) for i in range(FRONTAL)]
    # the second: no face
    profile = [
        head.rotate(-8, resample=Image.BILINEAR, fillcolor=(90, 90, 90)),
        Image.new("RGB", head.size, (120 + 20 * person, 140, 160)),
    ]
    return frontal, profile


def cfp_root(root) -> str:
    """`root` in CFP's layout; returns its path."""
    lists = {"F": [], "P": []}
    for person in range(PEOPLE):
        for kind, photos in zip(("frontal", "profile"), _photos(person)):
            folder = root / "Data" / "Images" / f"{person + 1:03d}" / kind
            os.makedirs(folder)
            for i, photo in enumerate(photos, 1):
                photo.save(folder / f"{i:02d}.jpg", quality=95)
                lists[kind[0].upper()].append(f"../Data/Images/{person + 1:03d}/{kind}/{i:02d}.jpg")
    protocol = root / "Protocol"
    os.makedirs(protocol)
    for key, paths in lists.items():
        (protocol / f"Pair_list_{key}.txt").write_text("".join(f"{i} {p}\n" for i, p in enumerate(paths, 1)))
    for proto, per in (("FF", FRONTAL), ("FP", PROFILE)):
        for k in range(10):
            fold = protocol / "Split" / proto / f"{k + 1:02d}"
            os.makedirs(fold)
            a, b = k % PEOPLE, (k + 1) % PEOPLE
            first = a * FRONTAL + k % FRONTAL + 1
            (fold / "same.txt").write_text(f"{first},{a * per + (k + 1) % per + 1}\n")
            (fold / "diff.txt").write_text(f"{first},{b * per + k % per + 1}\n")
    return str(root)
