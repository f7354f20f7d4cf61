"""1:N identification metrics as pure functions of a probe x gallery score matrix (IJB-C's
definitions, Maze et al. 2018; NIST FRVT 1:N):

- a *mated* probe has its identity in the gallery; its rank is the place of its best-placed
  mate in the probe's sorted candidate list (0 = first; equal scores go to the lower gallery
  index first, as infer.search orders them);
- closed set: rank-k accuracy = the fraction of mated probes whose rank is below k; the CMC
  curve is rank-k accuracy for k = 1, 2, ...;
- open set at a threshold t (a candidate is returned when its score is >= t):
  FPIR(t) = the fraction of *non-mated* probes whose top score is >= t,
  TPIR(t) = the fraction of mated probes whose mate is at rank 0 with score >= t (FNIR = 1 - TPIR);
  TPIR at FPIR f uses the lowest threshold whose FPIR does not exceed f.

`insightface_tpir` is the different figure insightface's IJB 1:N script prints under the same
name; see its docstring."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from shardface.utils.atomic import publishing

FPIR_LEVELS = (1e-1, 1e-2)


def mate_ranks(scores: np.ndarray, gallery_labels, probe_labels) -> tuple[np.ndarray, np.ndarray]:
    """(rank, score) of each probe's best-placed mate; rank -1 and score nan for a probe with
    no mate in the gallery (a non-mated probe)."""
    scores = np.asarray(scores)
    is_mate = np.asarray(gallery_labels)[None, :] == np.asarray(probe_labels)[:, None]
    has_mate = is_mate.any(1)
    best = np.argmax(np.where(is_mate, scores, -np.inf), axis=1)  # argmax: the lowest index among equals
    best_score = scores[np.arange(len(scores)), best]
    cols = np.arange(scores.shape[1])[None, :]
    ahead = (scores > best_score[:, None]) | ((scores == best_score[:, None]) & (cols < best[:, None]))
    ranks = np.where(has_mate, ahead.sum(1), -1)
    return ranks, np.where(has_mate, best_score, np.nan)


def cmc(ranks: np.ndarray, max_rank: int) -> np.ndarray:
    """cmc[r - 1] = rank-r accuracy over the mated probes (ranks >= 0), r = 1 .. max_rank."""
    mated = np.asarray(ranks)[np.asarray(ranks) >= 0]
    if len(mated) == 0:
        raise ValueError("no mated probes: rank accuracy is undefined")
    return np.array([(mated < r).mean() for r in range(1, max_rank + 1)])


def rank_accuracy(ranks: np.ndarray, k: int) -> float:
    return float(cmc(ranks, k)[-1])


def tpir_at_fpir(
    ranks: np.ndarray, mate_scores: np.ndarray, nonmated_top: np.ndarray, fpirs=FPIR_LEVELS
) -> dict[float, tuple[float, float]]:
    """{fpir: (tpir, threshold)}: the lowest threshold whose FPIR is at most fpir, and the
    TPIR there (see the module docstring). `nonmated_top` holds each non-mated probe's best
    score."""
    ranks, mate_scores = np.asarray(ranks), np.asarray(mate_scores)
    mated = ranks >= 0
    if not mated.any():
        raise ValueError("no mated probes: TPIR is undefined")
    if len(nonmated_top) == 0:
        raise ValueError("no non-mated probes: FPIR is undefined; hold some identities out of the gallery")
    ordered = np.sort(np.asarray(nonmated_top))[::-1]
    hits = mate_scores[mated & (ranks == 0)]
    out = {}
    for fpir in fpirs:
        allowed = math.floor(fpir * len(ordered) + 1e-9)  # non-mated probes that may pass
        if allowed >= len(ordered):
            threshold = -np.inf
        else:  # just above the first non-mated score that must be rejected
            threshold = float(np.nextafter(ordered[allowed], np.inf, dtype=ordered.dtype))
        out[fpir] = (float((hits >= threshold).sum() / mated.sum()), threshold)
    return out


def nonmated_needed(fpir: float) -> int:
    """The fewest non-mated probes that can measure FPIR `fpir`: ceil(1 / fpir), so that one
    false accept is a rate of `fpir` at most. With fewer, the only threshold that keeps FPIR at
    or below `fpir` is the one no non-mated probe passes: the TPIR there says little."""
    return math.ceil(1 / fpir - 1e-9)


def det_curve(ranks: np.ndarray, mate_scores: np.ndarray, nonmated_top: np.ndarray):
    """(fpir, fnir) at every threshold that changes either, thresholds rising."""
    ranks, mate_scores = np.asarray(ranks), np.asarray(mate_scores)
    n_mated = int((ranks >= 0).sum())
    hits = np.sort(mate_scores[ranks == 0])
    non = np.sort(np.asarray(nonmated_top))
    thresholds = np.unique(np.concatenate([hits, non]))
    fpir = 1 - np.searchsorted(non, thresholds, side="left") / max(len(non), 1)
    tpir = (len(hits) - np.searchsorted(hits, thresholds, side="left")) / max(n_mated, 1)
    return fpir, 1 - tpir


def insightface_tpir(scores: np.ndarray, mate_index: np.ndarray, fars=FPIR_LEVELS) -> dict[float, float]:
    """insightface's `ijb_1n.py` figure, for comparison with papers that quote it: every probe
    is mated (`mate_index` = its one gallery column); the threshold is the ceil(far * P)-th
    highest of all P x (G - 1) non-mate scores, and the figure is the fraction of probes whose
    mate score is strictly above it, whatever the mate's rank."""
    scores = np.asarray(scores, dtype=np.float64)
    rows = np.arange(len(scores))
    mate = scores[rows, mate_index]
    non = scores.copy()
    non[rows, mate_index] = -np.inf
    non = np.sort(non[np.isfinite(non)])[::-1]
    out = {}
    for far in fars:
        place = max(math.ceil(len(scores) * far), 1)
        out[far] = float((mate > non[place - 1]).mean()) if place <= len(non) else 1.0
    return out


