"""1:N identification (docs/identification.md): `enrol` a folder of people, `embedded_faces` of query
photos (infer.stream), `identify` them against the gallery; from Python, `Gallery(model, "people/")`.

A gallery folder holds one folder per person, named for them; a person is scored by their mean
template (the L2-normalised mean of their embeddings, as IJB pools), so a person with many photos
has no more chances. The embeddings are cached per gallery and weights (`GalleryFile`, infer.cache),
with what made them: a later run embeds only new images, says why it embeds all again, refuses
another MODEL's file (`rebuild` replaces it) and resumes from saved parts; Python and the `identify`
tool share it. A face is named when its best score reaches the threshold (the one given, else the
model's own); a model without one names no one (ThresholdError)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import numpy as np

from shardface.dataset import DataError
from shardface.dataset.folders import hidden, identity_folders, not_regular, walk_images
from shardface.dataset.images import IMAGE_EXTENSIONS, image_size
from shardface.faces.align import ARCFACE_112, Template
from shardface.faces.detect import Face
from shardface.faces.stream import Photo, no_face_message
from shardface.infer.cache import SAVE_EVERY_S, Cache, content_key
from shardface.infer.embed import l2_normalize
from shardface.infer.search import make_index
from shardface.infer.stream import analyse, template_for
from shardface.infer.thresholds import Threshold, chosen_threshold, no_threshold
from shardface.utils.progress import progress_bar

COLLAPSED = 0.99  # mean cosine between different people's templates above which we warn
logger = logging.getLogger("shardface")


class GalleryError(DataError):
    """A gallery folder, gallery file or query that cannot be used (the message names it)."""


@dataclass
class Enrolment:
    names: list[str]  # one per person, sorted
    templates: np.ndarray  # people x D: each person's mean template
    images: int  # images enrolled


def list_gallery(folder: str) -> list[tuple[str, list[str]]]:
    """[(person, [image paths relative to folder])] sorted by name; a missing or empty folder, images
    outside person folders and a person folder without images are refused by name."""
    if not os.path.isdir(folder):
        raise GalleryError(f"{folder}: gallery folder not found")
    people = []
    for name in identity_folders(folder):  # hidden ones skipped (the cache's parts), those with images named
        if any(c in name for c in "\n\r"):  # it would forge a line of identify's output
            raise GalleryError(
                f"{os.path.join(folder, name)!r}: a person's name with a line break cannot be "
                "printed one answer a line; rename the folder"
            )
        found = sorted(os.path.relpath(f, folder) for f in walk_images(os.path.join(folder, name)))
        if not found:
            raise GalleryError(
                f"{os.path.join(folder, name)}: person folder without images ({', '.join(IMAGE_EXTENSIONS)})"
            )
        people.append((name, found))
    loose = [
        e
        for e in sorted(os.listdir(folder))
        if not hidden(e)
        and e.lower().endswith(IMAGE_EXTENSIONS)
        and not os.path.isdir(os.path.join(folder, e))
    ]
    if loose:
        raise GalleryError(
            f"{os.path.join(folder, loose[0])}: an image outside a person folder "
            f"({len(loose)} such); the gallery is one folder per person, named for them"
        )
    if not people:
        raise GalleryError(f"{folder}: empty gallery; it needs one folder per person, each with their images")
    odd = not_regular([os.path.join(folder, f) for _, found in people for f in found])
    if odd is not None:
        raise odd
    return people


def check_image(path: str, template: Template, align: bool) -> None:
    """Refuse, from its header alone, a non-image, or without `align` a crop of a size the model does not take."""
    if not os.path.isfile(path):
        raise GalleryError(f"{path}: no such image file")
    size = image_size(path, path)
    if not align and template_for(size, template) is None:
        sizes = " or ".join(sorted({f"{t.size[1]}x{t.size[0]}" for t in (template, ARCFACE_112)}))
        raise GalleryError(
            f"{path}: a {size[1]}x{size[0]} image is not an aligned {sizes} face crop; "
            f"pass --align to find and align the faces in photos"
        )


def embedded_faces(
    paths: list[str],
    model,
    align: bool,
    batch_size: int = 64,
    workers: int = 1,
    largest_only: bool = False,
    show_progress: bool = False,
    strict: bool = False,
) -> list[Photo]:
    """The photos with a face, in order, each with every face (or the largest; one per file without
    `align`) embedded, a batch at a time after every header is read; `strict` refuses a photo without
    a face, naming it."""
    for path in paths:
        check_image(path, model.template, align)
    label, shown = (
        "finding and embedding faces" if align else "embedding",
        show_progress and len(paths) > batch_size,
    )
    out = []
    with progress_bar(len(paths), label, shown=shown) as bar:
        for photo in analyse(
            model,
            paths,
            workers=workers,
            largest_only=largest_only,
            align=align,
            batch_size=batch_size,
            progress=bar.update,
        ):
            embedded = [face for face in photo.faces if face.embedding is not None]
            out += [dataclasses.replace(photo, faces=embedded, cuts=[])] if embedded else []
    seen = {photo.name for photo in out}
    missing = [p for p in paths if p not in seen]
    if strict and missing:
        raise GalleryError(f"{no_face_message(missing, len(paths), model.detection)}; --strict refuses them")
    return out


def default_cache(folder: str, ema: bool = True) -> str:
    """The gallery file of `folder`: one for the EMA weights (the default), one for the raw ones."""
    return os.path.join(folder, ".shardface_gallery.sqlite" if ema else ".shardface_gallery.no_ema.sqlite")


class GalleryFile(Cache):
    """A gallery's cache: an image's content key -> its largest face's unit embedding (None: no face)."""

    kind = "shardface gallery"
    what = "gallery file"
    hint = "pass another cache file (--cache FILE; from Python, Gallery(..., cache=FILE))"
    redo = "enrolling every image again"
    unit = True

    def __init__(
        self, path: str, model, align: bool, rebuild: bool = False, save_every_s: float = SAVE_EVERY_S
    ):
        crops = f"{model.template.name} {model.template.size[1]}x{model.template.size[0]}"
        header = {
            "model": os.path.realpath(model.name) if os.path.exists(model.name) else model.name,
            "fingerprint": model.fingerprint,
            "ema": bool(model.ema),
            "align": bool(align),
            "template": model.crop_name if align else crops,
            "detection": dataclasses.asdict(model.detection) if align else None,
        }
        super().__init__(path, header, (model.dim,), rebuild, save_every_s)

    @classmethod
    def ours(cls, header: dict) -> bool:
        return "model" in header  # format 2 had no kind

    def changes(self, old: dict) -> list[str]:
        """What changed since `old` that changes the embeddings, in words; another MODEL is refused."""
        new, said = self.header, []
        if (
            old["model"] != new["model"] and old.get("fingerprint") != new["fingerprint"]
        ):  # same weights: same model
            made = [f"{h['model']} (fingerprint {h.get('fingerprint')})" for h in (old, new)]
            raise GalleryError(
                f"{self.path}: this gallery file was enrolled with model {made[0]}, not {made[1]}; "
                "enrol the gallery again with this model (--rebuild; Gallery(..., rebuild=True)), or keep "
                "a second gallery file (--cache FILE; Gallery(..., cache=FILE))"
            )
        weights = {True: "EMA", False: "raw (--no_ema)"}
        if old.get("format") != new["format"]:
            said.append(f"the gallery file's format ({old.get('format')}, now {new['format']})")
        if old.get("fingerprint") != new["fingerprint"] and old.get("ema", True) != new["ema"]:
            said.append(f"the weights chosen ({weights[old.get('ema', True)]}, now {weights[new['ema']]})")
        elif old.get("fingerprint") != new["fingerprint"]:
            said.append(
                f"the model's weights (fingerprint {old.get('fingerprint')}, now {new['fingerprint']})"
            )
        if old.get("template") != new["template"]:
            said.append(f"the template ({old.get('template')}, now {new['template']})")
        if old.get("align") != new["align"]:
            said.append("the alignment (--align now " + ("given)" if new["align"] else "left out)"))
        elif new["align"] and old.get("detection") != new["detection"]:
            was = old.get("detection") or {}
            said.append(
                "the face options ("
                + ", ".join(
                    f"--{k} {was.get(k)}, now {v}" for k, v in new["detection"].items() if was.get(k) != v
                )
                + ")"
            )
        return said


