"""The cosine threshold a verdict is made at (`compare`'s same or different, `identify`'s name
or `unknown`), and where it came from, which both tools print.

A threshold is, in order: the one given (`--threshold T`: a cosine, finite, in [-1, 1]); the
one fitted to a verification set (`--threshold_from VAL.bin`: the best over its pairs); the
MODEL's own. A MODEL without a known threshold names no one: `identify` refuses at start.

MODEL `dlib`'s own threshold is its author's rule, Euclidean distance 0.6 between two of its
raw 128-D descriptors, turned into a cosine of the L2-normalised embeddings the tools compare.
For descriptors a, b of norms |a|, |b|,  d^2 = |a|^2 + |b|^2 - 2 |a| |b| cos, so where both
have norm r the rule d < 0.6 is  cos > 1 - 0.6^2 / (2 r^2).  dlib's descriptors are not unit
vectors: their norm is 1.36 on average (1.26 to 1.54) over dlib's own descriptors of 37 real
faces (skimage's astronaut and 36 of its LFW subset), which gives cosine 0.9027. On those 37
faces' 666 pairs (skimage's LFW faces are 25x25, upscaled) the cosine rule and dlib's distance
rule agree on 98.0% (they differ only where the two norms differ); the unit-norm reading,
cosine 1 - 0.6^2 / 2 = 0.82, on 16.7%. The tools' embeddings add the mirror image's (the flip
test), which moves a pair's cosine a little: on the same pairs the rule agrees on 94.7%."""
from __future__ import annotations

import math
from dataclasses import dataclass

from configs.errors import ConfigError
from eval.weights import DLIB

DLIB_DISTANCE = 0.6   # dlib's same-person rule on its raw descriptors (dlib's face_recognition example)
DLIB_NORM = 1.36      # the mean norm of dlib's descriptors of real faces (measured: see the module docstring)


def cosine_for_distance(distance: float, norm: float) -> float:
    """The cosine of two vectors of norm `norm` at Euclidean distance `distance`."""
    return 1.0 - distance ** 2 / (2.0 * norm ** 2)


DLIB_THRESHOLD = cosine_for_distance(DLIB_DISTANCE, DLIB_NORM)


class ThresholdError(ConfigError):
    """A threshold that is not a cosine, or none where a verdict needs one."""


@dataclass(frozen=True)
class Threshold:
    value: float     # cos >= value is "same" / a name
    source: str      # where it came from, printed beside it

    def line(self) -> str:
        return f"threshold {self.value:.4f}: {self.source}"


def checked(value: float, flag: str = "--threshold") -> float:
    """`value` if it is a cosine score (finite, in [-1, 1]), else a ThresholdError naming it."""
    if not math.isfinite(value) or not -1.0 <= value <= 1.0:
        raise ThresholdError(f"{flag} {value}: not a cosine score; a threshold is a finite number in [-1, 1]")
    return float(value)


def model_threshold(model: str) -> Threshold | None:
    """The MODEL's own threshold, or None where it has none."""
    if model == DLIB:
        return Threshold(DLIB_THRESHOLD, f"dlib's own rule, distance {DLIB_DISTANCE} between its descriptors "
                                         f"(cosine 1 - {DLIB_DISTANCE}^2 / (2 x {DLIB_NORM}^2) at their mean norm "
                                         f"{DLIB_NORM})")
    return None


def chosen_threshold(given: float | None, fitted: tuple[float, float, str, int] | None,
                     model: str) -> Threshold | None:
    """The threshold to decide at: `given` (--threshold), else `fitted` ((threshold, accuracy,
    .bin path, pairs) from eval.embedder.best_threshold), else the MODEL's own, else None."""
    if given is not None:
        return Threshold(checked(given), "given by --threshold")
    if fitted is not None:
        value, accuracy, path, pairs = fitted
        # fitted to these pairs: its accuracy is an upper bound, not a measure
        return Threshold(value, f"from {path}: the best over all its {pairs} pairs, {accuracy:.4f} of them right "
                                f"at it (best-threshold accuracy; scripts.verify reports the 10-fold accuracy, "
                                f"each fold judged at a threshold chosen on the other 9)")
    return model_threshold(model)


def no_threshold(model: str) -> ThresholdError:
    """The one-line refusal to name anyone under a MODEL without a known threshold."""
    return ThresholdError(f"{model}: no known threshold for this model, so no face can be named (every face would be "
                          f"somebody); pass --threshold T (a cosine in [-1, 1]) or --threshold_from VAL.bin (a "
                          f"verification set of people, e.g. from scripts.make_bin: the threshold that separates "
                          f"its pairs best)")
