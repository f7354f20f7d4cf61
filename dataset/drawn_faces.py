"""Procedurally drawn face-like identities: the embedded demo data set.

Each identity is a fixed draw of shape, layout and colour parameters (face outline, eye
spacing and size, brows, nose, mouth, hair line, a mark). Each image of it varies pose,
scale, lighting, colour cast, background, blur, noise and JPEG quality, so that the
nuisance dominates raw pixels: an untrained network verifies near chance, one that has
learned the identity geometry verifies well.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SIZE = 112
_CANVAS = 224  # drawn at 2x, then rotated/cropped and downsampled (anti-aliasing)


@dataclass(frozen=True)
class Identity:
    face_w: float
    face_h: float
    skin: tuple
    eye_dx: float
    eye_y: float
    eye_r: float
    eye_squash: float
    iris: tuple
    brow_dy: float
    brow_tilt: float
    brow_w: float
    nose_len: float
    nose_w: float
    mouth_y: float
    mouth_w: float
    mouth_curve: float
    hair: tuple
    hair_line: float
    hair_style: int
    mark: tuple


def draw_identity(rng: np.random.Generator) -> Identity:
    u = rng.uniform
    tone = u(0.45, 0.85)
    return Identity(
        face_w=u(0.50, 0.70),
        face_h=u(0.66, 0.86),
        skin=(tone, tone * u(0.72, 0.88), tone * u(0.55, 0.75)),
        eye_dx=u(0.13, 0.23),
        eye_y=u(-0.12, 0.02),
        eye_r=u(0.035, 0.07),
        eye_squash=u(0.45, 1.0),
        iris=tuple(u(0.0, 0.6, 3)),
        brow_dy=u(0.05, 0.11),
        brow_tilt=u(-0.35, 0.35),
        brow_w=u(0.012, 0.03),
        nose_len=u(0.08, 0.2),
        nose_w=u(0.03, 0.08),
        mouth_y=u(0.2, 0.32),
        mouth_w=u(0.08, 0.2),
        mouth_curve=u(-0.06, 0.06),
        hair=tuple(u(0.05, 0.7, 3)),
        hair_line=u(-0.42, -0.25),
        hair_style=int(rng.integers(0, 4)),
        mark=(u(-0.25, 0.25), u(-0.1, 0.3), u(0.0, 0.025)),
    )


def _rgb(c, light):
    return tuple(int(np.clip(v * light * 255, 0, 255)) for v in c)


def render(identity: Identity, rng: np.random.Generator) -> Image.Image:
    """One image of `identity` under a random pose, light and background."""
    u = rng.uniform
    c = _CANVAS
    bg = rng.uniform(0, 1, 3)
    img = Image.new("RGB", (c, c), _rgb(bg, 1.0))
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 6))):  # background clutter
        x0, y0 = rng.uniform(-0.2, 1.0, 2) * c
        w, h = rng.uniform(0.15, 0.6, 2) * c
        d.ellipse([x0, y0, x0 + w, y0 + h], fill=_rgb(rng.uniform(0, 1, 3), 1.0))

    s = c * 0.5 * u(0.88, 1.08)  # scale
    cx, cy = c / 2 + u(-6, 6), c / 2 + u(-6, 6)
    light = u(0.55, 1.35)
    P = lambda x, y: (cx + x * s, cy + y * s)  # noqa: E731  face coordinates -> canvas

    idn = identity
    hair = _rgb(idn.hair, light * u(0.9, 1.1))
    # hair behind the face
    hx = idn.face_w * 1.08
    top = idn.hair_line - 0.1 * idn.hair_style
    d.ellipse([*P(-hx, top - 0.15), *P(hx, 0.15 + 0.12 * idn.hair_style)], fill=hair)
    d.ellipse([*P(-idn.face_w, -idn.face_h), *P(idn.face_w, idn.face_h)], fill=_rgb(idn.skin, light))
    # fringe: hair over the upper face, its line shape depends on the style
    if idn.hair_style % 2 == 0:
        d.chord([*P(-hx, top - 0.3), *P(hx, idn.hair_line + 0.1)], 180, 360, fill=hair)
    else:
        d.polygon(
            [
                P(-hx, top - 0.2),
                P(hx, top - 0.2),
                P(hx * 0.8, idn.hair_line),
                P(0.1, idn.hair_line + 0.08),
                P(-hx * 0.8, idn.hair_line),
            ],
            fill=hair,
        )
    # eyes and brows
    for side in (-1, 1):
        ex, ey = side * idn.eye_dx * 2, idn.eye_y
        r, rv = idn.eye_r, idn.eye_r * idn.eye_squash
        d.ellipse(
            [*P(ex - r * 1.4, ey - rv * 1.2), *P(ex + r * 1.4, ey + rv * 1.2)],
            fill=_rgb((0.95, 0.95, 0.95), light),
        )
        d.ellipse(
            [*P(ex - r * 0.7, ey - rv * 0.9), *P(ex + r * 0.7, ey + rv * 0.9)], fill=_rgb(idn.iris, light)
        )
        by = ey - idn.brow_dy - r
        tilt = idn.brow_tilt * side
        d.line(
            [P(ex - r * 1.8, by + tilt * 0.08), P(ex + r * 1.8, by - tilt * 0.08)],
            fill=hair,
            width=max(1, int(idn.brow_w * s)),
        )
    # nose
    d.line(
        [P(0, idn.eye_y + 0.03), P(-idn.nose_w * 0.4, idn.eye_y + idn.nose_len)],
        fill=_rgb(tuple(v * 0.7 for v in idn.skin), light),
        width=max(1, int(0.018 * s)),
    )
    d.line(
        [P(-idn.nose_w, idn.eye_y + idn.nose_len), P(idn.nose_w, idn.eye_y + idn.nose_len)],
        fill=_rgb(tuple(v * 0.6 for v in idn.skin), light),
        width=max(1, int(0.02 * s)),
    )
    # mouth: a curved line
    pts = [P(t * idn.mouth_w, idn.mouth_y + idn.mouth_curve * (1 - 4 * t * t)) for t in np.linspace(-1, 1, 9)]
    d.line(pts, fill=_rgb((0.55, 0.2, 0.2), light), width=max(1, int(0.025 * s)))
    mx, my, mr = idn.mark
    if mr > 0.012:
        d.ellipse([*P(mx - mr, my - mr), *P(mx + mr, my + mr)], fill=_rgb((0.25, 0.15, 0.1), light))

    img = img.rotate(u(-12, 12), resample=Image.BILINEAR, center=(cx, cy), fillcolor=_rgb(bg, 1.0))
    img = img.resize((SIZE, SIZE), Image.BILINEAR)
    arr = np.asarray(img).astype(np.float32)
    # colour cast and a directional light gradient
    arr *= rng.uniform(0.8, 1.2, 3)
    ramp = np.linspace(-1, 1, SIZE, dtype=np.float32)
    angle = u(0, 2 * math.pi)
    grad = (np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]) * u(0, 45)
    arr += grad[..., None]
    arr += rng.normal(0, u(0, 10), arr.shape)
    img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
    blur = u(0, 1.2)
    if blur > 0.3:
        img = img.filter(ImageFilter.GaussianBlur(blur))
    return img


def encode_jpeg(img: Image.Image, rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(rng.integers(75, 96)))
    return buf.getvalue()


def identity_images(identity_id: int, count: int, seed: int) -> list[bytes]:
    """`count` JPEG images of identity `identity_id`, deterministic given `seed`."""
    ident = draw_identity(np.random.default_rng([seed, identity_id, 0]))
    rng = np.random.default_rng([seed, identity_id, 1])
    return [encode_jpeg(render(ident, rng), rng) for _ in range(count)]
