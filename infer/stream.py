"""Photos to embedded faces: the face stream (faces.stream) cut to a model's crop, each batch of crops
embedded while the workers find the next photos' faces. The only forward of a model on photos: the
Python API, enrolment, the pair protocols and every tool's `--align` are layers on it."""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from shardface.dataset.errors import DataError
from shardface.faces.align import ARCFACE_112, Template
from shardface.faces.detect import Face
from shardface.faces.stream import Crop, Photo, stream
from shardface.infer.embed import embed, l2_normalize, refuse_non_finite_embeddings


def analyse(
    model,
    photos: Iterable,
    *,
    workers: int = 1,
    flip: bool = True,
    largest_only: bool = False,
    align: bool = True,
    batch_size: int = 64,
    progress: Callable[[], None] | None = None,
    faces: list[list[Face]] | None = None,
    resize: bool = False,
    raw: bool = False,
) -> Iterator[Photo]:
    """Each photo's `Photo` (faces.stream), in order, its faces (all, or the largest only; `faces`: known
    already) carrying `.embedding` (`embed_crops`'s row). Without `align` each photo is a crop aligned for
    the model (or ARCFACE_112, re-framed), its one face the whole image; `resize` fits other sizes to the model's."""
    if align:
        crop = Crop(model.template, dlib_chip=model.kind == "dlib")  # picklable: the workers cut the crops
        found = stream(
            photos,
            model.detection,
            crop,
            workers=workers,
            largest_only=largest_only,
            faces=faces,
            progress=progress,
        )
    else:
        found = stream(
            photos,
            None,
            workers=workers,
            progress=progress,
            resize=tuple(model.template.size) if resize else None,
        )
    pending: list[Photo] = []
    for photo in found:
        pending.append(photo)
        if sum(len(p.cuts) for p in pending) >= batch_size:
            yield from _embedded(model, pending, flip, batch_size, raw)
            pending = []
    yield from _embedded(model, pending, flip, batch_size, raw)


def template_for(size: tuple[int, int], template: Template) -> Template | None:
    """The template a crop of (h, w) `size` was aligned to: `template` (the model's), else ARCFACE_112, else None."""
    return next((t for t in (template, ARCFACE_112) if tuple(size) == tuple(t.size)), None)


def _embedded(model, photos: list[Photo], flip: bool, batch_size: int, raw: bool) -> list[Photo]:
    """`photos` with each cut face's embedding, crops grouped by the template they were made for."""
    groups: dict[str, tuple[Template, list[tuple[int, int]]]] = {}
    for p, photo in enumerate(photos):
        for f, crop in enumerate(photo.cuts):
            template = template_for(crop.shape[:2], model.template)
            if template is None:
                (h, w), (th, tw) = crop.shape[:2], model.template.size
                raise DataError(
                    f"{photo.name}: a {w}x{h} image is not a {tw}x{th} crop aligned for {model.name}; "
                    "pass align=True to find and align its face"
                )
            groups.setdefault(template.name, (template, []))[1].append((p, f))
    rows: dict[tuple[int, int], np.ndarray] = {}
    for template, where in groups.values():
        crops = torch.stack(
            [torch.from_numpy(np.array(photos[p].cuts[f])).permute(2, 0, 1) for p, f in where]
        )
        rows.update(
            zip(
                where, embed_crops(model, crops, made_for=template, flip=flip, batch_size=batch_size, raw=raw)
            )
        )
    return [
        dataclasses.replace(
            photo,
            faces=[
                dataclasses.replace(face, embedding=rows[p, f]) if (p, f) in rows else face
                for f, face in enumerate(photo.faces)
            ],
        )
        for p, photo in enumerate(photos)
    ]


def embed_crops(
    model,
    crops: torch.Tensor,
    *,
    made_for: Template | None = None,
    flip: bool = True,
    batch_size: int = 64,
    raw: bool = False,
) -> np.ndarray:
    """N x D unit rows of N x 3 x h x w uint8 crops aligned to `made_for` (default the model's template; others
    re-framed): each crop's embedding plus its mirror's (the flip test), or its own without `flip`; `raw`: the
    two as the network gives them, N x 2 x D (the pair protocols score both). Non-finite rows are refused."""
    module, precision = model.module_for(made_for or model.template), model.precision
    own = refuse_non_finite_embeddings(embed(crops, module, batch_size, precision), model.name)
    if not (flip or raw):
        return l2_normalize(own).astype(np.float32)
    mirror = refuse_non_finite_embeddings(
        embed(torch.flip(crops, dims=[3]), module, batch_size, precision), model.name
    )
    return (
        np.stack([own, mirror], axis=1).astype(np.float32)
        if raw
        else l2_normalize(own + mirror).astype(np.float32)
    )