def plot_cmc_det(
    cmc_curve: np.ndarray, fpir: np.ndarray, fnir: np.ndarray | None, path: str, title: str
) -> None:
    """CMC (rank 1 .. len, linear) beside DET (FNIR against log FPIR), drawn with PIL."""
    w, h, pad = 1280, 480, 60
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((pad, 15), title, fill="black")

    def frame(x0, label, ticks):
        d.rectangle([x0 + pad, pad, x0 + w // 2 - pad, h - pad], outline="black")
        d.text((x0 + pad, h - 22), label, fill="black")
        for t in np.linspace(0, 1, 6):
            d.text((x0 + 15, h - pad - t * (h - 2 * pad) - 6), f"{t:.1f}", fill="black")
        for x, text in ticks:
            d.text((x - 10, h - pad + 6), text, fill="black")

    span = w // 2 - 2 * pad
    n = len(cmc_curve)
    cmc_x = [pad + (r / max(n - 1, 1)) * span for r in range(n)]
    frame(0, "CMC (x: rank, y: identification rate)", [(cmc_x[0], "1"), (cmc_x[-1], str(n))])
    pts = [(x, h - pad - v * (h - 2 * pad)) for x, v in zip(cmc_x, cmc_curve)]
    d.line(pts if len(pts) > 1 else pts * 2, fill="blue", width=2)
    lo = -4.0
    to_x = lambda f: w // 2 + pad + (np.log10(max(f, 1e-4)) - lo) / -lo * span  # noqa: E731
    frame(w // 2, "DET (x: FPIR, log scale; y: FNIR)", [(to_x(10.0**e), f"1e{e}") for e in range(-4, 1)])
    if fnir is not None and len(fpir):
        d.line(
            [(to_x(f), h - pad - v * (h - 2 * pad)) for f, v in zip(fpir, fnir)]
            * (1 if len(fpir) > 1 else 2),
            fill="red",
            width=2,
        )
    with publishing(path) as tmp:
        img.save(tmp, format="PNG")
