"""Faces in a real photo: scikit-image's astronaut (public domain), cropped to her head, a photo
holding that head twice at two sizes, and a folder of such photos for the alignment tools."""

from __future__ import annotations

import os

from PIL import Image


def astronaut_head() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut()).crop((120, 20, 320, 240))  # 200x220, face about 90 px


def two_faces_photo(head: Image.Image) -> Image.Image:
    """The head twice: as it is (left) and at 60% (right, a face of about 54 px)."""
    photo = Image.new("RGB", (360, 240), (90, 90, 90))
    photo.paste(head, (0, 10))
    photo.paste(head.resize((120, 132), Image.BILINEAR), (220, 60))
    return photo


def align_photos(root) -> str:
    """`root` with p/: the head turned three ways and a photo holding it twice; q/: two mirrored
    heads, a wall (no face), and a.jpg beside a.png (crops named by the whole file name)."""
    head = astronaut_head()
    os.makedirs(root / "p")
    os.makedirs(root / "q")
    for i in range(3):
        head.rotate(4 * i, resample=Image.BILINEAR, fillcolor=(90, 90, 90)).save(root / "p" / f"h{i}.png")
    two_faces_photo(head).save(root / "p" / "two.png")
    for i in range(2):
        head.transpose(Image.FLIP_LEFT_RIGHT).rotate(-3 * i).save(root / "q" / f"m{i}.jpg", quality=95)
    Image.new("RGB", (160, 160), (120, 140, 160)).save(root / "q" / "wall.png")
    head.save(root / "q" / "a.jpg", quality=90)
    head.save(root / "q" / "a.png")
    return str(root)


def file_tree(folder) -> dict[str, bytes]:
    """Every file under `folder`: relative path -> bytes (what a tool wrote, to compare outputs)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


def documented_photos(root) -> None:
    """Under `root`, the photos the docs' commands name (README, docs/photos.md and
    docs/identification.md), each of the astronaut's head, turned and mirrored: photos/train/ with
    34 people of 3 photos, photos/held_out/ with 8 more, a.jpg and b.jpg, group.jpg (two faces),
    people/ (a gallery of two) and more_photos/. The "people" are one face: the commands run on
    them, nothing is learnt."""
    head = astronaut_head()

    def photo(p: int, i: int) -> Image.Image:
        turned = head.transpose(Image.FLIP_LEFT_RIGHT) if p % 2 else head
        return turned.rotate((p + 2 * i) % 7, resample=Image.BILINEAR, fillcolor=(60 + p % 9 * 10,) * 3)

    for folder, prefix, people, first in (("train", "person", 34, 0), ("held_out", "guest", 8, 34)):
        for p in range(people):
            os.makedirs(root / "photos" / folder / f"{prefix}{p:02d}")
            for i in range(3):
                photo(first + p, i).save(
                    root / "photos" / folder / f"{prefix}{p:02d}" / f"{i}.jpg", quality=95
                )
    photo(0, 0).save(root / "a.jpg", quality=95)
    photo(0, 1).save(root / "b.jpg", quality=95)
    two_faces_photo(head).save(root / "group.jpg", quality=95)
    for p, name in enumerate(("eileen", "sally")):
        os.makedirs(root / "people" / name)
        for i in range(2):
            photo(p, i).save(root / "people" / name / f"{i}.jpg", quality=95)
    os.makedirs(root / "more_photos")
    for i in range(2):
        photo(3, i).save(root / "more_photos" / f"{i}.jpg", quality=95)
