"""IJB-B / IJB-C 1:1 verification (template-based TAR at fixed FAR).

Layout under `root`: meta/<prefix>_face_tid_mid.txt (image, template, media),
meta/<prefix>_template_pair_label.txt (template 1, template 2, label),
meta/<prefix>_name_5pts_score.txt (image, 10 landmark coordinates, detector score),
loose_crop/<images>. Each face is aligned to the 112x112 ArcFace template by a 5-point
similarity transform; its feature is the embedding of the face plus that of its mirror image,
weighted by the detector score; images of one media are averaged, media of one template
summed, templates L2-normalised; pair scores are cosine similarities; TAR at each FAR is the
highest true accept rate whose false accept rate does not exceed it.

A wrong root, a missing meta file or face image (IJBFileNotFound), and a malformed meta line
(DataError, naming the file, line and field) are each one error, before any face is embedded
where the meta files can tell.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image, ImageDraw
from sklearn.metrics import roc_curve

from shardface.dataset.errors import DataError
from shardface.errors import UserError
from shardface.faces.detect import Face
from shardface.infer.model import as_model
from shardface.utils.atomic import publishing
from shardface.utils.outputs import check_output_file

FAR_LEVELS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


class IJBFileNotFound(UserError, FileNotFoundError):
    """An IJB directory, meta file or face image that is not there (the message names it)."""


def meta_folder(root: str) -> str:
    """`root`/meta, or an IJBFileNotFound naming what is missing (a wrong --root, before any work)."""
    if not os.path.isdir(root):
        raise IJBFileNotFound(f"--root {root}: IJB directory not found (it holds meta/ and loose_crop/)")
    meta = os.path.join(root, "meta")
    if not os.path.isdir(meta):
        raise IJBFileNotFound(
            f"--root {root}: no meta/ folder in it; --root is the IJB directory that holds "
            f"meta/ and loose_crop/ (e.g. IJB_release/IJBC)"
        )
    return meta


def _finite(value: str) -> float:
    number = float(value)
    if not np.isfinite(number):
        raise ValueError(value)
    return number


def _read_rows(path: str, min_fields: int) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank line, each with at least `min_fields` fields."""
    if not os.path.isfile(path):
        raise IJBFileNotFound(f"{path}: IJB meta file not found")
    rows = []
    try:
        with open(path, encoding="utf-8-sig") as f:  # a BOM is not part of the first name
            for lineno, line in enumerate(f, 1):
                fields = line.split()
                if not fields:
                    continue
                if len(fields) < min_fields:
                    raise DataError(f"{path}:{lineno}: expected {min_fields} fields, got {len(fields)}")
                rows.append((lineno, fields))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read this IJB meta file ({exc})") from None
    return rows


def _columns(path: str, rows, kinds: tuple, what: str) -> list[list]:
    """Each row's first len(kinds) fields converted by `kinds` (int, _finite, str); a field that
    does not convert is a DataError naming the file, line and field."""
    out = []
    for lineno, fields in rows:
        row = []
        for i, (kind, value) in enumerate(zip(kinds, fields)):
            try:
                row.append(kind(value))
            except ValueError:
                expected = {int: "a whole number", _finite: "a finite number"}.get(kind, "a value")
                problem = f"field {i + 1} is {value!r}, not {expected} (a line is {what})"
                raise DataError(f"{path}:{lineno}: {problem}") from None
        out.append(row)
    return out


def read_faces(root: str, prefix: str):
    """(image names, templates, medias, N x 5 x 2 landmarks, detector scores) of the meta files
    <prefix>_face_tid_mid.txt and <prefix>_name_5pts_score.txt, which list the same images."""
    meta = meta_folder(root)
    path = os.path.join(meta, f"{prefix}_face_tid_mid.txt")
    faces = _columns(path, _read_rows(path, 3), (str, int, int), "`image template media`")
    marks_path = os.path.join(meta, f"{prefix}_name_5pts_score.txt")
    marks = _columns(
        marks_path,
        _read_rows(marks_path, 12),
        (str,) + (_finite,) * 11,
        "`image`, 10 landmark coordinates and the detector score",
    )
    if [r[0] for r in faces] != [r[0] for r in marks]:
        raise DataError(
            f"{meta}: {os.path.basename(path)} and {os.path.basename(marks_path)} list different images"
        )
    return (
        [r[0] for r in faces],
        np.array([r[1] for r in faces], np.int64),
        np.array([r[2] for r in faces], np.int64),
        np.array([r[1:11] for r in marks], np.float64).reshape(-1, 5, 2),
        np.array([r[11] for r in marks], np.float64),
    )


