"""1:N identification in a few plain functions: `enrol` a folder of people, `embedded_faces` of
query photos (infer.stream), `identify` them against the gallery (docs/identification.md).

A gallery folder holds one folder per person, named for them. A person is scored by their mean
template (the L2-normalised mean of their images' embeddings, as IJB pools), so the search runs
over people and a person with many photos has no more chances. Enrolment is cached in one file
per gallery and weights (`.shardface_gallery.npz`, `.no_ema.npz`) that records what made it
(model, fingerprint, template, alignment, face options) and each image's content key: a later
run embeds only what changed, says why it embeds everything again, refuses another MODEL's file
(`rebuild` replaces it) and re-enrols a damaged one. A long enrolment saves parts every
`save_every_s` seconds, one folder per process under `CACHE.parts/`, and resumes from them."""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

import numpy as np

from dataset import DataError
from dataset.errors import ImageDecodeError
from dataset.fingerprint import file_ends
from dataset.folders import hidden, not_regular, walk_images, warn_hidden
from dataset.images import IMAGE_EXTENSIONS, image_size
from faces.align import ARCFACE_112, Template
from faces.photos import no_face_message
from infer.search import make_index
from infer.stream import analyse, template_for
from utils.atomic import check_output_file, host_name, process_alive, publishing
from utils.progress import Progress

CACHE_NAME = ".shardface_gallery.npz"
RAW_CACHE_NAME = ".shardface_gallery.no_ema.npz"
FORMAT = 2                # 2: images keyed by content hash, face options recorded
HASH_BLOCK = 1 << 16      # the bytes hashed at each end of an image
SAVE_EVERY_S = 30.0       # a killed enrolment loses at most this much work (and one batch)
COLLAPSED = 0.99          # mean cosine between different people's templates above which we warn
logger = logging.getLogger("shardface")


class GalleryError(DataError):
    """A gallery folder, gallery file or query that cannot be used (the message names it)."""


class _Damaged(Exception):
    """A gallery file whose header is ours but whose arrays cannot be trusted (the reason)."""


@dataclass
class EmbeddedFace:
    """One face found in a photo (or a crop file's one face): where it is and its embedding."""
    path: str
    index: int                            # 0 = the largest face of the photo
    box: tuple[int, int, int, int]        # x0, y0, x1, y1 in photo pixels (the whole crop without alignment)
    embedding: np.ndarray                 # D, L2-normalised


@dataclass
class Enrolment:
    names: list[str]        # one per person, sorted
    templates: np.ndarray   # people x D: each person's mean template
    header: dict            # what made it (model, fingerprint, template, align, face options)
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
            if any(c in entry for c in "\n\r"):  # it would forge a line of identify's output
                raise GalleryError(f"{path!r}: a person's name with a line break cannot be printed one answer "
                                   "a line; rename the folder")
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


def check_image(path: str, template: Template, align: bool) -> None:
    """Refuse, from its header alone, a file that is not an image or (without alignment) not an
    aligned crop of a size the model takes."""
    if not os.path.isfile(path):
        raise GalleryError(f"{path}: no such image file")
    size = image_size(path, path)
    if not align and template_for(size, template) is None:
        sizes = " or ".join(sorted({f"{t.size[1]}x{t.size[0]}" for t in (template, ARCFACE_112)}))
        raise GalleryError(f"{path}: a {size[1]}x{size[0]} image is not an aligned {sizes} face crop; "
                           f"pass --align to find and align the faces in photos")


def embedded_faces(paths: list[str], model, align: bool, batch_size: int = 64, workers: int = 1,
                   largest_only: bool = False, show_progress: bool = False) -> list[EmbeddedFace]:
    """Every face (or the largest) of every photo (one per file without alignment), in order, with
    embeddings (infer.stream). Files are read and checked before anything is embedded; then a
    batch is embedded as soon as its crops are back, so memory holds one batch, not the folder."""
    for path in paths:
        check_image(path, model.template, align)
    progress = Progress(len(paths), "finding and embedding faces" if align else "embedding").update \
        if show_progress and len(paths) > batch_size else None
    out = []
    for photo in _analysed(model, paths, align, workers, largest_only, batch_size, progress):
        out += [EmbeddedFace(photo.name, i, tuple(int(round(v)) for v in face.box), face.embedding)
                for i, face in enumerate(photo.faces) if face.embedding is not None]
    return out


