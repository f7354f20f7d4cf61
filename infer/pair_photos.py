"""The photos of a pair list, each given one face, and each model's embeddings of them: the one
place that decides a photo's face or its fallback, for scripts.make_bin (112x112 crops in a
.bin) and scripts.verify (each model's own crop), so both score the same faces.

A pair protocol keeps every pair: dropping the pairs of photos where no face is found changes
the protocol (and flatters the score). So each photo is searched once under the tools' face
options; photos without a face are searched again by the retries asked for (`Retries`: more
upsampling, then dlib's CNN detector); a photo still without one gets a fallback face
(faces.fallback: the set's median face at its place and scale in the photo), and is named.
Detections are cached per photo content and options, embeddings per photo content, face and
model (infer.pair_cache), so a second model, or verify after make_bin, does not detect again."""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import numpy as np

from dataset.errors import DataError
from faces.detect import Detection, Face
from faces.fallback import Fallback
from faces.stream import stream
from infer.enrolment import content_key
from infer.pair_cache import EmbeddingCache, FacesCache, content_entry, face_key
from infer.stream import analyse
from utils.progress import Progress

SAVE_EVERY_S = 60.0  # an interrupted search or embedding loses at most this much work
SHOWN = 20           # photos named in a report


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
            out.append((f"--retry_upsample {self.upsample}", dataclasses.replace(detection, upsample=self.upsample)))
        if self.mmod:
            out.append(("--retry_mmod", dataclasses.replace(detection, detector="mmod")))
        return out


@dataclass
class PairFaces:
    """Every photo's face: its largest detected one, or its fallback."""
    faces: dict[str, Face]
    content: dict[str, tuple[int, str]]         # each photo's content key (infer.enrolment.content_key)
    fallbacks: list[str]                        # photos given the fallback face, in order
    recovered: list[tuple[str, int, int]]       # (retry option, photos it found a face in, photos it searched)
    searched: int                               # photo searches run now (the rest came from the cache)
    cached: int                                 # photo searches answered by the cache

    def report(self, pairs: list[tuple[str, str]] | None = None) -> list[str]:
        """Lines saying how many searches the cache answered, what the retries recovered, and
        naming the photos given a fallback."""
        lines = [f"faces: {self.searched} photo searches run, {self.cached} answered by the cache"]
        lines += [f"{option}: a face found in {found} of the {tried} photos searched again" for option, found, tried
                 in self.recovered]
        if self.fallbacks:
            fallback = set(self.fallbacks)
            in_pairs = "" if pairs is None else \
                f" (in {sum(a in fallback or b in fallback for a, b in pairs)} of {len(pairs)} pairs)"
            tried = {option.split()[0] for option, _, _ in self.recovered}
            untried = [o for o in ("--retry_upsample N", "--retry_mmod") if o.split()[0] not in tried]
            hint = f" ({' or '.join(untried)} may find more)" if untried else ""
            lines.append(f"no face found in {len(self.fallbacks)} of {len(self.faces)} photos{in_pairs}: each is "
                         f"cut at a fallback face, the set's median face at its place and scale in the photo{hint}:")
            lines += [f"  {p}" for p in self.fallbacks[:SHOWN]]
            if len(self.fallbacks) > SHOWN:
                lines.append(f"  and {len(self.fallbacks) - SHOWN} more")
        return lines


def _search(photos: list[str], detection: Detection, content: dict, cache: FacesCache, label: str,
            show_progress: bool, workers: int = 1) -> tuple[dict[str, tuple[tuple[int, int], Face | None]], int]:
    """({photo: (its size, its largest face or None)}, searches run) under `detection`, on
    `workers` processes (faces.stream)."""
    variant = json.dumps(dataclasses.asdict(detection), sort_keys=True)
    keys = {p: content_entry(content[p], variant) for p in photos}
    todo = [p for p in photos if cache.get(keys[p]) is None]
    progress = Progress(len(todo), label) if show_progress and todo else None
    saved = time.monotonic()
    for p, photo in zip(todo, stream(todo, detection, workers=workers, progress=progress and progress.update)):
        cache.put(keys[p], photo.size, photo.face)
        if time.monotonic() - saved > SAVE_EVERY_S:
            cache.save()
            saved = time.monotonic()
    return {p: cache.get(keys[p]) for p in photos}, len(todo)


