"""CFP's own protocol (eval/cfp.py) on a small folder in its layout: its pairs in split order on
its own 10 folds, every bad line named by file and line, `--protocol` refused where it means
nothing, and the .bin files make_bin writes from it read by training's loader and, as its
format says, by arcface_torch's, scoring what the photos score."""

import os
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from shardface.eval.cfp import read_cfp, read_list
from shardface.eval.pairs import PairListError
from shardface.eval.verification import load_bin
from shardface.scripts.make_bin import main as make_bin
from shardface.scripts.verify import main as verify
from tests.cfp_fixture import FRONTAL, PEOPLE, PROFILE, cfp_root
from tests.gallery_files import seeded_model

dlib = pytest.importorskip("dlib")


@pytest.fixture(scope="module")
def cfp(tmp_path_factory) -> str:
    return cfp_root(tmp_path_factory.mktemp("cfp"))


def _photo(cfp, person, kind, i):
    return os.path.join(cfp, "Data", "Images", f"{person:03d}", kind, f"{i:02d}.jpg")


@pytest.mark.parametrize("protocol", ["FP", "FF"])
def test_the_protocol_reads_in_split_order_on_its_own_ten_folds(cfp, protocol):
    pairs = read_cfp(cfp, protocol)
    assert len(pairs.pairs) == 20 and pairs.folds == [(2 * k, 2 * k + 2) for k in range(10)]
    assert pairs.issame == [True, False] * 10  # each split: its same pairs, then its different ones
    second, per = ("profile", PROFILE) if protocol == "FP" else ("frontal", FRONTAL)
    for k in range(10):  # the fixture's fold k, by construction
        a, b = k % PEOPLE + 1, (k + 1) % PEOPLE + 1
        first = _photo(cfp, a, "frontal", k % FRONTAL + 1)
        assert pairs.pairs[2 * k] == (first, _photo(cfp, a, second, (k + 1) % per + 1))
        assert pairs.pairs[2 * k + 1] == (first, _photo(cfp, b, second, k % per + 1))
    assert all(p.startswith(os.path.join(cfp, "Data", "Images")) for p in pairs.photos)


def _copy(cfp, tmp_path) -> str:
    import shutil

    shutil.copytree(cfp, tmp_path / "cfp")
    return str(tmp_path / "cfp")


@pytest.mark.parametrize(
    "file,line,text,message",
    [
        ("Protocol/Split/FP/03/diff.txt", 1, "2;3", r"Split/FP/03/diff.txt:1: expected `i,j`"),
        (
            "Protocol/Split/FP/07/same.txt",
            1,
            "2,99",
            r"Split/FP/07/same.txt:1: pair 2,99 is outside the lists",
        ),
        ("Protocol/Split/FP/02/same.txt", 1, "2,³", r"Split/FP/02/same.txt:1: expected `i,j`"),
        (
            "Protocol/Pair_list_P.txt",
            3,
            "7 ../Data/Images/002/profile/01.jpg",
            r"Pair_list_P.txt:3: expected `3 PATH`",
        ),
        (
            "Protocol/Pair_list_F.txt",
            2,
            "2 ../Data/Images/001/frontal/09.jpg",
            r"Pair_list_F.txt:2: photo \S+09.jpg not found",
        ),
    ],
)
def test_a_bad_protocol_line_is_named_by_file_and_line(cfp, tmp_path, file, line, text, message):
    root = _copy(cfp, tmp_path)
    path = os.path.join(root, file)
    lines = open(path).read().splitlines()
    lines[line - 1] = text
    open(path, "w").write("\n".join(lines) + "\n")
    with pytest.raises(PairListError, match=message):
        read_cfp(root, "FP")


def test_folds_of_unequal_size_are_refused_naming_them(cfp, tmp_path):
    root = _copy(cfp, tmp_path)
    with open(os.path.join(root, "Protocol", "Split", "FF", "04", "same.txt"), "a") as f:
        f.write("1,2\n")
    with pytest.raises(PairListError, match=r"Split/FF: its folds hold 2, 2, 2, 3, 2"):
        read_cfp(root, "FF")


