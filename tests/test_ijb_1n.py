"""IJB 1:N on a generated miniature in IJB-C's file layout: every figure equals one computed in
this file from the definitions (pooling, ranks, thresholds tried one by one)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from shardface.eval.ijb_1n import evaluate_ijb_1n
from shardface.faces.align import ARCFACE_112
from shardface.scripts.ijb import main as ijb


class MeanColour(torch.nn.Module):
    """A solid colour c embeds (crop and mirror alike) to (c - 127.5) / 127.5."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x.mean(dim=(2, 3)) + 0 * self.dummy


def _make(root, rng, prefix="ijbc", galleries=("G1", "G2")):
    """8 subjects: 0-3 in G1, 4-7 in G2 (one template each); 3 probe templates per subject.
    Each template: two media, the first with two images; colours = subject direction + noise."""
    (root / "meta").mkdir(parents=True)
    (root / "loose_crop").mkdir()
    directions = rng.normal(size=(8, 3))
    faces, marks, colour_of, score_of, media_of, template_of = [], [], {}, {}, {}, {}
    csv = {g: ["TEMPLATE_ID,SUBJECT_ID,FILENAME"] for g in (*galleries, "probe")}
    template = 100
    for subject in range(8):
        for kind in [galleries[subject // 4]] + ["probe"] * 3:
            for media, count in ((0, 2), (1, 1)):
                for k in range(count):
                    name = f"{template}_{media}_{k}.png"
                    u = directions[subject] + rng.normal(0, 0.9, 3)
                    colour = np.round(127.5 + 100 * u / np.abs(u).max()).astype(int)
                    Image.new("RGB", (150, 150), tuple(int(c) for c in colour)).save(
                        root / "loose_crop" / name
                    )
                    score = rng.uniform(0.5, 1)
                    faces.append(f"{name} {template} {template * 10 + media}")
                    pts = ARCFACE_112.points + 15 + rng.normal(0, 1, (5, 2))
                    marks.append(name + " " + " ".join(f"{v:.3f}" for v in pts.ravel()) + f" {score:.3f}")
                    colour_of[name], score_of[name] = colour, float(f"{score:.3f}")
                    media_of[name], template_of[name] = template * 10 + media, template
                    csv[kind].append(f"{template},{subject},{name}")
            template += 1
    (root / "meta" / f"{prefix}_face_tid_mid.txt").write_text("\n".join(faces) + "\n")
    (root / "meta" / f"{prefix}_name_5pts_score.txt").write_text("\n".join(marks) + "\n")
    for g in galleries:
        (root / "meta" / f"{prefix}_1N_gallery_{g}.csv").write_text("\n".join(csv[g]) + "\n")
    (root / "meta" / f"{prefix}_1N_probe_mixed.csv").write_text("\n".join(csv["probe"]) + "\n")
    return csv, colour_of, score_of, media_of, template_of


def _pooled(csv_rows, colour_of, score_of, media_of):
    """template -> (subject, feature): per image 2 (c - 127.5) / 127.5 * score, media means summed, unit norm."""
    images = {}
    for row in csv_rows[1:]:
        t, s, name = row.split(",")
        images.setdefault((int(t), int(s)), []).append(name)
    out = {}
    for (t, s), names in images.items():
        total = np.zeros(3)
        for m in sorted({media_of[n] for n in names}):
            total += np.mean(
                [2 * (colour_of[n] - 127.5) / 127.5 * score_of[n] for n in names if media_of[n] == m], 0
            )
        out[t] = (s, total / np.linalg.norm(total))
    return out


def _direct(probes, gallery):
    g = list(gallery.values())
    ranks, mate_scores, non_top = [], [], []
    for s, f in probes.values():
        row = [f @ gf for _, gf in g]
        order = sorted(range(len(g)), key=lambda j: (-row[j], j))
        places = [p for p, j in enumerate(order) if g[j][0] == s]
        if places:
            ranks.append(places[0])
            mate_scores.append(row[order[places[0]]])
        else:
            non_top.append(max(row))
    out = {"rank1": np.mean([r < 1 for r in ranks]), "rank5": np.mean([r < 5 for r in ranks]), "tpir": {}}
    for fpir in (0.1, 0.01) if non_top else ():
        best = 0.0
        for t in sorted(set(mate_scores + non_top)) + [math.inf]:
            if np.mean([v >= t for v in non_top]) <= fpir:
                best = max(best, np.mean([r == 0 and v >= t for r, v in zip(ranks, mate_scores)]))
        out["tpir"][fpir] = best
    return out


def test_ijbc_1n_metrics_equal_a_direct_computation(tmp_path):
    csv, colour_of, score_of, media_of, _ = _make(tmp_path, np.random.default_rng(0))
    probes = _pooled(csv["probe"], colour_of, score_of, media_of)
    galleries = {g: _pooled(csv[g], colour_of, score_of, media_of) for g in ("G1", "G2")}
    got = evaluate_ijb_1n(str(tmp_path), MeanColour(), "ijbc", batch_size=7)
    for g, gallery in galleries.items():
        want = _direct(probes, gallery)
        assert got[g]["mated"] == 12 and got[g]["nonmated"] == 12
        assert got[g]["rank1"] == pytest.approx(want["rank1"], abs=1e-6)
        assert got[g]["rank5"] == pytest.approx(want["rank5"], abs=1e-6)
        for fpir in (0.1, 0.01):
            assert got[g]["tpir"][fpir] == pytest.approx(want["tpir"][fpir], abs=1e-6)
    both = {**galleries["G1"], **galleries["G2"]}
    want = _direct(probes, both)
    combined = got["G1 + G2 (insightface)"]
    assert combined["mated"] == 24 and combined["rank1"] == pytest.approx(want["rank1"], abs=1e-6)
    g = list(both.values())
    non = sorted((f @ gf for s, f in probes.values() for gs, gf in g if gs != s), reverse=True)
    for far in (0.1, 0.01):
        th = non[math.ceil(24 * far) - 1]
        pos = [f @ next(gf for gs, gf in g if gs == s) for s, f in probes.values()]
        assert combined["tpir"][far] == pytest.approx(np.mean([p > th for p in pos]))


def test_ijbb_layout_through_the_tool_and_a_missing_gallery_file_is_named(tmp_path, capsys):
    root = tmp_path / "IJBB"
    _make(root, np.random.default_rng(1), "ijbb", ("S1", "S2"))
    model = tmp_path / "model.pt"
    import json

    from shardface.backbones import get_model

    torch.save(get_model("tiny", num_features=16).eval().state_dict(), model)
    json.dump({"network": "tiny"}, open(tmp_path / "config.json", "w"))
    assert ijb([str(model), "--root", str(root), "--target", "IJBB", "--protocol", "1:N"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split()[1] for line in out] == ["S1", "S2", "S1"]
    (root / "meta" / "ijbb_1N_gallery_S2.csv").unlink()
    assert ijb([str(model), "--root", str(root), "--target", "IJBB", "--protocol", "1:N"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ijbb_1N_gallery_S2.csv: IJB 1:N meta file not found" in err