def pair_faces(photos: list[str], detection: Detection = Detection(), retries: Retries = Retries(),
               cache: FacesCache | None = None, strict: bool = False, show_progress: bool = True,
               workers: int = 1) -> PairFaces:
    """Each photo's face (see the module docstring); `strict` refuses photos without one instead
    of giving them the fallback. Unreadable photos are an ImageDecodeError naming them."""
    cache = cache if cache is not None else FacesCache(None)
    content = {p: content_key(p) for p in photos}
    recovered = []
    try:  # what was searched is kept, even when a photo cannot be read or the run is interrupted
        found, searched = _search(photos, detection, content, cache, "finding faces", show_progress, workers)
        for option, again in retries.searches(detection):
            missing = [p for p in photos if found[p][1] is None]
            if not missing:
                break
            more, n = _search(missing, again, content, cache, f"finding faces ({option})", show_progress, workers)
            searched += n
            found.update({p: v for p, v in more.items() if v[1] is not None})
            recovered.append((option, sum(v[1] is not None for v in more.values()), len(missing)))
    finally:
        cache.save()
    total_searches = len(photos) + sum(tried for _, _, tried in recovered)
    missing = [p for p in photos if found[p][1] is None]
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        if strict:
            raise DataError(f"no face found in {len(missing)} of {len(photos)} photos: {named}; --strict refuses "
                            "them (without it each is cut at a fallback face, and no pair is dropped)")
        if len(missing) == len(photos):
            raise DataError(f"no face found in any of the {len(photos)} photos ({named}): a fallback face takes its "
                            "place and scale from the faces found, so there is nothing to place it by")
    fallback = Fallback.of([(face, size) for size, face in found.values() if face is not None]) if missing else None
    faces = {p: found[p][1] if found[p][1] is not None else fallback.face(found[p][0]) for p in photos}
    return PairFaces(faces, content, missing, recovered, searched, total_searches - searched)


@dataclass
class PairEmbeddings:
    """Raw embeddings of each photo's crop and of its mirror image, rows as the photos given."""
    emb: np.ndarray
    emb_flip: np.ndarray
    embedded: int   # photos embedded now (the rest came from the cache)

    def report(self) -> str:
        return f"embeddings: {self.embedded} photos embedded, {len(self.emb) - self.embedded} from the cache"


def pair_embeddings(model, photos: list[str], faces: PairFaces, cache: EmbeddingCache | None = None,
                    batch_size: int = 64, show_progress: bool = True) -> PairEmbeddings:
    """Each photo's crop for `model` (Model.crop: the model's own template) embedded with its
    mirror image, read from the cache where it has them. Embeddings that are not finite are
    refused, naming the model."""
    cache = cache if cache is not None else EmbeddingCache(None, model)
    keys = {p: content_entry(faces.content[p], face_key(faces.faces[p])) for p in photos}
    todo = [p for p in photos if cache.get(keys[p]) is None]
    progress = Progress(len(todo), "embedding") if show_progress and len(todo) > batch_size else None
    saved = time.monotonic()
    try:
        for p, photo in zip(todo, analyse(model, todo, faces=[[faces.faces[p]] for p in todo], batch_size=batch_size,
                                          progress=progress and progress.update, raw=True)):
            cache.put(keys[p], *photo.face.embedding)
            if time.monotonic() - saved > SAVE_EVERY_S:
                cache.save()
                saved = time.monotonic()
    finally:
        cache.save()
    rows = [cache.get(keys[p]) for p in photos]
    return PairEmbeddings(np.stack([r[0] for r in rows]).astype(np.float32),
                          np.stack([r[1] for r in rows]).astype(np.float32), len(todo))
