"""scripts.align refuses, before any work, what it could only fail on after it: a crop size that
would not fit in memory and photo names whose crops' names the file system cannot hold; and a
photo name that is not UTF-8 (a Latin-1 `José.jpg` from an old camera) is written to its report
as the file system has it."""

import os

import pytest

from shardface.scripts.align import main as align_tool
from tests.astronaut import astronaut_head

dlib = pytest.importorskip("dlib")


@pytest.fixture
def one_photo(tmp_path) -> str:
    os.makedirs(tmp_path / "src" / "p")
    astronaut_head().save(tmp_path / "src" / "p" / "h.png")
    return str(tmp_path / "src")


@pytest.mark.parametrize("size", ["100000", "1025", "15"])
def test_a_crop_size_beyond_the_bounds_is_one_line_before_any_work(one_photo, tmp_path, capsys, size):
    assert align_tool([one_photo, str(tmp_path / "dst"), "--size", size, "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --size {size}: from 16 to 1024 pixels")
    assert not os.path.exists(tmp_path / "dst")


def test_a_photo_whose_crop_names_would_be_too_long_is_named_before_any_work(one_photo, tmp_path, capsys):
    name = "x" * 245 + ".png"  # fits; its second face's crop, x...x.face2.png, would not
    os.rename(os.path.join(one_photo, "p", "h.png"), os.path.join(one_photo, "p", name))
    assert align_tool([one_photo, str(tmp_path / "dst"), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and os.path.join("p", name) in err[0] and "over 255 bytes" in err[0]
    assert not os.path.exists(tmp_path / "dst")
    # one crop: fits
    assert align_tool([one_photo, str(tmp_path / "dst"), "--workers", "1", "--largest"]) == 0


def test_a_photo_name_that_is_not_utf8_is_reported_as_the_file_system_has_it(one_photo, tmp_path):
    latin1 = os.fsencode(os.path.join(one_photo, "p")) + b"/Jos\xe9.png"
    os.rename(os.path.join(one_photo, "p", "h.png"), latin1)
    dst = tmp_path / "dst"
    assert align_tool([one_photo, str(dst), "--workers", "1"]) == 0
    report = (dst / "align_report.csv").read_bytes()
    assert b"p/Jos\xe9.png,1,1,p/Jos\xe9.png" in report
    assert os.path.isfile(os.fsencode(dst / "p") + b"/Jos\xe9.png")