def _analysed(model, paths, align, workers, largest_only, batch_size, progress):
    """infer.stream.analyse, an unreadable image named as a GalleryError."""
    try:
        yield from analyse(model, paths, workers, largest_only=largest_only, align=align, batch_size=batch_size,
                           progress=progress)
    except ImageDecodeError as exc:
        raise GalleryError(str(exc)) from None


def refuse_faceless(paths: list[str], faces: list[EmbeddedFace], model) -> None:
    """--strict: a photo in which no face was found is refused, naming it."""
    seen = {f.path for f in faces}
    missing = [p for p in paths if p not in seen]
    if missing:
        raise GalleryError(f"{no_face_message(missing, len(paths), model.detection)}; --strict refuses them")


def default_cache(folder: str, ema: bool = True) -> str:
    """The gallery file of `folder`: one for the EMA weights (the default), one for the raw ones."""
    return os.path.join(folder, CACHE_NAME if ema else RAW_CACHE_NAME)


def model_header(model, align: bool) -> dict:
    """What a gallery file records of how its embeddings were made."""
    return {"format": FORMAT, "model": _model_key(model.name), "fingerprint": model.fingerprint,
            "ema": bool(model.ema), "template": model.crop_name if align else _crops_name(model.template),
            "align": bool(align), "detection": dataclasses.asdict(model.detection) if align else None}


def _crops_name(t: Template) -> str:
    return f"{t.name} {t.size[1]}x{t.size[0]}"


def _model_key(name: str) -> str:
    return os.path.realpath(name) if os.path.exists(name) else name


