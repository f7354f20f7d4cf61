"""IJB 1:1 evaluation on a generated fixture whose TAR@FAR is known by construction."""
import numpy as np
import pytest
from PIL import Image

from eval.ijb import evaluate_ijb
from faces.align import ARCFACE_112, align, similarity_transform
from tests.ijb_fixture import MeanColour, make_ijb_fixture

ARCFACE_TEMPLATE = ARCFACE_112.points


def test_tar_at_far_matches_construction(tmp_path):
    make_ijb_fixture(tmp_path)
    roc = tmp_path / "roc.png"
    tars = evaluate_ijb(str(tmp_path), MeanColour(), "ijbc", batch_size=16, roc_path=str(roc))
    assert tars[1e-6] == pytest.approx(0.7) and tars[1e-2] == pytest.approx(0.7)
    assert tars[1e-1] == pytest.approx(0.8)
    assert Image.open(roc).size == (640, 480)


def test_similarity_transform_recovers_a_known_similarity():
    angle, scale, shift = 0.3, 1.7, np.array([5.0, -3.0])
    rot = scale * np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    dst = ARCFACE_TEMPLATE @ rot.T + shift
    m = similarity_transform(ARCFACE_TEMPLATE, dst)
    np.testing.assert_allclose(m[:, :2], rot, atol=1e-9)
    np.testing.assert_allclose(m[:, 2], shift, atol=1e-9)


def test_alignment_moves_landmarks_onto_template():
    img = Image.new("RGB", (200, 200), "black")
    marks = ARCFACE_TEMPLATE * 1.5 + 20
    from PIL import ImageDraw
    d = ImageDraw.Draw(img)
    x, y = marks[0]
    d.ellipse([x - 3, y - 3, x + 3, y + 3], fill="white")
    out = np.asarray(align(img, marks)).mean(2)
    w = out / out.sum()
    ys, xs = np.mgrid[:112, :112]
    # within PIL's half-pixel drawing convention of the dot itself
    assert abs((w * xs).sum() - ARCFACE_TEMPLATE[0, 0]) < 0.75
    assert abs((w * ys).sum() - ARCFACE_TEMPLATE[0, 1]) < 0.75


def test_missing_meta_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="ijbc_face_tid_mid.txt"):
        evaluate_ijb(str(tmp_path), MeanColour())


def test_roc_path_in_a_missing_directory_is_refused_before_embedding(tmp_path):
    make_ijb_fixture(tmp_path)
    class NeverCalled(MeanColour):
        def forward(self, x):
            raise AssertionError("embedded images before checking the output")
    with pytest.raises(ValueError, match=r"--roc .*missing/roc.png: the directory .*missing does not exist"):
        evaluate_ijb(str(tmp_path), NeverCalled(), "ijbc", roc_path=str(tmp_path / "missing" / "roc.png"))


def test_pairs_without_impostors_are_named_not_a_zero_size_error(tmp_path):
    make_ijb_fixture(tmp_path)
    pairs = tmp_path / "meta" / "ijbc_template_pair_label.txt"
    pairs.write_text("".join(line.rsplit(" ", 1)[0] + " 1\n" for line in pairs.read_text().splitlines()))
    with pytest.raises(ValueError, match=r"ijbc_template_pair_label.txt: no impostor \(label 0\) pairs"):
        evaluate_ijb(str(tmp_path), MeanColour(), "ijbc")
