"""1:N metrics equal their definitions computed directly, probe by probe and threshold by threshold."""

import math

import numpy as np
import pytest

from shardface.eval.identification import (
    cmc,
    det_curve,
    insightface_tpir,
    mate_ranks,
    plot_cmc_det,
    rank_accuracy,
    tpir_at_fpir,
)


def _case(seed, n_gallery=12, n_probes=60, levels=7):
    """Scores on a coarse grid (many ties); identities 0..n_gallery-1 enrolled, 100+ not."""
    rng = np.random.default_rng(seed)
    gallery_labels = rng.permutation(n_gallery)
    probe_labels = np.where(
        rng.random(n_probes) < 0.7, rng.integers(0, n_gallery, n_probes), 100 + rng.integers(0, 5, n_probes)
    )
    scores = rng.integers(0, levels, (n_probes, n_gallery)).astype(np.float32) / levels
    return scores, gallery_labels, probe_labels


def direct_rank(row, gallery_labels, label):
    order = sorted(range(len(row)), key=lambda j: (-row[j], j))  # the search's order
    places = [place for place, j in enumerate(order) if gallery_labels[j] == label]
    return places[0] if places else -1


@pytest.mark.parametrize("seed", range(4))
def test_ranks_cmc_and_rank_k_equal_a_direct_sort_per_probe(seed):
    scores, g, p = _case(seed)
    ranks, mate = mate_ranks(scores, g, p)
    want = [direct_rank(row, g, label) for row, label in zip(scores, p)]
    np.testing.assert_array_equal(ranks, want)
    mated = [r for r in want if r >= 0]
    curve = cmc(ranks, len(g))
    for k in range(1, len(g) + 1):
        assert curve[k - 1] == pytest.approx(sum(r < k for r in mated) / len(mated))
    assert rank_accuracy(ranks, 5) == pytest.approx(sum(r < 5 for r in mated) / len(mated))
    assert curve[-1] == 1.0
    np.testing.assert_array_equal(np.isnan(mate), ranks < 0)


def direct_tpir_at_fpir(scores, g, p, fpir):
    """Try every score as threshold (and +inf); keep the best TPIR whose FPIR <= fpir."""
    nonmated = [row.max() for row, label in zip(scores, p) if label not in set(g)]
    mated = [
        (direct_rank(row, g, label), row[[j for j in range(len(g)) if g[j] == label]].max())
        for row, label in zip(scores, p)
        if label in set(g)
    ]
    best = 0.0
    for t in sorted(set(scores.ravel().tolist())) + [math.inf]:
        fp = sum(s >= t for s in nonmated) / len(nonmated)
        tp = sum(r == 0 and s >= t for r, s in mated) / len(mated)
        if fp <= fpir:
            best = max(best, tp)
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fpir", [0.5, 0.1, 0.01, 0.0, 1.0])
def test_tpir_at_fpir_equals_the_best_threshold_found_by_trying_every_score(seed, fpir):
    scores, g, p = _case(seed, levels=5 + seed * 10)
    ranks, mate = mate_ranks(scores, g, p)
    nonmated_top = scores[ranks < 0].max(1)
    tpir, threshold = tpir_at_fpir(ranks, mate, nonmated_top, [fpir])[fpir]
    assert tpir == pytest.approx(direct_tpir_at_fpir(scores, g, p, fpir))
    assert (nonmated_top >= threshold).mean() <= fpir  # the threshold keeps its promise


def test_det_curve_points_are_fpir_and_fnir_at_each_threshold():
    scores, g, p = _case(7)
    ranks, mate = mate_ranks(scores, g, p)
    non = scores[ranks < 0].max(1)
    fpir, fnir = det_curve(ranks, mate, non)
    thresholds = np.unique(np.concatenate([mate[ranks == 0], non]))
    for t, fp, fn in zip(thresholds, fpir, fnir):
        assert fp == pytest.approx((non >= t).mean())
        assert fn == pytest.approx(1 - ((ranks == 0) & (mate >= t)).sum() / (ranks >= 0).sum())


def test_insightface_figure_is_its_stated_rule():
    rng = np.random.default_rng(3)
    scores = rng.normal(size=(50, 8))
    mates = rng.integers(0, 8, 50)
    got = insightface_tpir(scores, mates, [0.1, 0.01])
    non = sorted((scores[i, j] for i in range(50) for j in range(8) if j != mates[i]), reverse=True)
    for far in (0.1, 0.01):
        th = non[math.ceil(50 * far) - 1]
        assert got[far] == pytest.approx(np.mean([scores[i, mates[i]] > th for i in range(50)]))


def test_open_set_without_non_mated_probes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no non-mated probes"):
        tpir_at_fpir(np.array([0, 1]), np.array([0.5, 0.4]), np.array([]))
    plot_cmc_det(
        np.array([0.5, 0.8, 1.0]), np.array([1.0, 0.1]), np.array([0.0, 0.3]), str(tmp_path / "c.png"), "t"
    )
    assert (tmp_path / "c.png").stat().st_size > 0
