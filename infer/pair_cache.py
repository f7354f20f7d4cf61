"""The cache files of a pair list: what detection found in each photo, and each model's
embeddings of each photo's crop, so a second tool or a second model on the same list does not
detect (or embed) again.

Two files, beside the list unless another folder is given (`cache_paths`):
- `LIST.shardface_faces.npz`: per (photo content, detection options) the photo's size and its
  largest face (box, five points, score, dlib's shape), or that none was found. The content key
  is infer.enrolment.content_key (size and a hash of the file's ends): a photo moved or renamed
  is still found, one replaced is searched again. Every model and make_bin read it.
- `LIST.shardface_pairs.FINGERPRINT.npz`, one per model (its weights' fingerprint): per (photo
  content, the face the crop was cut from) the raw embedding of the crop and of its mirror
  image. Keying by the face's geometry, not the detection options, keeps an embedding right
  whichever options or fallback produced that face.

Entries are only ever added: a file is rewritten with its entries on disk (another run's too,
read again just before) and this run's, published atomically (utils.atomic.publishing). A file
that is not such a cache is refused by name and left alone; one of ours that cannot be read is
rebuilt with a warning."""
from __future__ import annotations

import hashlib
import json
import logging
import os

import numpy as np

from dataset.errors import DataError
from faces.detect import Face
from utils.atomic import OutputError, check_output_file, publishing

FORMAT = 1
FACES_KIND = "shardface pair-list faces"
EMBEDDINGS_KIND = "shardface pair-list embeddings"
logger = logging.getLogger("shardface")


class PairCacheError(DataError):
    """A cache path that holds something else (never overwritten): the message names it."""


class _Damaged(Exception):
    pass


def cache_paths(list_path: str, fingerprint: str | None, folder: str | None = None) -> tuple[str, str | None]:
    """(faces cache, embeddings cache of the model `fingerprint`, None without one) of a pair list,
    in `folder` (default the list file's folder, or inside a CFP root)."""
    list_path = list_path.rstrip(os.sep) or list_path
    home = list_path if os.path.isdir(list_path) else os.path.dirname(os.path.abspath(list_path))  # a CFP root's inside
    base = os.path.join(folder if folder is not None else home, os.path.basename(os.path.abspath(list_path)))
    return f"{base}.shardface_faces.npz", (f"{base}.shardface_pairs.{fingerprint}.npz" if fingerprint else None)


def content_entry(content: tuple[int, str], variant: str) -> str:
    """An entry's key: the photo's content key and what else its value depends on."""
    size, digest = content
    return f"{size}:{digest}|{variant}"


def face_key(face: Face) -> str:
    """A short hash of the face's geometry (five points, dlib's shape): what its crop is cut from."""
    digest = hashlib.sha256(np.ascontiguousarray(face.points, np.float64).tobytes())
    if face.shape is not None:
        digest.update(np.ascontiguousarray(face.shape, np.float64).tobytes())
    return digest.hexdigest()[:24]


