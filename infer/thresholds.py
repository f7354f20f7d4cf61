"""The cosine threshold a verdict is made at (`compare`'s same or different, `identify`'s name or
`unknown`), and where it came from, which both tools print.

A threshold is, in order: the one given (`--threshold T`: a finite cosine in [-1, 1]); the one
fitted to a verification set (`--threshold_from VAL.bin`: the best over its pairs); the MODEL's
own: for `dlib` its author's rule, Euclidean distance 0.6 between raw descriptors, as the cosine of
these embeddings whose verdicts agree with it on real faces (docs/identification.md, "dlib's
threshold"), for a trained run its
threshold at a stated FAR on its validation set (`threshold_at_far`, saved by training, carried
into ONNX). A MODEL without a known threshold names no one: `identify` refuses at start."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from shardface.checkpoint.state import weights_fingerprint
from shardface.errors import ConfigError
from shardface.infer.weights import load_backbone_state

DLIB_DISTANCE = 0.6  # dlib's same-person rule on its raw descriptors (face_recognition's compare_faces)
# the cosine at which MODEL dlib's verdicts agree best with that rule on real photos (LFW, measured by
# benchmarks/dlib_verdict.py on half its people and held on the other half: docs/identification.md)
DLIB_THRESHOLD = 0.922


class ThresholdError(ConfigError):
    """A threshold that is not a cosine, or none where a verdict needs one."""


@dataclass(frozen=True)
class Threshold:
    value: float  # cos >= value is "same" / a name
    source: str  # where it came from, printed beside it
    record: dict | None = None  # a trained run's measurement (threshold_at_far's, with val_target and step)

    def line(self) -> str:
        return f"threshold {self.value:.4f}: {self.source}"

    @classmethod
    def given(cls, value, flag: str = "--threshold") -> "Threshold":
        """A threshold a user gave as `flag`: a cosine in [-1, 1], else a ThresholdError naming it."""
        return cls(checked(value, flag), f"given by {flag}")


def checked(value: float, flag: str = "--threshold") -> float:
    """`value` if it is a cosine (a finite real number in [-1, 1], not a bool), else a ThresholdError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise ThresholdError(
            f"{flag} {value!r}: a threshold is a number in [-1, 1], not a {type(value).__name__}"
        )
    if not math.isfinite(value) or not -1.0 <= value <= 1.0:
        raise ThresholdError(f"{flag} {value}: not a cosine score; a threshold is a finite number in [-1, 1]")
    return float(value)


# MODEL dlib's own threshold (Model.threshold); its record travels into an exported .onnx
_DLIB_SOURCE = (
    f"dlib's own rule, distance {DLIB_DISTANCE} between its descriptors, as the cosine that agrees "
    "with it on real faces (docs/identification.md)"
)
DLIB_OWN = Threshold(DLIB_THRESHOLD, _DLIB_SOURCE, {"threshold": DLIB_THRESHOLD, "rule": _DLIB_SOURCE})


def chosen_threshold(given: float | Threshold | None, own: Threshold | None = None) -> Threshold | None:
    """The threshold to decide at: `given` (a cosine, checked; or a Threshold, such as
    eval.verification.fit_threshold's), else `own` (Model.threshold)."""
    if isinstance(given, Threshold):
        return given
    return Threshold.given(given) if given is not None else own


def fitted_threshold(value: float, accuracy: float, path: str, pairs: int) -> Threshold:
    """The threshold fitted to all `pairs` pairs of the .bin at `path`, right on `accuracy` of them."""
    # fitted to these pairs: its accuracy is an upper bound, not a measure
    return Threshold(
        value,
        f"from {path}: the best over all its {pairs} pairs, {accuracy:.4f} of them right "
        f"at it (best-threshold accuracy; scripts.verify reports the 10-fold accuracy, "
        f"each fold judged at a threshold chosen on the other 9)",
    )


def no_threshold(model: str) -> ThresholdError:
    """The one-line refusal to name anyone under a MODEL without a known threshold."""
    return ThresholdError(
        f"{model}: no known threshold for this model, so no face can be named (every face would be "
        f"somebody); pass --threshold T (a cosine in [-1, 1]) or --threshold_from VAL.bin (a "
        f"verification set of people, e.g. from scripts.make_bin: the threshold that separates "
        f"its pairs best)"
    )


