"""A picture of what was found: the photo with each face's box and five points, and each match's
name and score (`Model.draw`)."""
from __future__ import annotations

import math

from PIL import Image, ImageDraw, ImageFont

from faces.stream import open_image

FOUND, NOBODY = (0, 220, 90), (255, 170, 0)  # a face named or plainly found; a face matching nobody


def draw(photo, found: list) -> Image.Image:
    """A copy of `photo` with every face of `found` drawn: faces (Model.faces) or matches
    (Gallery.identify: their face, and the name, or "unknown" in another colour, with the score)."""
    image = open_image(photo).copy()
    pen = ImageDraw.Draw(image)
    side = max(12, round(min(image.size) / 40))
    font = ImageFont.load_default(size=side)
    width = max(2, side // 6)
    for item in found:
        face = getattr(item, "face", item)
        named = getattr(item, "name", "")
        colour = NOBODY if named is None else FOUND
        x0, y0, x1, y1 = face.box
        pen.rectangle((x0, y0, x1, y1), outline=colour, width=width)
        for x, y in face.points:
            if math.isfinite(x) and math.isfinite(y):  # a crop taken whole (align=False) has no points
                pen.ellipse((x - width, y - width, x + width, y + width), fill=colour)
        label = f"{named or 'unknown'} {item.score:.2f}" if hasattr(item, "name") else ""
        if label:
            left, top, right, bottom = pen.textbbox((x0, y0), label, font=font)
            lift = bottom - top + 2 * width
            pen.rectangle((left - width, top - lift, right + width, bottom - lift + width), fill=colour)
            pen.text((x0, y0 - lift), label, fill=(0, 0, 0), font=font)
    return image
