"""IJB-B / IJB-C 1:1 verification (template-based TAR at fixed FAR).

Layout under `root`: meta/<prefix>_face_tid_mid.txt (image, template, media),
meta/<prefix>_template_pair_label.txt (template 1, template 2, label),
meta/<prefix>_name_5pts_score.txt (image, 10 landmark coordinates, detector score),
loose_crop/<images>. Each face is aligned to the 112x112 ArcFace template by a 5-point
similarity transform; its feature is the embedding of the face plus that of its mirror image,
weighted by the detector score; images of one media are averaged, media of one template
summed, templates L2-normalised; pair scores are cosine similarities; TAR at each FAR is the
highest true accept rate whose false accept rate does not exceed it.
"""
from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw
from sklearn.metrics import roc_curve

from dataset.errors import ImageDecodeError
from faces.detect import Face
from infer.model import as_model
from infer.stream import analyse
from utils.atomic import publishing

FAR_LEVELS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def _read_rows(path: str, min_fields: int) -> list[list[str]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: IJB meta file not found")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            if len(fields) < min_fields:
                raise ValueError(f"{path}:{lineno}: expected {min_fields} fields, got {len(fields)}")
            rows.append(fields)
    return rows


def load_meta(root: str, prefix: str):
    meta = os.path.join(root, "meta")
    faces = _read_rows(os.path.join(meta, f"{prefix}_face_tid_mid.txt"), 3)
    pairs = _read_rows(os.path.join(meta, f"{prefix}_template_pair_label.txt"), 3)
    marks = _read_rows(os.path.join(meta, f"{prefix}_name_5pts_score.txt"), 12)
    if [r[0] for r in faces] != [r[0] for r in marks]:
        raise ValueError(f"{meta}: face and landmark files list different images")
    landmarks = np.array([[float(v) for v in r[1:11]] for r in marks]).reshape(-1, 5, 2)
    scores = np.array([float(r[11]) for r in marks])
    return ([r[0] for r in faces], np.array([int(r[1]) for r in faces]), np.array([int(r[2]) for r in faces]),
            landmarks, scores, np.array([[int(r[0]), int(r[1])] for r in pairs]), np.array([int(r[2]) for r in pairs]))


def image_features(root: str, names, landmarks, backbone, batch_size: int = 64) -> np.ndarray:
    """Embedding of each face aligned at its landmarks plus that of its mirror image, through the
    face stream (infer.stream: the faces given, not searched)."""
    paths = [os.path.join(root, "loose_crop", name) for name in names]
    faces = [[Face((0.0, 0.0, 0.0, 0.0), np.asarray(marks, np.float64), float("nan"))] for marks in landmarks]
    try:
        rows = [photo.face.embedding.sum(0) for photo in analyse(as_model(backbone), paths, faces=faces,
                                                                  batch_size=batch_size, raw=True)]
    except ImageDecodeError as exc:
        raise FileNotFoundError(f"cannot read face image: {exc}") from None
    return np.stack(rows) if rows else np.zeros((0, 0), np.float32)


def template_features(feats, templates, medias):
    """Average images within a media, sum media within a template, L2-normalise."""
    ids = np.unique(templates)
    out = np.zeros((len(ids), feats.shape[1]))
    for i, t in enumerate(ids):
        in_t = templates == t
        for m in np.unique(medias[in_t]):
            out[i] += feats[in_t & (medias == m)].mean(0)
    out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return ids, out


def pair_scores(ids, tfeats, pairs) -> np.ndarray:
    row = {t: i for i, t in enumerate(ids)}
    try:
        a = np.array([row[t] for t in pairs[:, 0]])
        b = np.array([row[t] for t in pairs[:, 1]])
    except KeyError as exc:
        raise ValueError(f"pair file names template {exc.args[0]} that has no faces") from None
    return np.sum(tfeats[a] * tfeats[b], axis=1)


def tar_at_far(labels, scores, far_levels=FAR_LEVELS) -> dict[float, float]:
    fpr, tpr, _ = roc_curve(labels, scores)
    return {far: float(tpr[fpr <= far].max()) for far in far_levels}


def plot_roc(labels, scores, path: str, title: str = "ROC") -> None:
    """A log-FAR ROC plot written with PIL (no plotting library needed)."""
    fpr, tpr, _ = roc_curve(labels, scores)
    w, h, pad = 640, 480, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    lo, hi = -6.0, 0.0
    to_xy = lambda f, t: (pad + (np.log10(max(f, 1e-6)) - lo) / (hi - lo) * (w - 2 * pad),  # noqa: E731
                          h - pad - t * (h - 2 * pad))
    d.rectangle([pad, pad, w - pad, h - pad], outline="black")
    for e in range(-6, 1):
        x, _ = to_xy(10.0 ** e, 0)
        d.line([x, h - pad, x, h - pad + 5], fill="black")
        d.text((x - 12, h - pad + 8), f"1e{e}", fill="black")
    for t in np.linspace(0, 1, 6):
        _, y = to_xy(1e-6, t)
        d.text((10, y - 6), f"{t:.1f}", fill="black")
    d.line([to_xy(f, t) for f, t in zip(fpr, tpr)], fill="blue", width=2)
    d.text((pad, 20), f"{title} (x: FAR, log scale; y: TAR)", fill="black")
    with publishing(path) as tmp:  # atomically, like every tool output
        img.save(tmp, format="PNG")


def check_roc_path(path: str | None) -> None:
    """Refuse an ROC path that cannot be written, before any image is embedded."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--roc {path}: the directory {folder} does not exist; create it first")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise ValueError(f"--roc {path}: cannot write a PNG there")


def evaluate_ijb(root: str, backbone, prefix: str = "ijbc", batch_size: int = 64, roc_path: str | None = None):
    check_roc_path(roc_path)
    names, templates, medias, landmarks, det_scores, pairs, labels = load_meta(root, prefix)
    kinds = {1: "genuine (label 1)", 0: "impostor (label 0)"}
    lacking = [kind for value, kind in kinds.items() if not (labels == value).any()]
    if lacking:  # TAR at a FAR needs both kinds of pair
        raise ValueError(f"{os.path.join(root, 'meta', f'{prefix}_template_pair_label.txt')}: no "
                         f"{' and no '.join(lacking)} pairs, so TAR@FAR is undefined; the third column must hold both")
    feats = image_features(root, names, landmarks, backbone, batch_size) * det_scores[:, None]
    ids, tfeats = template_features(feats, templates, medias)
    scores = pair_scores(ids, tfeats, pairs)
    if roc_path:
        plot_roc(labels, scores, roc_path, title=prefix.upper())
    return tar_at_far(labels, scores)