def test_splits_past_ten_are_refused_naming_them_not_dropped(cfp, tmp_path, capsys):
    root = _copy(cfp, tmp_path)
    for extra in ("11", "12"):
        shutil.copytree(
            os.path.join(root, "Protocol", "Split", "FP", "01"),
            os.path.join(root, "Protocol", "Split", "FP", extra),
        )
    with pytest.raises(
        PairListError, match=r"Split/FP: holds 11, 12 beside CFP's 10 splits 01-10.*move them out"
    ):
        read_cfp(root, "FP")
    model = seeded_model(str(tmp_path / "m"), 0)
    assert verify([model, "--pairs_list", root, "--protocol", "FP"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds 11, 12 beside CFP's 10 splits" in err[0]
    read_cfp(root, "FF")  # the other protocol's splits are as they should be


def test_protocol_options_where_they_mean_nothing_are_one_line(cfp, tmp_path, capsys):
    model = seeded_model(str(tmp_path / "m"), 0)
    listing = tmp_path / "pairs.txt"
    listing.write_text("a.jpg b.jpg 1\n" * 10)
    for argv, said in (
        (["--pairs_list", cfp], "a CFP root; pass --protocol FP"),
        (
            ["--pairs_list", str(listing), "--images", str(tmp_path), "--protocol", "FP"],
            "--protocol FP: for a CFP root",
        ),
        (
            ["--pairs_list", cfp, "--protocol", "FP", "--images", str(tmp_path)],
            "CFP's photos are under its root",
        ),
    ):
        assert verify([model, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0]
    assert make_bin([cfp, str(tmp_path / "x.bin"), "--protocol", "FP"]) == 2
    assert "--protocol are for --pairs_list" in capsys.readouterr().err
    assert make_bin([str(tmp_path), str(tmp_path / "x.bin"), "--pairs_list", cfp, "--protocol", "FP"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: FOLDER {tmp_path}: CFP's photos are under its root")
    with pytest.raises(PairListError, match="CFP's protocols are FP and FF"):
        read_list(cfp, None, "PF")


def _arcface_torch_reads(path: str) -> tuple[list[np.ndarray], list[bool]]:
    """What arcface_torch's load_bin does with a .bin, written from its format: a pickle of (list of
    encoded images, list of bools), read with encoding='bytes' under Python 3, each image decoded
    to H x W x 3 RGB, two images a pair."""
    import io

    with open(path, "rb") as f:
        bins, issame = pickle.load(f, encoding="bytes")
    assert len(bins) == 2 * len(issame)
    return [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in bins], list(issame)


@pytest.mark.parametrize("protocol", ["FP", "FF"])
def test_make_bin_writes_the_protocol_in_pair_order_for_training_and_arcface_torch(
    cfp, tmp_path, capsys, protocol
):
    from shardface.eval.callback import VerificationCallback

    name = f"cfp_{protocol.lower()}"
    out = str(tmp_path / f"{name}.bin")
    assert (
        make_bin(
            [
                cfp,
                out,
                "--pairs_list",
                cfp,
                "--protocol",
                protocol,
                "--align",
                "--workers",
                "1",
                "--cache_dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    pairs = read_cfp(cfp, protocol)
    (images, _), issame = load_bin(out)
    assert issame == pairs.issame and images.shape == (40, 3, 112, 112)
    theirs, their_issame = _arcface_torch_reads(out)
    assert their_issame == pairs.issame and all(i.shape == (112, 112, 3) for i in theirs)
    np.testing.assert_array_equal(np.stack(theirs), images.permute(0, 2, 3, 1).numpy())
    if protocol == "FP":
        # the faceless profiles: fallbacks, named
        assert "no face found in" in said and "profile/02.jpg" in said
    # training's verification reads it by its insightface name from val_dir
    callback = VerificationCallback([name], str(tmp_path), 1, None)
    assert list(callback.sets) == [name] and callback.sets[name][1] == pairs.issame


def test_verify_from_the_photos_scores_what_verify_of_the_bin_scores(cfp, tmp_path, capsys):
    """A 112x112 model sees the same crops both ways (the .bin's are lossless PNGs)."""
    out = str(tmp_path / "cfp_fp.bin")
    model = seeded_model(str(tmp_path / "m"), 1)
    assert (
        make_bin(
            [
                cfp,
                out,
                "--pairs_list",
                cfp,
                "--protocol",
                "FP",
                "--align",
                "--workers",
                "1",
                "--cache_dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert (
        verify(
            [
                model,
                "--bin",
                out,
                "--pairs_list",
                cfp,
                "--protocol",
                "FP",
                "--cache_dir",
                str(tmp_path),
                "--batch_size",
                "8",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line.startswith("cfp_fp")]
    assert len(rows) == 2 and rows[0][0] == "cfp_fp" and rows[1][0] == "cfp_fp.bin"
    assert rows[0][1:] == rows[1][1:]  # acc, acc-flip, std, XNorm


def test_a_cfp_root_searches_its_profiles_with_dlibs_cnn_by_default(cfp, tmp_path, capsys):
    """On a CFP root, dlib's CNN detector searches the photos where HOG finds no face, with no
    flag, in verify and make_bin alike; `--retry_mmod false` leaves it out; a plain list of the
    same photos keeps HOG alone unless asked."""
    cache = ["--cache_dir", str(tmp_path), "--workers", "1"]
    cfp_fp = ["--pairs_list", cfp, "--protocol", "FP", *cache]
    searched = f"--retry_mmod: a face found in 0 of the {PEOPLE} photos searched again"  # the blanks
    assert verify(["dlib", *cfp_fp]) == 0
    assert searched in capsys.readouterr().out
    assert make_bin([cfp, str(tmp_path / "cfp_fp.bin"), *cfp_fp, "--align"]) == 0
    assert searched in capsys.readouterr().out
    assert verify(["dlib", *cfp_fp, "--retry_mmod", "false"]) == 0
    said = capsys.readouterr().out
    assert "--retry_mmod:" not in said and "--retry_mmod may find more" in said
    plain = tmp_path / "plain.txt"
    fp = read_cfp(cfp, "FP")
    plain.write_text("".join(f"{a} {b} {int(same)}\n" for (a, b), same in zip(fp.pairs, fp.issame)))
    plain_list = ["--pairs_list", str(plain), "--images", cfp, *cache]
    assert verify(["dlib", *plain_list]) == 0
    assert "--retry_mmod:" not in capsys.readouterr().out
    assert verify(["dlib", *plain_list, "--retry_mmod"]) == 0
    assert searched in capsys.readouterr().out


@pytest.mark.slow  # a benchmark script's check; verify's own CFP path is held by the tests above
def test_the_detector_study_scores_what_verify_scores_and_resumes(cfp, tmp_path, capsys):
    """benchmarks/cfp_detectors.py: faces found per option (the blank profiles in none), and FP
    scored on an option's faces exactly as `verify --pairs_list CFP --protocol FP` scores them
    with the same detector; a chain keeps the first option's faces; a second run searches nothing."""
    root = cfp_root(tmp_path / "study")
    study = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "cfp_detectors.py"),
        root,
    ]
    done = subprocess.run(
        [*study, "--options", "hog1,hog0", "--accuracy", "hog1,hog1+hog0"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    frontal, profile = PEOPLE * FRONTAL, PEOPLE * PROFILE
    for option in ("hog0", "hog1"):
        assert f"| {option} | {frontal} / {frontal} (1.0000) | {PEOPLE} / {profile} (0.5000) |" in done.stdout
    # the accuracy table's
    rows = [
        line.split("|")[2:]
        for line in done.stdout.splitlines()
        if line.startswith(("| hog1 |", "| hog1+hog0 |")) and " / " not in line
    ]
    assert len(rows) == 2 and rows[0] == rows[1], done.stdout
    faceless, acc, acc_flip = rows[0][0].strip(), rows[0][1].split()[0], rows[0][2].split()[0]
    assert faceless == f"{PEOPLE} of {len(read_cfp(root, 'FP').photos)}"  # the blank profiles
    assert (
        verify(
            [
                "dlib",
                "--pairs_list",
                root,
                "--protocol",
                "FP",
                "--retry_mmod",
                "false",
                "--cache_dir",
                str(tmp_path),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    scored = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("cfp_fp"))
    assert scored[1:3] == [acc, acc_flip]
    again = subprocess.run([*study, "--options", "hog1"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "photos," not in again.stdout  # no progress line: nothing searched
