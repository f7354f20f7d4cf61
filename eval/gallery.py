"""1:N identification in a few plain functions: `enrol` a folder of people, `photo_faces` of a
query photo, `identify` them against the gallery.

A gallery folder holds one folder per person (its name is the person's name) with any number
of images, in sub-folders too. Every image is embedded (the flip test, L2-normalised, as
scripts.embed). A person is scored by their *mean template*: the L2-normalised mean of their
image embeddings, the pooling IJB templates use. So a query's score for a person is one
cosine, a person with many photos does not win by having more chances, and the search runs
over people, not images.

Without alignment every image is taken as a face crop already aligned for the model (its
template's size, or insightface's 112x112); with `align=True` faces are found and aligned in
photos by faces.detect (the largest face of each gallery image is enrolled).

Enrolment is cached in one file (default `DIR/.shardface_gallery.npz`) recording the model's
name and fingerprint, its template, the alignment and every image's path, size and mtime.
A later run reuses it: only images added or changed since are embedded, images removed are
dropped, and a change of the model's weights (same MODEL, new fingerprint) or of the
alignment embeds everything again. A file that another MODEL made is refused (its
enrolment is not overwritten by accident): `rebuild=True` replaces it. A large enrolment
shows progress and writes each chunk of embeddings to `CACHE.parts/` as it goes, so an
interrupted run resumes where it stopped."""
from __future__ import annotations

import glob
import json
import logging
import os
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from dataset import DataError
from dataset.folders import hidden, not_regular, walk_images, warn_hidden
from dataset.images import IMAGE_EXTENSIONS, decode_chw, image_size
from eval.embedder import embed_uint8
from eval.search import make_index
from faces.align import ARCFACE_112, Template
from utils.atomic import publishing
from utils.progress import Progress

CACHE_NAME = ".shardface_gallery.npz"
FORMAT = 1
logger = logging.getLogger("shardface")


class GalleryError(DataError):
    """A gallery folder, gallery file or query that cannot be used (the message names it)."""


@dataclass
class Face:
    """One face of a photo: where it is and its embedding."""
    path: str
    index: int                            # 0 = the largest face of the photo
    box: tuple[int, int, int, int]        # x0, y0, x1, y1 in photo pixels (the whole crop without alignment)
    embedding: np.ndarray                 # D, L2-normalised


@dataclass
class Gallery:
    names: list[str]        # one per person, sorted
    templates: np.ndarray   # people x D: each person's mean template
    header: dict            # what made it (model, fingerprint, template, align)
    images: int             # images enrolled


def list_gallery(folder: str) -> list[tuple[str, list[str]]]:
    """[(person, [image paths relative to folder])] sorted by name; refuses a missing or empty
    folder, images outside person folders and a person folder without images, naming them."""
    if not os.path.isdir(folder):
        raise GalleryError(f"{folder}: gallery folder not found")
    people, loose = [], []
    entries = sorted(os.listdir(folder))
    # the cache and its parts, editor files are skipped; a hidden folder holding images is named
    warn_hidden([os.path.join(folder, e) for e in entries if hidden(e) and os.path.isdir(os.path.join(folder, e))])
    for entry in entries:
        path = os.path.join(folder, entry)
        if hidden(entry):
            continue
        if os.path.isdir(path):  # a link to a folder too, as in training
            found = sorted(os.path.relpath(f, folder) for f in walk_images(path))
            if not found:
                raise GalleryError(f"{path}: person folder without images ({', '.join(IMAGE_EXTENSIONS)})")
            people.append((entry, found))
        elif entry.lower().endswith(IMAGE_EXTENSIONS):
            loose.append(entry)
    if loose:
        raise GalleryError(f"{os.path.join(folder, loose[0])}: an image outside a person folder "
                           f"({len(loose)} such); the gallery is one folder per person, named for them")
    if not people:
        raise GalleryError(f"{folder}: empty gallery; it needs one folder per person, each with their images")
    odd = not_regular([os.path.join(folder, f) for _, found in people for f in found])
    if odd is not None:
        raise odd
    return people


def _made_for(size: tuple[int, int], template: Template) -> Template | None:
    for t in (template, ARCFACE_112):
        if tuple(size) == tuple(t.size):
            return t
    return None