def enrol(
    folder: str,
    model,
    align: bool = False,
    cache: str | None = None,
    rebuild: bool = False,
    batch_size: int = 64,
    show_progress: bool = True,
    strict: bool = False,
    save_every_s: float = SAVE_EVERY_S,
    workers: int = 1,
) -> Enrolment:
    """The gallery of `folder` under `model`, from its cache file where still valid, saved when anything
    is new. `strict`: a gallery image without a face is refused (after the enrolment is saved)."""
    people = list_gallery(folder)
    cache = cache or default_cache(folder, model.ema)
    store = GalleryFile(cache, model, align, rebuild, save_every_s)
    paths = [os.path.join(folder, f) for _, files in people for f in files]
    keys = [content_key(p) for p in paths]
    todo = {k: p for k, p in zip(keys, paths) if k not in store}
    for path in todo.values():  # every header before the first embedding
        check_image(path, model.template, align)
    with progress_bar(len(todo), "enrolling", shown=show_progress and bool(todo)) as bar:
        for key, photo in zip(
            todo,
            analyse(
                model,
                list(todo.values()),
                workers=workers,
                largest_only=True,
                align=align,
                batch_size=batch_size,
                progress=bar.update,
            ),
        ):
            store.put(key, photo.face.embedding if photo.face is not None else None)
    store.save()  # before any refusal
    rows, means = iter([store.get(k) for k in keys]), []
    for person, files in people:
        faces = [r for r in (next(rows) for _ in files) if r is not None]
        if not faces:
            raise GalleryError(f"{person}: no face found in any of their {len(files)} images")
        means.append(np.mean(faces, axis=0))
    names = [person for person, _ in people]
    gallery = Enrolment(names, l2_normalize(np.stack(means)).astype(np.float32), len(keys))
    no_face = [p for p, k in zip(paths, keys) if store.get(k) is None]
    if no_face:
        message = no_face_message(no_face, len(keys), model.detection)
        if strict:
            raise GalleryError(f"{message}; --strict refuses them (the enrolment is saved in {cache})")
        logger.warning("%s; left out of the gallery", message)
    # templates of different people in nearly the same direction: every query would score alike for everyone
    mean = mean_cross_cosine(gallery.templates) if len(names) > 1 else 0.0
    if mean > COLLAPSED:
        logger.warning(
            "%s: the %d people's templates are nearly identical (mean cosine %.4f between different "
            "people): this model does not tell them apart, so its answers mean nothing (a collapsed "
            "or untrained model?)",
            cache,
            len(names),
            mean,
        )
    return gallery