def content_key(path: str) -> tuple[int, str]:
    """(size, a hash of the size and the first and last HASH_BLOCK bytes: the whole of a file
    up to twice that): the cache's key for an image, whatever its mtime says."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return size, hashlib.sha256(str(size).encode() + file_ends(fd, size, HASH_BLOCK)).hexdigest()[:32]
    finally:
        os.close(fd)


def check_cache(path: str) -> None:
    """Before any work: `path` can be a gallery file (a file in an existing directory), and if
    something is there it is a ShardFace gallery file, so replacing it destroys nothing else."""
    if not os.path.isfile(path):  # a directory, a device, or nothing yet: it must be writable there
        check_output_file(path, what="gallery file")
    else:  # an up-to-date gallery file is only read: a read-only gallery folder is fine
        _read_header(path)


def _read_header(path: str) -> dict:
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
    except Exception as exc:  # not an npz, truncated, no header: not ours, so never replaced
        raise GalleryError(f"{path}: exists and is not a ShardFace gallery file ({type(exc).__name__}: {exc}); "
                           f"it is left as it is: pass another --cache FILE") from None
    if not isinstance(header, dict) or "model" not in header:
        raise GalleryError(f"{path}: exists and is not a ShardFace gallery file (no model in its header); "
                           f"it is left as it is: pass another --cache FILE")
    return header


def _read_entries(path: str, width: int) -> dict:
    """{(path, size, content hash): embedding or None} of a gallery file or part whose header
    matched; _Damaged (the reason) when its arrays are not one `width`-wide, finite, unit row
    per enrolled face."""
    try:
        with np.load(path, allow_pickle=False) as z:
            files, sizes, hashes = z["files"], z["sizes"], z["hashes"]
            has_face, emb = z["has_face"], z["embeddings"]
    except Exception as exc:
        raise _Damaged(f"unreadable ({type(exc).__name__}: {exc})") from None
    n = len(files)
    if any(a.shape != (n,) for a in (files, sizes, hashes, has_face)) or has_face.dtype != bool:
        raise _Damaged(f"its per-image arrays disagree ({n} files, {sizes.shape} sizes, {hashes.shape} hashes, "
                       f"{has_face.shape} face flags)")
    faces = int(has_face.sum())
    if emb.ndim != 2 or emb.shape[0] != faces or (faces and emb.shape[1] != width):
        raise _Damaged(f"{emb.shape} embeddings for {faces} faces of the model's width {width}")
    if not np.isfinite(emb).all():
        raise _Damaged(f"{int((~np.isfinite(emb).all(1)).sum())} embeddings are not finite (NaN or inf)")
    norms = np.linalg.norm(emb, axis=1)
    if faces and np.abs(norms - 1).max() > 1e-3:
        raise _Damaged(f"{int((np.abs(norms - 1) > 1e-3).sum())} embeddings are not of unit length")
    entries, row = {}, 0
    for key, face in zip(zip(files.tolist(), sizes.tolist(), hashes.tolist()), has_face.tolist()):
        entries[key] = emb[row] if face else None
        row += int(face)
    return entries


def _write_entries(path: str, header: dict, keys: list, embeddings: list) -> None:
    """Atomically: header, per-file (path, size, content hash, has_face) and the embeddings of faces."""
    rows = [e for e in embeddings if e is not None]
    with publishing(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, header=np.array(json.dumps(header, sort_keys=True)),
                 files=np.array([k[0] for k in keys], dtype=str), sizes=np.array([k[1] for k in keys], np.int64),
                 hashes=np.array([k[2] for k in keys], dtype=str),
                 has_face=np.array([e is not None for e in embeddings], bool),
                 embeddings=np.stack(rows).astype(np.float32) if rows else np.zeros((0, 0), np.float32))


def _describe(header: dict) -> str:
    return f"{header.get('model')} (fingerprint {header.get('fingerprint')})"


def _weights(header: dict) -> str:
    return "EMA" if header.get("ema", True) else "raw (--no_ema)"


def changes(old: dict, new: dict) -> list[str]:
    """What differs between the enrolment `old` and `new` that changes the embeddings, in words."""
    said = []
    if old.get("format") != new["format"]:
        said.append(f"the gallery file's format ({old.get('format')}, now {new['format']})")
    if old.get("fingerprint") != new["fingerprint"]:
        if old.get("ema", True) != new["ema"]:
            said.append(f"the weights chosen ({_weights(old)}, now {_weights(new)})")
        else:
            said.append(f"the model's weights (fingerprint {old.get('fingerprint')}, now {new['fingerprint']})")
    if old.get("template") != new["template"]:
        said.append(f"the template ({old.get('template')}, now {new['template']})")
    if old.get("align") != new["align"]:
        said.append("the alignment (--align now " + ("given)" if new["align"] else "left out)"))
    elif new["align"] and old.get("detection") != new["detection"]:
        was = old.get("detection") or {}
        said.append("the face options (" + ", ".join(f"--{k} {was.get(k)}, now {v}" for k, v in
                                                     new["detection"].items() if was.get(k) != v) + ")")
    return said


def _part_folders(parts: str) -> list[tuple[str, bool]]:
    """[(folder, its process is gone)] of the per-process folders under `parts`."""
    out = []
    for folder in sorted(glob.glob(os.path.join(glob.escape(parts), "*-*"))):
        host, _, pid = os.path.basename(folder).rpartition("-")
        out.append((folder, host == host_name() and pid.isdigit() and not process_alive(int(pid))))
    return out


def _resume(parts: str, header: dict, width: int) -> dict:
    """The entries saved by interrupted (or running) enrolments of the same model and options."""
    known = {}
    for part in sorted(glob.glob(os.path.join(glob.escape(parts), "*-*", "part-*.npz"))):
        try:
            if _read_header(part) == header:
                known.update(_read_entries(part, width))
        except (GalleryError, _Damaged, FileNotFoundError) as exc:  # a run that just finished removed it
            logger.debug("%s: not resumed (%s)", part, exc)
    return known


def enrol(folder: str, model, align: bool = False, cache: str | None = None, rebuild: bool = False,
          batch_size: int = 64, show_progress: bool = True,
          strict: bool = False, save_every_s: float = SAVE_EVERY_S, workers: int = 1) -> Enrolment:
    """The gallery of `folder` under `model`, from its cache file where still valid (see the
    module docstring); the cache is written (atomically) when anything changed. `strict`: a
    gallery image without a face is refused (after the enrolment is saved)."""
    people = list_gallery(folder)
    cache = cache or default_cache(folder, model.ema)
    check_cache(cache)
    parts = f"{cache}.parts"
    header = model_header(model, align)
    known: dict = {}
    cached: set = set()  # the files the cache holds valid embeddings of
    width = None
    if os.path.exists(cache):
        old = _read_header(cache)
        if old.get("model") != header["model"] and not rebuild:
            raise GalleryError(f"{cache}: this gallery file was enrolled with model {_describe(old)}, not "
                               f"{_describe(header)}; pass --rebuild to enrol {folder} again with this model, "
                               f"or --cache FILE to keep a second gallery file")
        said = changes(old, header)
        if said and not rebuild:
            logger.warning("%s: %s changed since enrolment: enrolling every image again", cache, " and ".join(said))
        elif not rebuild:
            width = model.dim
            try:
                known.update(_read_entries(cache, width))
                cached = set(known)
            except _Damaged as exc:
                logger.warning("%s: a damaged gallery file (%s): enrolling every image again", cache, exc)
    if not rebuild and os.path.isdir(parts):
        known.update(_resume(parts, header, width or model.dim))

    listing = [(rel, os.path.join(folder, rel)) for _, files in people for rel in files]
    keys = [(rel, *content_key(path)) for rel, path in listing]
    pending = [k for k in keys if k not in known]
    for rel, _, _ in pending:  # every header before the first embedding
        check_image(os.path.join(folder, rel), model.template, align)
    own = os.path.join(parts, f"{host_name()}-{os.getpid()}")
    if pending:
        _embed_pending(folder, model, align, header, pending, known, own, batch_size, save_every_s,
                       Progress(len(pending), "enrolling") if show_progress else None, workers)
    no_face = [k[0] for k in keys if known[k] is None]
    if cached != set(keys):  # files added, changed or removed, or a new model: saved before any refusal
        _write_entries(cache, header, keys, [known[k] for k in keys])
    _clean_parts(parts, own)
    gallery = _pool(people, keys, known, header)
    if no_face:
        message = no_face_message([os.path.join(folder, f) for f in no_face], len(keys), model.detection)
        if strict:
            raise GalleryError(f"{message}; --strict refuses them (the enrolment is saved in {cache})")
        logger.warning("%s; left out of the gallery", message)
    warn_if_collapsed(gallery, cache)
    return gallery


def _embed_pending(folder, model, align, header, pending, known, own, batch_size, save_every_s, progress,
                   workers=1):
    """Embed the `pending` images into `known`, saving what is new in `own` every `save_every_s` s;
    faces are found on `workers` processes while the batch before is embedded."""
    new_keys, new_rows, saved, last = [], [], 0, time.monotonic()
    photos = _analysed(model, [os.path.join(folder, rel) for rel, _, _ in pending], align, workers, True, batch_size,
                       progress and progress.update)
    for n, (key, photo) in enumerate(zip(pending, photos), 1):
        row = photo.face.embedding if photo.face is not None else None
        known[key] = row
        new_keys.append(key)
        new_rows.append(row)
        if time.monotonic() - last >= save_every_s and n < len(pending):
            os.makedirs(own, exist_ok=True)
            _write_entries(os.path.join(own, f"part-{saved:06d}.npz"), header, new_keys, new_rows)
            new_keys, new_rows, saved, last = [], [], saved + 1, time.monotonic()


def _clean_parts(parts: str, own: str) -> None:
    """Remove this process's saved parts and those of processes that are gone (all now in the
    cache, or of another model), never a live run's; then `parts` itself if empty."""
    for folder, dead in _part_folders(parts):
        if dead or folder == own:
            shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(parts)