def load_meta(root: str, prefix: str):
    names, templates, medias, landmarks, scores = read_faces(root, prefix)
    path = os.path.join(root, "meta", f"{prefix}_template_pair_label.txt")
    rows = _read_rows(path, 3)
    pairs = _columns(path, rows, (int, int, int), "`template1 template2 label`")
    known = set(templates.tolist())
    for (lineno, _), (a, b, label) in zip(rows, pairs):
        if label not in (0, 1):
            raise DataError(f"{path}:{lineno}: label {label}, expected 1 (genuine) or 0 (impostor)")
        unknown = next((t for t in (a, b) if t not in known), None)
        if unknown is not None:  # found here, before any face is embedded
            raise DataError(f"{path}:{lineno}: template {unknown} has no faces in {prefix}_face_tid_mid.txt")
    return (
        names,
        templates,
        medias,
        landmarks,
        scores,
        np.array([[a, b] for a, b, _ in pairs], np.int64).reshape(-1, 2),
        np.array([label for _, _, label in pairs], np.int64),
    )


def image_features(root: str, names, landmarks, backbone, batch_size: int = 64) -> np.ndarray:
    """Embedding of each face aligned at its landmarks plus that of its mirror image, through the
    face stream (infer.stream: the faces given, not searched)."""
    paths = [os.path.join(root, "loose_crop", name) for name in names]
    missing = next((p for p in paths if not os.path.isfile(p)), None)
    if missing is not None:  # before any work
        raise IJBFileNotFound(f"{missing}: face image not found (listed in the meta files)")
    faces = [[Face((0.0, 0.0, 0.0, 0.0), np.asarray(marks, np.float64), float("nan"))] for marks in landmarks]
    rows = [
        photo.face.embedding.sum(0)
        for photo in as_model(backbone).analyse(paths, faces=faces, batch_size=batch_size, raw=True)
    ]
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
        raise DataError(f"pair file names template {exc.args[0]} that has no faces") from None
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

    def to_xy(f, t):
        return (pad + (np.log10(max(f, 1e-6)) - lo) / (hi - lo) * (w - 2 * pad), h - pad - t * (h - 2 * pad))

    d.rectangle([pad, pad, w - pad, h - pad], outline="black")
    for e in range(-6, 1):
        x, _ = to_xy(10.0**e, 0)
        d.line([x, h - pad, x, h - pad + 5], fill="black")
        d.text((x - 12, h - pad + 8), f"1e{e}", fill="black")
    for t in np.linspace(0, 1, 6):
        _, y = to_xy(1e-6, t)
        d.text((10, y - 6), f"{t:.1f}", fill="black")
    d.line([to_xy(f, t) for f, t in zip(fpr, tpr)], fill="blue", width=2)
    d.text((pad, 20), f"{title} (x: FAR, log scale; y: TAR)", fill="black")
    with publishing(path) as tmp:  # atomically, like every tool output
        img.save(tmp, format="PNG")


def check_roc_path(path: str | None, overwrite: bool = False) -> None:
    """Refuse an ROC path that cannot be written, before any image is embedded: the output rule
    of every tool (utils.outputs.check_output_file, as identify_eval's --plot): its folder exists,
    it is not a folder, an existing file is replaced only with `overwrite`."""
    if path:
        check_output_file(path, overwrite=overwrite, what="--roc")


def evaluate_ijb(
    root: str,
    backbone,
    prefix: str = "ijbc",
    batch_size: int = 64,
    roc_path: str | None = None,
    overwrite: bool = False,
):
    """TAR at each of FAR_LEVELS; with `roc_path`, its ROC plot written there (an existing file
    replaced only with `overwrite`)."""
    check_roc_path(roc_path, overwrite)
    names, templates, medias, landmarks, det_scores, pairs, labels = load_meta(root, prefix)
    kinds = {1: "genuine (label 1)", 0: "impostor (label 0)"}
    lacking = [kind for value, kind in kinds.items() if not (labels == value).any()]
    if lacking:  # TAR at a FAR needs both kinds of pair
        raise DataError(
            f"{os.path.join(root, 'meta', f'{prefix}_template_pair_label.txt')}: no "
            f"{' and no '.join(lacking)} pairs, so TAR@FAR is undefined; the third column must hold both"
        )
    feats = image_features(root, names, landmarks, backbone, batch_size) * det_scores[:, None]
    ids, tfeats = template_features(feats, templates, medias)
    scores = pair_scores(ids, tfeats, pairs)
    if roc_path:
        plot_roc(labels, scores, roc_path, title=prefix.upper())
    return tar_at_far(labels, scores)
