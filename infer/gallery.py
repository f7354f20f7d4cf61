"""People to recognise, in a few lines of Python:

    gallery = Gallery(model, "people/")    # one folder of photos per person, enrolled once and cached
    gallery.identify("query.jpg")          # [Match] per face, largest first: .name, .score, .box

A person is scored by their mean template (infer.enrolment: the cache, its checks and its
resumption are the `identify` tool's, so a gallery enrolled from Python serves the tool and the
other way round). A face is named when its best score reaches the threshold: the one given, else
the model's own; a model without one names no one (ThresholdError)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from faces.detect import Face
from infer.enrolment import enrol, identify
from infer.model import Model
from infer.thresholds import chosen_threshold, no_threshold


@dataclass(frozen=True)
class Match:
    """A face of a query photo and who it is: `name`, or None where nobody in the gallery reaches
    the threshold; `score`, the best person's cosine; `face` (.box, .points, .embedding); and
    `candidates`, the `top` best (name, score), best first, whatever the threshold."""
    name: str | None
    score: float
    face: Face
    candidates: list[tuple[str, float]]

    @property
    def box(self) -> tuple[float, float, float, float]:
        return self.face.box


def matches(faces: list[Face], enrolment, threshold: float, top: int = 1, engine: str = "auto",
            device="cpu") -> list[Match]:
    """Each embedded face's Match (anything with .embedding: a Face, an EmbeddedFace) against the
    enrolled people (infer.search's engines, all exact)."""
    if not faces:
        return []
    scores, ids = identify(enrolment, np.stack([f.embedding for f in faces]), top, engine, device)
    out = []
    for face, s, i in zip(faces, scores, ids):
        best = [(enrolment.names[j], float(v)) for v, j in zip(s, i) if j >= 0]
        out.append(Match(best[0][0] if best[0][1] >= threshold else None, best[0][1], face, best))
    return out


class Gallery:
    """The people of `folder` enrolled under `model`: photos (`align`, the default: each photo's
    largest face) or crops aligned for the model (align=False), as `identify --align` takes them."""

    def __init__(self, model: Model, folder: str, align: bool = True, threshold: float | None = None,
                 cache: str | None = None, rebuild: bool = False, show_progress: bool = False):
        chosen = chosen_threshold(threshold, None, model.name, model.threshold)
        if chosen is None:
            raise no_threshold(model.name)
        self.model, self.align, self.threshold = model, align, chosen
        self.enrolment = enrol(folder, model, align, cache, rebuild, show_progress=show_progress)

    @property
    def names(self) -> list[str]:
        return list(self.enrolment.names)

    def identify(self, photo, top: int = 1, engine: str = "auto") -> list[Match]:
        """Each face of the photo (a path, a PIL image or an array), largest first, as a Match with
        its `top` best candidates. `engine`: infer.search's, all exact with the same answer."""
        (found,) = self.model.analyse([photo], align=self.align)
        return matches(found.faces, self.enrolment, self.threshold.value, top, engine, self.model.device)
