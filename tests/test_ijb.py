"""IJB 1:1 evaluation on a generated fixture whose TAR@FAR is known by construction."""

import numpy as np
import pytest
import torch
from PIL import Image

from shardface.eval.ijb import evaluate_ijb
from shardface.faces.align import ARCFACE_112, align, similarity_transform
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
    (tmp_path / "meta").mkdir()
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


class NeverCalled(MeanColour):
    def forward(self, x):
        raise AssertionError("embedded images before checking the output")


def test_roc_over_an_existing_file_is_refused_before_embedding_unless_overwrite(tmp_path):
    """--roc follows every tool's output rule (identify_eval's --plot): a photo there stays."""
    from shardface.errors import OutputError

    make_ijb_fixture(tmp_path)
    photo = tmp_path / "holiday.png"
    Image.new("RGB", (8, 8), "red").save(photo)
    before = photo.read_bytes()
    with pytest.raises(OutputError, match=r"--roc .*holiday.png exists; pass --overwrite"):
        evaluate_ijb(str(tmp_path), NeverCalled(), "ijbc", roc_path=str(photo))
    assert photo.read_bytes() == before
    evaluate_ijb(str(tmp_path), MeanColour(), "ijbc", batch_size=16, roc_path=str(photo), overwrite=True)
    assert Image.open(photo).size == (640, 480)


def _tool(argv, capsys):
    from shardface.scripts.ijb import main

    capsys.readouterr()
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


def test_ijb_tool_refuses_an_existing_roc_and_a_wrong_root_in_one_line(tmp_path, capsys):
    make_ijb_fixture(tmp_path)
    photo = tmp_path / "holiday.png"
    photo.write_bytes(b"a photo")
    rc, err = _tool(["no-such-model", "--root", str(tmp_path), "--roc", str(photo)], capsys)
    assert rc == 2 and err.count("\n") == 0 and "holiday.png exists; pass --overwrite" in err
    assert photo.read_bytes() == b"a photo"
    rc, err = _tool(["no-such-model", "--root", str(tmp_path / "IJBC")], capsys)
    assert rc == 2 and err.count("\n") == 0 and "IJBC: IJB directory not found" in err
    rc, err = _tool(["no-such-model", "--root", str(tmp_path / "loose_crop")], capsys)
    assert rc == 2 and err.count("\n") == 0 and "no meta/ folder" in err


@pytest.mark.parametrize(
    "file,line,damage,expected",
    [
        (
            "ijbc_name_5pts_score.txt",
            3,
            lambda f: [f[0], "x3.5", *f[2:]],
            r"ijbc_name_5pts_score.txt:3: field 2 is 'x3.5'",
        ),
        (
            "ijbc_name_5pts_score.txt",
            1,
            lambda f: [*f[:11], "nan"],
            r"ijbc_name_5pts_score.txt:1: field 12 is 'nan'",
        ),
        (
            "ijbc_face_tid_mid.txt",
            2,
            lambda f: [f[0], "seven", f[2]],
            r"ijbc_face_tid_mid.txt:2: field 2 is 'seven'",
        ),
        (
            "ijbc_template_pair_label.txt",
            4,
            lambda f: [f[0], f[1], "2"],
            r"ijbc_template_pair_label.txt:4: label 2",
        ),
        (
            "ijbc_template_pair_label.txt",
            5,
            lambda f: f[:2],
            r"ijbc_template_pair_label.txt:5: expected 3 fields",
        ),
        (  # found before any face is embedded (NeverCalled), not after all of them
            "ijbc_template_pair_label.txt",
            4,
            lambda f: ["999", f[1], f[2]],
            r"ijbc_template_pair_label.txt:4: template 999 has no faces in ijbc_face_tid_mid.txt",
        ),
    ],
)
def test_malformed_meta_line_is_a_data_error_naming_file_line_and_field(
    tmp_path, file, line, damage, expected
):
    from shardface.dataset.errors import DataError

    make_ijb_fixture(tmp_path)
    path = tmp_path / "meta" / file
    lines = path.read_text().splitlines()
    lines[line - 1] = " ".join(damage(lines[line - 1].split()))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=expected):
        evaluate_ijb(str(tmp_path), NeverCalled(), "ijbc")


def test_malformed_meta_through_the_tool_is_one_line(tmp_path, capsys):
    from shardface import backbones

    make_ijb_fixture(tmp_path)
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    path = tmp_path / "meta" / "ijbc_face_tid_mid.txt"
    path.write_text(path.read_text().replace(" 0 0\n", " 0 zero\n", 1))
    rc, err = _tool([str(tmp_path / "model.pt"), "--network", "tiny", "--root", str(tmp_path)], capsys)
    assert rc == 2 and err.count("\n") == 0 and "ijbc_face_tid_mid.txt:1: field 3 is 'zero'" in err


def test_meta_files_with_a_utf8_bom_read_as_without(tmp_path):
    """An editor's BOM is not part of the first image's name (eval.pairs reads LFW's list so too)."""
    make_ijb_fixture(tmp_path)
    plain = evaluate_ijb(str(tmp_path), MeanColour(), "ijbc", batch_size=16)
    for name in ("ijbc_face_tid_mid.txt", "ijbc_template_pair_label.txt"):
        path = tmp_path / "meta" / name
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert evaluate_ijb(str(tmp_path), MeanColour(), "ijbc", batch_size=16) == plain