def mean_cross_cosine(templates: np.ndarray) -> float:
    """The mean cosine between the templates of different people (unit rows): from the norm of
    their sum, |sum t|^2 = n + sum over pairs i != j of t_i . t_j, so O(n D), not O(n^2 D)."""
    n = len(templates)
    total = templates.astype(np.float64).sum(0)
    return float((total @ total - n) / (n * (n - 1)))


def identify(gallery: Enrolment, queries: np.ndarray, k: int = 1, engine: str = "auto", device="cpu"):
    """(scores, person indices), Q x min(k, people), best first; `engine`, `device`: as infer.search.make_index."""
    index = make_index(
        gallery.templates.shape[1], engine, size=len(gallery.templates), queries=len(queries), device=device
    )
    index.add(gallery.templates)
    return index.search(queries, k)


@dataclass(frozen=True)
class Match:
    """A query photo's face and who it is: `name` (None: nobody reaches the threshold), `score` the best
    person's cosine, `face`, and `candidates`, the `top` best (name, score), best first, whatever the threshold."""

    name: str | None
    score: float
    face: Face
    candidates: list[tuple[str, float]]

    @property
    def box(self) -> tuple[float, float, float, float]:
        return self.face.box


def matches(
    faces: list[Face], enrolment, threshold: float, top: int = 1, engine: str = "auto", device="cpu"
) -> list[Match]:
    """Each embedded face's Match against the people."""
    if not faces:
        return []
    scores, ids = identify(enrolment, np.stack([f.embedding for f in faces]), top, engine, device)
    best = [[(enrolment.names[j], float(v)) for v, j in zip(s, i) if j >= 0] for s, i in zip(scores, ids)]
    return [
        Match(b[0][0] if b[0][1] >= threshold else None, b[0][1], face, b) for face, b in zip(faces, best)
    ]


class Gallery:
    """The people of `folder` enrolled under `model`: photos (`align`, the default: each photo's
    largest face) or crops aligned for the model (align=False), as `identify --align` takes them."""

    def __init__(
        self,
        model,
        folder: str,
        *,
        align: bool = True,
        threshold: float | Threshold | None = None,
        cache: str | None = None,
        rebuild: bool = False,
    ):
        """`cache`: the gallery file (default: a hidden file in `folder`, which must then take one);
        `rebuild`: enrol every photo again, replacing a gallery file of another model."""
        chosen = chosen_threshold(threshold, own=model.threshold)
        if chosen is None:
            raise no_threshold(model.name)
        self.model, self.align, self.threshold = model, align, chosen
        self.enrolment = enrol(folder, model, align, cache=cache, rebuild=rebuild, show_progress=False)
        self.names = list(self.enrolment.names)

    def identify(self, photo, top: int = 1) -> list[Match]:
        """Each face of the photo (path, PIL image or array), largest first, as a Match with `top` candidates."""
        (found,) = self.model.analyse([photo], align=self.align)
        return matches(found.faces, self.enrolment, self.threshold.value, top, device=self.model.device)
