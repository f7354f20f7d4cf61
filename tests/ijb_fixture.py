"""A generated IJB-C folder whose TAR@FAR is known by construction, and the network that embeds it
(each face a solid colour; its embedding the mean colour)."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image

from shardface.faces.align import ARCFACE_112

ARCFACE_TEMPLATE = ARCFACE_112.points


class MeanColour(torch.nn.Module):
    """Embedding = mean of the normalised image per channel: a solid colour 0.5 + 0.4u
    embeds to 0.8u, so pair scores are the cosines between the chosen directions u."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x.mean(dim=(2, 3)) + 0 * self.dummy


def _pair_directions(cos, rng):
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    return q[:, 0], cos * q[:, 0] + np.sqrt(1 - cos**2) * q[:, 1]


def make_ijb_fixture(root):
    """30 pairs: 7 genuine at cos 1, 1 genuine at 0.5, 2 genuine at -0.9; 20 impostors of
    which 2 score above 0.5. Hence TAR = 0.7 at FAR <= 1e-2 and 0.8 at FAR 1e-1."""
    rng = np.random.default_rng(0)
    genuine = [1.0] * 7 + [0.5] + [-0.9] * 2
    impostor = [0.6, 0.55] + list(np.linspace(-0.5, 0.4, 18))
    os.makedirs(root / "meta")
    os.makedirs(root / "loose_crop")
    faces, marks, pairs = [], [], []
    template = 0
    for cos, label in [(c, 1) for c in genuine] + [(c, 0) for c in impostor]:
        for u in _pair_directions(cos, rng):
            colour = tuple(int(round(255 * (0.5 + 0.4 * v))) for v in u)
            for media in range(2):  # two media, one image each: media averaging is exercised
                name = f"{template}_{media}.png"
                Image.new("RGB", (150, 150), colour).save(root / "loose_crop" / name)
                faces.append(f"{name} {template} {template * 10 + media}")
                pts = ARCFACE_TEMPLATE + 15 + rng.normal(0, 1, ARCFACE_TEMPLATE.shape)
                marks.append(
                    name + " " + " ".join(f"{v:.3f}" for v in pts.ravel()) + f" {rng.uniform(0.6, 1):.3f}"
                )
            template += 1
        pairs.append(f"{template - 2} {template - 1} {label}")
    (root / "meta" / "ijbc_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / "ijbc_name_5pts_score.txt").write_text("\n".join(marks) + "\n")
    (root / "meta" / "ijbc_template_pair_label.txt").write_text("\n".join(pairs) + "\n")