def _pool(people, keys, known, header) -> Enrolment:
    names, templates, row = [], [], 0
    for person, files in people:
        faces = [known[k] for k in keys[row:row + len(files)] if known[k] is not None]
        row += len(files)
        if not faces:
            raise GalleryError(f"{person}: no face found in any of their {len(files)} images")
        mean = np.mean(faces, axis=0)
        names.append(person)
        templates.append(mean / max(np.linalg.norm(mean), 1e-12))
    return Enrolment(names, np.stack(templates).astype(np.float32), header, len(keys))


def mean_cross_cosine(templates: np.ndarray) -> float:
    """The mean cosine between the templates of different people (unit rows): from the norm of
    their sum, |sum t|^2 = n + sum over pairs i != j of t_i . t_j, so O(n D), not O(n^2 D)."""
    n = len(templates)
    total = templates.astype(np.float64).sum(0)
    return float((total @ total - n) / (n * (n - 1)))


def warn_if_collapsed(gallery: Enrolment, where: str) -> None:
    """One warning when the templates of different people are nearly the same direction: every
    query would score alike for everyone (a collapsed or untrained model)."""
    if len(gallery.names) < 2:
        return
    mean = mean_cross_cosine(gallery.templates)
    if mean > COLLAPSED:
        logger.warning("%s: the %d people's templates are nearly identical (mean cosine %.4f between different "
                       "people): this model does not tell them apart, so its answers mean nothing (a collapsed "
                       "or untrained model?)", where, len(gallery.names), mean)


def identify(gallery: Enrolment, queries: np.ndarray, k: int = 1, engine: str = "auto", device="cpu"):
    """(scores, person indices), Q x min(k, people), best first (infer.search's order). `engine`
    "auto" takes the faster for this gallery's size and number of queries, on `device` (a
    model's GPU: ours there)."""
    index = make_index(gallery.templates.shape[1], engine, size=len(gallery.templates), queries=len(queries),
                       device=device)
    index.add(gallery.templates)
    return index.search(queries, k)
