"""IJB-B / IJB-C 1:N identification (the mixed-media protocol).

Meta files under `root/meta`, beside the 1:1 ones eval/ijb.py reads (<prefix>_face_tid_mid.txt,
<prefix>_name_5pts_score.txt): the two disjoint galleries <prefix>_1N_gallery_G1.csv and _G2.csv
(IJB-B: _S1.csv, _S2.csv) and the probes <prefix>_1N_probe_mixed.csv, each a CSV with a header
line and rows TEMPLATE_ID,SUBJECT_ID[,...], one row per image of the template. Templates are
pooled exactly as in the 1:1 path (eval.ijb: detector-score-weighted flip-test features, media
averaged, summed, L2-normalised); a score is the cosine of two templates.

Reported per gallery (IJB-C's open-set protocol): every probe is searched against G; probes of
G's subjects are mated, the others (the other gallery's subjects) non-mated; rank-1/rank-5 over
the mated probes and TPIR at FPIR 1e-1, 1e-2 (eval/identification.py). And, to compare with
papers that quote insightface's `ijb_1n.py`: G1 and G2 together as one gallery (every probe
mated), its rank-1/rank-5 and its TPIR figure (`insightface_tpir`)."""

from __future__ import annotations

import os

import numpy as np

from shardface.dataset import DataError
from shardface.eval.identification import (
    FPIR_LEVELS,
    insightface_tpir,
    mate_ranks,
    rank_accuracy,
    tpir_at_fpir,
)
from shardface.eval.ijb import image_features, read_faces, template_features

GALLERIES = {"ijbc": ("G1", "G2"), "ijbb": ("S1", "S2")}


def read_template_subjects(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(templates, their subjects), each template once, in first-seen order."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: IJB 1:N meta file not found")
    subject_of: dict[int, int] = {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()[1:]  # the header line
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read this IJB meta file ({exc})") from None
    for lineno, line in enumerate(lines, 2):
        if not line.strip():
            continue
        fields = line.split(",")
        try:
            template, subject = int(fields[0]), int(fields[1])
        except (ValueError, IndexError):
            raise DataError(f"{path}:{lineno}: expected TEMPLATE_ID,SUBJECT_ID,..., got {line!r}") from None
        if subject_of.setdefault(template, subject) != subject:
            raise DataError(
                f"{path}:{lineno}: template {template} listed with subjects "
                f"{subject_of[template]} and {subject}"
            )
    if not subject_of:
        raise DataError(f"{path}: no templates")
    return np.array(list(subject_of)), np.array(list(subject_of.values()))


def search_metrics(probe_feats, probe_subjects, gallery_feats, gallery_subjects) -> dict:
    """rank-1, rank-5 and TPIR@FPIR of probes searched against one gallery."""
    scores = probe_feats @ gallery_feats.T
    ranks, mate = mate_ranks(scores, gallery_subjects, probe_subjects)
    out = {
        "mated": int((ranks >= 0).sum()),
        "nonmated": int((ranks < 0).sum()),
        "rank1": rank_accuracy(ranks, 1),
        "rank5": rank_accuracy(ranks, min(5, len(gallery_subjects))),
    }
    if out["nonmated"]:
        out["tpir"] = {
            f: t for f, (t, _) in tpir_at_fpir(ranks, mate, scores[ranks < 0].max(1), FPIR_LEVELS).items()
        }
    return out


def identification_results(template_ids, template_feats, galleries: dict, probes) -> dict:
    """{gallery name: metrics, "G1+G2 (insightface)": metrics} from pooled templates."""
    row = {t: i for i, t in enumerate(template_ids)}

    def feats(templates, what):
        missing = [t for t in templates if t not in row]
        if missing:
            raise DataError(f"{what} names template {missing[0]} that has no faces in face_tid_mid.txt")
        return template_feats[[row[t] for t in templates]]

    p_feats = feats(probes[0], "probe_mixed.csv")
    results = {
        name: search_metrics(p_feats, probes[1], feats(t, name), s) for name, (t, s) in galleries.items()
    }
    g_templates = np.concatenate([t for t, _ in galleries.values()])
    g_subjects = np.concatenate([s for _, s in galleries.values()])
    g_feats = feats(g_templates, "gallery")
    both = search_metrics(p_feats, probes[1], g_feats, g_subjects)
    mate_of = {}
    for i, s in enumerate(g_subjects):
        if s in mate_of:
            raise DataError(f"subject {s} has two gallery templates; insightface's combined search needs one")
        mate_of[s] = i
    mated = np.array([s in mate_of for s in probes[1]])
    idx = np.array([mate_of[s] for s in probes[1][mated]])
    both.pop("tpir", None)
    both["tpir"] = insightface_tpir(p_feats[mated] @ g_feats.T, idx, FPIR_LEVELS)
    results[" + ".join(galleries) + " (insightface)"] = both
    return results


def evaluate_ijb_1n(root: str, backbone, prefix: str = "ijbc", batch_size: int = 64) -> dict:
    names, templates, medias, landmarks, det_scores = read_faces(root, prefix)
    meta = os.path.join(root, "meta")
    galleries = {
        g: read_template_subjects(os.path.join(meta, f"{prefix}_1N_gallery_{g}.csv"))
        for g in GALLERIES[prefix]
    }
    probes = read_template_subjects(os.path.join(meta, f"{prefix}_1N_probe_mixed.csv"))
    feats = image_features(root, names, landmarks, backbone, batch_size) * det_scores[:, None]
    ids, tfeats = template_features(feats, templates, medias)
    return identification_results(ids, tfeats, galleries, probes)