def check_image(path: str, template: Template, align: bool) -> None:
    """Refuse, from its header alone, a file that is not an image or (without alignment) not an
    aligned crop of a size the model takes."""
    if not os.path.isfile(path):
        raise GalleryError(f"{path}: no such image file")
    size = image_size(path, path)
    if not align and _made_for(size, template) is None:
        sizes = " or ".join(sorted({f"{t.size[1]}x{t.size[0]}" for t in (template, ARCFACE_112)}))
        raise GalleryError(f"{path}: a {size[1]}x{size[0]} image is not an aligned {sizes} face crop; "
                           f"pass --align to find and align the faces in photos")


def detect_and_align(path: str, template: Template, detector: str):
    """[(box, PIL crop on `template`)] of a photo's faces, largest first (faces.detect)."""
    from faces.detect import aligned_faces  # dlib is loaded only when faces are searched
    return [(tuple(int(round(v)) for v in face.box), crop) for face, crop in
            aligned_faces(path, template, detector=detector)]


def face_crops(path: str, template: Template, align: bool, detector: str = "hog"):
    """[(box, 3 x h x w uint8 crop, the template it is aligned to)] of one image file: every
    detected face with `align`, else the image itself as one aligned crop."""
    check_image(path, template, align)
    if align:
        try:
            found = detect_and_align(path, template, detector)
        except OSError as exc:
            raise GalleryError(f"{path}: not a readable image ({exc})") from None
        return [(box, torch.from_numpy(np.asarray(crop.convert("RGB")).copy()).permute(2, 0, 1), template)
                for box, crop in found]
    with open(path, "rb") as f:
        chw = decode_chw(f.read(), path)
    return [((0, 0, int(chw.shape[2]), int(chw.shape[1])), chw, _made_for(chw.shape[1:], template))]


def embed_crops(embedder, crops: list[tuple[torch.Tensor, Template]], batch_size: int = 64) -> np.ndarray:
    """N x D: each crop's embedding plus its mirror image's, L2-normalised, crops re-framed onto
    the embedder's template by `Embedder.from_crops`."""
    out = [None] * len(crops)
    groups: dict[str, list[int]] = {}
    for i, (_, made_for) in enumerate(crops):
        groups.setdefault(made_for.name, []).append(i)
    for rows in groups.values():  # the flip test and its checks are embed_uint8's, as in every tool
        module = embedder.for_crops(crops[rows[0]][1])
        for i, row in zip(rows, embed_uint8(torch.stack([crops[i][0] for i in rows]), module, batch_size)):
            out[i] = row
    return np.stack(out).astype(np.float32) if out else np.zeros((0, 0), np.float32)


def photo_faces(paths: list[str], embedder, align: bool, detector: str = "hog", batch_size: int = 64) -> list[Face]:
    """Every face of every photo (one per file without alignment), in order, with embeddings.
    Files are read and checked before anything is embedded."""
    found = [(path, i, box, crop, made_for) for path in paths
             for i, (box, crop, made_for) in enumerate(face_crops(path, embedder.template, align, detector))]
    emb = embed_crops(embedder, [(c, m) for *_, c, m in found], batch_size)
    return [Face(path, i, box, e) for (path, i, box, _, _), e in zip(found, emb)]


def model_header(embedder, align: bool, detector: str) -> dict:
    t = embedder.template
    return {"format": FORMAT, "model": _model_key(embedder.name), "fingerprint": embedder.fingerprint,
            "template": f"{t.name} {t.size[1]}x{t.size[0]}", "align": bool(align),
            "detector": detector if align else None}


def _model_key(name: str) -> str:
    return os.path.realpath(name) if os.path.exists(name) else name


def _stat(folder: str, rel: str) -> tuple[int, int]:
    st = os.stat(os.path.join(folder, rel))
    return st.st_size, st.st_mtime_ns


def _read_entries(path: str) -> tuple[dict, dict]:
    """(header, {(path, size, mtime): embedding or None}) of a gallery file or part."""
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            files, sizes, mtimes = z["files"].tolist(), z["sizes"].tolist(), z["mtimes"].tolist()
            has_face, emb = z["has_face"], z["embeddings"]
    except Exception as exc:  # not an npz, truncated, a key missing
        raise GalleryError(f"{path}: not a ShardFace gallery file ({exc}); delete it or pass --rebuild") from None
    entries, row = {}, 0
    for key, face in zip(zip(files, sizes, mtimes), has_face):
        entries[key] = emb[row] if face else None
        row += int(face)
    return header, entries


def _write_entries(path: str, header: dict, keys: list, embeddings: list) -> None:
    """Atomically: header, per-file (path, size, mtime, has_face) and the embeddings of faces."""
    rows = [e for e in embeddings if e is not None]
    with publishing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, header=np.array(json.dumps(header, sort_keys=True)),
                 files=np.array([k[0] for k in keys], dtype=str), sizes=np.array([k[1] for k in keys], np.int64),
                 mtimes=np.array([k[2] for k in keys], np.int64),
                 has_face=np.array([e is not None for e in embeddings], bool),
                 embeddings=np.stack(rows).astype(np.float32) if rows else np.zeros((0, 0), np.float32))