def _read(path: str, kind: str) -> tuple[dict, dict] | None:
    """(header, arrays) of a cache file of `kind`; None where there is none; PairCacheError where
    the path holds something else; _Damaged where it is ours but unreadable."""
    if not os.path.lexists(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            header = json.loads(str(z["header"]))
            arrays = {k: z[k] for k in z.files if k != "header"}
    except Exception as exc:
        raise PairCacheError(f"{path}: exists and is not a ShardFace pair-list cache ({type(exc).__name__}: {exc}); "
                             "it is left as it is: pass another --cache_dir") from None
    if not isinstance(header, dict) or header.get("kind") not in (FACES_KIND, EMBEDDINGS_KIND):
        raise PairCacheError(f"{path}: exists and is not a ShardFace pair-list cache; it is left as it is: "
                             "pass another --cache_dir")
    if header["kind"] != kind or header.get("format") != FORMAT:
        raise _Damaged(f"a {header['kind']} file of format {header.get('format')}, not {kind} of format {FORMAT}")
    return header, arrays


def check_cache(path: str) -> None:
    """Before any work: `path` can be written, and what is there already is a cache of ours."""
    try:
        _read(path, FACES_KIND if path.endswith(".shardface_faces.npz") else EMBEDDINGS_KIND)
    except _Damaged:
        pass  # ours: rebuilt when written
    try:  # its folder takes a new file (as root, /dev/fd of a list `<(...)` passes os.access, not this)
        check_output_file(path, what="cache file")
    except OutputError as exc:
        raise OutputError(f"{exc}; pass --cache_dir DIR (a pair list read from a pipe, such as <(...), has no "
                          f"folder to keep its cache in)") from None


class _Cache:
    """Entries by key, read from `path` at start; `save` publishes them merged with whatever
    another run added to the file since (its subclass says how entries are read and written)."""
    path: str | None
    entries: dict
    added: int

    def _load(self) -> dict:
        raise NotImplementedError

    def get(self, key: str):
        return self.entries.get(key)

    def put(self, key: str, *value) -> None:
        self.entries[key] = value
        self.added += 1

    def _merged(self) -> list[str] | None:
        """The keys to write (the file's entries and this run's), or None when nothing is new."""
        if self.path is None or not self.added:
            return None
        entries = self._load()
        entries.update(self.entries)
        self.entries, self.added = entries, 0
        return list(entries)


class FacesCache(_Cache):
    """(photo content, detection options) -> (photo size (w, h), its largest face or None)."""

    def __init__(self, path: str | None):
        self.path, self.entries, self.added = path, {}, 0
        if path is not None:
            self.entries = self._load()

    def _load(self) -> dict:
        try:
            read = _read(self.path, FACES_KIND)
            return {} if read is None else self._unpack(read[1])
        except (_Damaged, KeyError, ValueError, IndexError) as exc:
            logger.warning("%s: an unreadable faces cache (%s): searching every photo again", self.path, exc)
            return {}

    @staticmethod
    def _unpack(z: dict) -> dict:
        entries = {}
        for i, key in enumerate(z["keys"].tolist()):
            size = (int(z["sizes"][i, 0]), int(z["sizes"][i, 1]))
            face = None
            if z["has_face"][i]:
                n = int(z["shape_len"][i])
                face = Face(tuple(float(v) for v in z["boxes"][i]), z["points"][i].copy(), float(z["scores"][i]),
                            z["shapes"][i, :n].copy() if n else None)
            entries[key] = (size, face)
        return entries

    def save(self) -> None:
        """Publish the entries, with any another run added to the file since it was read."""
        keys = self._merged()
        if keys is None:
            return
        entries = self.entries
        faces = [entries[k][1] for k in keys]
        longest = max([len(f.shape) for f in faces if f is not None and f.shape is not None] or [0])
        shapes = np.zeros((len(keys), longest, 2))
        for i, f in enumerate(faces):
            if f is not None and f.shape is not None:
                shapes[i, :len(f.shape)] = f.shape
        with publishing(self.path) as tmp, open(tmp, "wb") as out:
            np.savez(out, header=np.array(json.dumps({"kind": FACES_KIND, "format": FORMAT})),
                     keys=np.array(keys, dtype=str),
                     sizes=np.array([entries[k][0] for k in keys], np.int64).reshape(-1, 2),
                     has_face=np.array([f is not None for f in faces], bool),
                     boxes=np.array([f.box if f else (0.0,) * 4 for f in faces], np.float64).reshape(-1, 4),
                     points=np.array([f.points if f else np.zeros((5, 2)) for f in faces],
                                     np.float64).reshape(-1, 5, 2),
                     scores=np.array([f.score if f else 0.0 for f in faces], np.float64),
                     shape_len=np.array([len(f.shape) if f is not None and f.shape is not None else 0 for f in faces],
                                        np.int64),
                     shapes=shapes)


class EmbeddingCache(_Cache):
    """(photo content, face) -> (raw embedding of the crop, of its mirror image), for one model."""

    def __init__(self, path: str | None, model):
        self.path, self.added = path, 0
        self.header = {"kind": EMBEDDINGS_KIND, "format": FORMAT, "fingerprint": model.fingerprint,
                       "crop": model.crop_name}
        self.entries = self._load() if path is not None else {}

    def _load(self) -> dict:
        try:
            read = _read(self.path, EMBEDDINGS_KIND)
            if read is None:
                return {}
            header, z = read
            if any(header.get(k) != v for k, v in self.header.items()):
                raise _Damaged(f"made by another model or crop ({header.get('fingerprint')}, {header.get('crop')})")
            emb, flip = z["emb"], z["emb_flip"]
            if emb.shape != flip.shape or emb.ndim != 2 or len(emb) != len(z["keys"]) or not np.isfinite(emb).all() \
                    or not np.isfinite(flip).all():
                raise _Damaged(f"arrays of shapes {emb.shape}, {flip.shape} for {len(z['keys'])} entries, "
                               "or not finite")
            return {k: (emb[i], flip[i]) for i, k in enumerate(z["keys"].tolist())}
        except (_Damaged, KeyError, ValueError) as exc:
            logger.warning("%s: an unreadable embeddings cache (%s): embedding every photo again", self.path, exc)
            return {}

    def save(self) -> None:
        keys = self._merged()
        if keys is None:
            return
        entries = self.entries
        with publishing(self.path) as tmp, open(tmp, "wb") as out:
            np.savez(out, header=np.array(json.dumps(self.header)), keys=np.array(keys, dtype=str),
                     emb=np.stack([entries[k][0] for k in keys]).astype(np.float32),
                     emb_flip=np.stack([entries[k][1] for k in keys]).astype(np.float32))
