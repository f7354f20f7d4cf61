"""People to recognise, in a few lines of Python:

    gallery = Gallery(model, "people/")    # one folder of photos per person, enrolled once and cached
    gallery.identify("query.jpg")          # [(name or "unknown", score)], one per face, largest first

A person is scored by their mean template (infer.enrolment: the cache, its checks and its
resumption are the `identify` tool's, so a gallery enrolled from Python serves the tool and the
other way round). A face is named when its best score reaches the threshold: the one given, else
the model's own; a model without one names no one (ThresholdError)."""
from __future__ import annotations

import numpy as np
import torch

from infer.enrolment import enrol, identify
from infer.model import Model
from infer.photos import image_crops, open_image, photo_name
from infer.thresholds import chosen_threshold, no_threshold

UNKNOWN = "unknown"


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

    def embeddings(self, photo, index: int = 0) -> np.ndarray:
        """F x D: the photo's faces, largest first (with `align`; without, the photo as one crop)."""
        crops = image_crops(self.model, open_image(photo, index), self.align, photo_name(photo, index))
        if not crops:
            return np.zeros((0, self.enrolment.templates.shape[1]), np.float32)
        return self.model.embed_crops(torch.stack(crops))

    def identify(self, photo, top: int = 1, engine: str = "auto") -> list:
        """Per face of the photo, largest first: (name or "unknown", score) of the best match; with
        top > 1, a list of the `top` best (name, score), the first replaced by "unknown" when it
        is below the threshold. `engine`: infer.search's, all exact with the same answer."""
        emb = self.embeddings(photo)
        if not len(emb):
            return []
        scores, ids = identify(self.enrolment, emb, top, engine)
        out = []
        for s, i in zip(scores, ids):
            best = [(self.enrolment.names[j], float(v)) for v, j in zip(s, i) if j >= 0]
            if best[0][1] < self.threshold.value:
                best[0] = (UNKNOWN, best[0][1])
            out.append(best[0] if top == 1 else best)
        return out