def _describe(header: dict) -> str:
    return f"{header.get('model')} (fingerprint {header.get('fingerprint')})"


def enrol(folder: str, embedder, align: bool = False, cache: str | None = None, rebuild: bool = False,
          detector: str = "hog", chunk: int = 1000, batch_size: int = 64, show_progress: bool = True) -> Gallery:
    """The gallery of `folder` under `embedder`, from its cache file where still valid (see the
    module docstring); the cache is written (atomically) when anything changed."""
    people = list_gallery(folder)
    cache = cache or os.path.join(folder, CACHE_NAME)
    parts = f"{cache}.parts"
    header = model_header(embedder, align, detector)
    known: dict = {}
    cached: set = set()  # the files the cache holds valid embeddings of
    if os.path.exists(cache) and not rebuild:
        old, entries = _read_entries(cache)
        if old.get("model") != header["model"]:
            raise GalleryError(f"{cache}: this gallery file was enrolled with model {_describe(old)}, not "
                               f"{_describe(header)}; pass --rebuild to enrol {folder} again with this model, "
                               f"or --cache FILE to keep a second gallery file")
        if all(old.get(k) == header[k] for k in header):
            known.update(entries)
            cached = set(entries)
        else:
            changed = [k for k in ("fingerprint", "template", "align", "detector") if old.get(k) != header[k]]
            logger.warning("%s: the model's %s changed since enrolment: enrolling every image again", cache,
                           " and ".join(changed))
    if rebuild and os.path.isdir(parts):
        shutil.rmtree(parts)
    for part in sorted(glob.glob(os.path.join(parts, "part-*.npz"))):  # an interrupted run's chunks
        old, entries = _read_entries(part)
        if old == header:
            known.update(entries)

    listing = [(person, rel, *_stat(folder, rel)) for person, files in people for rel in files]
    keys = [(rel, size, mtime) for _, rel, size, mtime in listing]
    pending = [k for k in keys if k not in known]
    for rel, _, _ in pending:  # every header before the first embedding
        check_image(os.path.join(folder, rel), embedder.template, align)
    if pending:
        os.makedirs(parts, exist_ok=True)
        first = len(glob.glob(os.path.join(parts, "part-*.npz")))
        progress = Progress(len(pending), "enrolling") if show_progress else None
        for n, start in enumerate(range(0, len(pending), chunk)):
            batch = pending[start:start + chunk]
            found = [face_crops(os.path.join(folder, rel), embedder.template, align, detector)[:1]
                     for rel, _, _ in batch]
            emb = iter(embed_crops(embedder, [(c, m) for faces in found for _, c, m in faces], batch_size))
            rows = [next(emb) if faces else None for faces in found]
            _write_entries(os.path.join(parts, f"part-{first + n:06d}.npz"), header, batch, rows)
            known.update(zip(batch, rows))
            if progress is not None:
                progress.update(len(batch))
    no_face = [k[0] for k in keys if known[k] is None]
    if no_face:
        logger.warning("%s: no face found in %d images, left out (e.g. %s)", folder, len(no_face),
                       ", ".join(no_face[:3]))
    gallery = _pool(people, keys, known, header)
    if cached != set(keys):  # files added, changed or removed, or a new model
        _write_entries(cache, header, keys, [known[k] for k in keys])
    if os.path.isdir(parts):
        shutil.rmtree(parts)
    return gallery


def _pool(people, keys, known, header) -> Gallery:
    names, templates, row = [], [], 0
    for person, files in people:
        faces = [known[k] for k in keys[row:row + len(files)] if known[k] is not None]
        row += len(files)
        if not faces:
            raise GalleryError(f"{person}: no face found in any of their {len(files)} images")
        mean = np.mean(faces, axis=0)
        names.append(person)
        templates.append(mean / max(np.linalg.norm(mean), 1e-12))
    return Gallery(names, np.stack(templates).astype(np.float32), header, len(keys))


def identify(gallery: Gallery, queries: np.ndarray, k: int = 1, engine: str = "faiss"):
    """(scores, person indices), Q x k, best first (eval.search's order; -1 beyond the gallery)."""
    index = make_index(gallery.templates.shape[1], engine)
    index.add(gallery.templates)
    return index.search(queries, k)
