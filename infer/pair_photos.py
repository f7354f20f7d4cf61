"""The photos of a pair list, each given one face, and each model's embeddings of them: the one
place that decides a photo's face, for scripts.make_bin (112x112 crops in a .bin) and
scripts.verify (each model's own crop), so both score the same faces (docs/export.md).

A pair protocol keeps every pair (dropping those of photos without a face flatters the score):
each photo is searched once under the tools' face options, those without a face again by the
`Retries` asked for, and one still without is cut at a fallback face (faces.fallback) and named.
Both are cached (infer.cache) beside the list, or in `cache_paths`' folder: the faces, for every
model, in `LIST.shardface_faces.sqlite` (`FacesCache`); each model's embeddings, keyed by the face
cut (right whichever search found it), in `LIST.shardface_pairs.FINGERPRINT.sqlite` (`EmbeddingCache`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np

from shardface.dataset.errors import DataError
from shardface.dataset.shares import Ranks, share_of
from shardface.faces.detect import Detection, Face
from shardface.faces.fallback import Fallback
from shardface.faces.stream import stream
from shardface.infer.cache import Cache, content_key
from shardface.infer.stream import analyse
from shardface.utils.progress import progress_bar

SHOWN = 20  # photos named in a report


class FacesCache(Cache):
    """(photo content, face options) -> its size and largest face, as one JSON record (`_row`)."""

    kind = "shardface pair-list faces"
    what = "pair-list cache file"
    hint = "pass --cache_dir DIR"
    redo = "searching every photo again"

    def __init__(self, path: str | None):
        super().__init__(path, {}, None)


class EmbeddingCache(Cache):
    """(photo content, face) -> one model's raw embeddings of the crop and of its mirror, 2 x D."""

    kind = "shardface pair-list embeddings"
    what = FacesCache.what
    hint = FacesCache.hint
    redo = "embedding every photo again"

    def __init__(self, path: str | None, model):
        super().__init__(path, {"fingerprint": model.fingerprint, "crop": model.crop_name}, (2, model.dim))


def cache_paths(list_path: str, fingerprint: str | None, folder: str | None = None) -> tuple[str, str | None]:
    """(faces cache, embeddings cache of the model `fingerprint`, None without one) of a pair list,
    in `folder` (default the list file's folder, or inside a CFP root)."""
    list_path = list_path.rstrip(os.sep) or list_path
    home = list_path if os.path.isdir(list_path) else os.path.dirname(os.path.abspath(list_path))
    base = os.path.join(folder if folder is not None else home, os.path.basename(os.path.abspath(list_path)))
    return f"{base}.shardface_faces.sqlite", (
        f"{base}.shardface_pairs.{fingerprint}.sqlite" if fingerprint else None
    )


def check_cache(path: str) -> None:
    """Before any work: `path` (of `cache_paths`) holds that cache or nothing, and can be written."""
    (FacesCache if path.endswith(".shardface_faces.sqlite") else EmbeddingCache).check(path, write=True)


def _row(size: tuple[int, int], face: Face | None) -> dict:
    return {"size": list(size), "face": None if face is None else face.to_dict()}


def _face(row: dict) -> tuple[tuple[int, int], Face | None]:
    return tuple(row["size"]), None if row["face"] is None else Face.from_dict(row["face"])


@dataclass(frozen=True)
class Retries:
    """Searches again of the photos where no face was found: the same detector with `upsample`
    doublings (None: not tried), then dlib's CNN (MMOD) detector (`mmod`)."""

    upsample: int | None = None
    mmod: bool = False

    def searches(self, detection: Detection) -> list[tuple[str, Detection]]:
        """[(the option, the Detection it searches with)], in the order they are tried."""
        out = []
        if self.upsample is not None:
            out.append(
                (f"--retry_upsample {self.upsample}", dataclasses.replace(detection, upsample=self.upsample))
            )
        if self.mmod:
            out.append(("--retry_mmod", dataclasses.replace(detection, detector="mmod")))
        return out


@dataclass
class PairFaces:
    """Every photo's face: its largest detected one, or its fallback."""

    faces: dict[str, Face]
    content: dict[str, str]  # each photo's content key (infer.cache.content_key)
    fallbacks: list[str]  # photos given the fallback face, in order
    recovered: list[tuple[str, int, int]]  # (retry option, photos it found a face in, photos it searched)
    searched: int  # photo searches run now (the rest came from the cache)

    def report(self, pairs: list[tuple[str, str]]) -> list[str]:
        """Lines counting the searches the cache answered and what the retries recovered, naming fallbacks."""
        cached = len(self.faces) + sum(tried for _, _, tried in self.recovered) - self.searched
        lines = [f"faces: {self.searched} photo searches run, {cached} answered by the cache"]
        lines += [
            f"{option}: a face found in {found} of the {tried} photos searched again"
            for option, found, tried in self.recovered
        ]
        if self.fallbacks:
            fallback, tried = set(self.fallbacks), {option.split()[0] for option, _, _ in self.recovered}
            untried = [o for o in ("--retry_upsample N", "--retry_mmod") if o.split()[0] not in tried]
            lines.append(
                f"no face found in {len(self.fallbacks)} of {len(self.faces)} photos (in "
                f"{sum(a in fallback or b in fallback for a, b in pairs)} of {len(pairs)} pairs): each is "
                "cut at a fallback face, the set's median face at its place and scale in the photo"
                + (f" ({' or '.join(untried)} may find more)" if untried else "")
                + ":"
            )
            lines += [f"  {p}" for p in self.fallbacks[:SHOWN]]
            lines += [f"  and {len(self.fallbacks) - SHOWN} more"] if len(self.fallbacks) > SHOWN else []
        return lines