# A trained run's own threshold: training's verification (eval/callback.py) saves it beside the run's weights
# (THRESHOLD_FILE, with its step and the weights' fingerprint); export_onnx puts it in the .onnx (THRESHOLD_KEY).
FARS = (1e-3, 1e-2, 1e-1)  # the lowest one the set's different-person pairs can measure is used
THRESHOLD_FILE = "threshold.json"
THRESHOLD_KEY = "shardface.threshold"


def threshold_at_far(cosines, same) -> dict | None:
    """{threshold, far, tar, pairs, different_pairs}: the lowest cosine threshold accepting (`cos >= threshold`)
    at most `far` of the different-person pairs, for the lowest `far` of FARS the pairs can measure (at least
    1 / far different-person pairs); None where there are too few for any."""
    cosines, same = np.asarray(cosines, np.float64), np.asarray(same, bool)
    different = np.sort(cosines[~same])[::-1]
    for far in FARS:
        if len(different) < math.ceil(1 / far - 1e-9):
            continue
        allowed = math.floor(far * len(different) + 1e-9)  # different pairs that may pass
        value = -1.0 if allowed >= len(different) else float(np.nextafter(different[allowed], np.inf))
        if value > 1.0:  # different pairs at cosine 1 (duplicates): no cosine threshold keeps this FAR
            continue
        return {
            "threshold": value,
            "far": far,
            "tar": float((cosines[same] >= value).mean()) if same.any() else 0.0,
            "pairs": int(len(cosines)),
            "different_pairs": int(len(different)),
        }
    return None


def saved_threshold(record: dict | None, where: str) -> Threshold | None:
    """The Threshold of a record `threshold_at_far` made (with `val_target` and `step`), or of a
    rule's record (`rule`: what it is, as MODEL dlib's), or None."""
    if not record:
        return None
    try:
        value = checked(record["threshold"], f"{where}: threshold")
        if "rule" in record:
            return Threshold(value, f"{record['rule']} ({where})", record)
        return Threshold(
            value,
            record=record,
            source=f"the run's own, at FAR {record['far']:g} on {record['val_target']} "
            f"({record['different_pairs']} different-person pairs; TAR {record['tar']:.4f} there), "
            f"measured at step {record['step']} ({where})",
        )
    except (KeyError, TypeError, ValueError):
        raise ThresholdError(f"{where}: unreadable threshold record {record!r}") from None


def run_threshold(path: str, ema: bool = True, fingerprint: str | None = None) -> Threshold | None:
    """The threshold training saved beside the weights at `path` (a run output, a checkpoint dir, or the
    run's model.pt: the latest checkpoint's weights, the EMA's where there is one) if it was measured on
    them: at their step and, where the record names a fingerprint, theirs (`fingerprint`, else read from
    `path`); else None (an earlier run's file in the same folder is not theirs)."""
    from shardface.checkpoint.folders import CHECKPOINT_NAME, find_checkpoint

    run = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    ckpt = find_checkpoint(run)
    if ckpt is not None and os.path.abspath(ckpt) == os.path.abspath(
        run
    ):  # a checkpoint dir: its run holds the file
        run = os.path.dirname(os.path.abspath(ckpt))
    file = os.path.join(run, THRESHOLD_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            records = json.load(f)
    except (OSError, ValueError) as exc:
        raise ThresholdError(f"{file}: unreadable ({exc})") from None
    if not isinstance(records, dict):
        raise ThresholdError(f"{file}: not a threshold record")
    want_ema = ema if os.path.isdir(path) else True  # model.pt holds the EMA's weights where there is one
    record = records.get("ema") if want_ema and records.get("ema") else records.get("raw")
    named = CHECKPOINT_NAME.match(os.path.basename(ckpt)) if ckpt else None
    if record is None or (named and isinstance(record, dict) and record.get("step") != int(named.group(1))):
        return None  # measured on other weights than these
    measured_on = record.get("fingerprint") if isinstance(record, dict) else None
    if measured_on is not None:
        these = fingerprint or weights_fingerprint(load_backbone_state(path, ema)[0])
        if measured_on != these:
            return None  # measured on other weights at the same step: an earlier run's in this folder
    return saved_threshold(record, file)