def _search(
    photos: list[str],
    detection: Detection,
    content: dict,
    cache: FacesCache,
    label: str,
    show_progress: bool,
    workers: int,
    ranks: Ranks,
) -> tuple[dict[str, tuple[tuple[int, int], Face | None]], int]:
    """({photo: (its size, its largest face or None)}, searches run) under `detection`, on `workers`.
    Among ranks, rank 0's cache decides what is searched, each rank searches its share of that, and
    every rank returns rank 0's answer."""
    options = json.dumps(dataclasses.asdict(detection), sort_keys=True)
    keys = {p: f"{content[p]}|{options}" for p in photos}
    todo = ranks.gathered([p for p in photos if keys[p] not in cache])[0]
    share = share_of(len(todo), ranks.rank, ranks.world)
    mine = todo[share.start : share.end]

    def work() -> list[dict]:
        shown = show_progress and bool(mine) and ranks.rank == 0
        with progress_bar(len(mine), label, shown=shown) as bar:
            for p, photo in zip(mine, stream(mine, detection, workers=workers, progress=bar.update)):
                cache.put(keys[p], _row(photo.size, photo.face))  # kept as it goes: see pair_faces
        return [cache.get(keys[p]) for p in mine]

    searched = ranks.outcome(work)
    for p, row in zip(todo, (row for rows in searched for row in rows)) if ranks.world > 1 else ():
        cache.put(keys[p], row)
    found = {p: _face(cache.get(keys[p])) for p in photos} if ranks.rank == 0 else None
    return ranks.gathered(found)[0], len(todo)


def pair_faces(
    photos: list[str],
    detection: Detection = Detection(),
    retries: Retries = Retries(),
    cache: FacesCache | None = None,
    strict: bool = False,
    show_progress: bool = True,
    workers: int = 1,
    ranks: Ranks = Ranks(),
) -> PairFaces:
    """Each photo's face (see the module docstring); `strict` refuses photos without one instead
    of giving them the fallback. Unreadable photos are an ImageDecodeError naming them. Under
    torchrun, `ranks` share each search (`_search`), and every rank returns the same faces."""
    cache = cache if cache is not None else FacesCache(None)
    content = {p: content_key(p) for p in photos}
    recovered = []
    try:  # what was searched is kept, even when a photo cannot be read or the run is interrupted
        found, searched = _search(
            photos, detection, content, cache, "finding faces", show_progress, workers, ranks
        )
        for option, again in retries.searches(detection):
            missing = [p for p in photos if found[p][1] is None]
            if not missing:
                break
            more, n = _search(
                missing, again, content, cache, f"finding faces ({option})", show_progress, workers, ranks
            )
            searched += n
            found.update({p: v for p, v in more.items() if v[1] is not None})
            recovered.append((option, sum(v[1] is not None for v in more.values()), len(missing)))
    finally:
        cache.save()
    missing = [p for p in photos if found[p][1] is None]
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        if strict:
            raise DataError(
                f"no face found in {len(missing)} of {len(photos)} photos: {named}; --strict refuses "
                "them (without it each is cut at a fallback face, and no pair is dropped)"
            )
        if len(missing) == len(photos):
            raise DataError(
                f"no face found in any of the {len(photos)} photos ({named}): a fallback face takes its "
                "place and scale from the faces found, so there is nothing to place it by"
            )
    fallback = (
        Fallback.of([(face, size) for size, face in found.values() if face is not None]) if missing else None
    )
    faces = {p: found[p][1] if found[p][1] is not None else fallback.face(found[p][0]) for p in photos}
    return PairFaces(faces, content, missing, recovered, searched)


@dataclass
class PairEmbeddings:
    """Raw embeddings of each photo's crop and of its mirror image, rows as the photos given."""

    emb: np.ndarray
    emb_flip: np.ndarray
    embedded: int  # photos embedded now (the rest came from the cache)

    def report(self) -> str:
        return f"embeddings: {self.embedded} photos embedded, {len(self.emb) - self.embedded} from the cache"


def pair_embeddings(
    model,
    photos: list[str],
    faces: PairFaces,
    cache: EmbeddingCache | None = None,
    batch_size: int = 64,
    show_progress: bool = True,
) -> PairEmbeddings:
    """Each photo's crop for `model` (its own template) embedded with its mirror image, read from
    the cache where it has them (infer.stream refuses embeddings that are not finite)."""
    cache = cache if cache is not None else EmbeddingCache(None, model)
    keys = {p: f"{faces.content[p]}|{_geometry(faces.faces[p])}" for p in photos}
    todo = [p for p in photos if keys[p] not in cache]
    try:
        with progress_bar(len(todo), "embedding", shown=show_progress and len(todo) > batch_size) as bar:
            for p, photo in zip(
                todo,
                analyse(
                    model,
                    todo,
                    faces=[[faces.faces[p]] for p in todo],
                    batch_size=batch_size,
                    progress=bar.update,
                    raw=True,
                ),
            ):
                cache.put(keys[p], photo.face.embedding)
    finally:
        cache.save()
    rows = np.stack([cache.get(keys[p]) for p in photos]).astype(np.float32)
    return PairEmbeddings(rows[:, 0], rows[:, 1], len(todo))


def _geometry(face: Face) -> str:
    """A short hash of the face's five points and dlib's shape: what its crop is cut from."""
    digest = hashlib.sha256(np.ascontiguousarray(face.points, np.float64).tobytes())
    if face.shape is not None:
        digest.update(np.ascontiguousarray(face.shape, np.float64).tobytes())
    return digest.hexdigest()[:24]
