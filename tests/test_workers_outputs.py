"""The other tools that find faces write the same bytes with one worker process and with two:
make_bin --align (drawn pairs and a pair list), embed --align, and a gallery's enrolment
(scripts.align and pack_rec --align: tests/test_align_workers.py). The photos are those of that
file (tests/astronaut.py's align_photos): heads turned, a photo holding two, a wall without a face."""

import os

import numpy as np
import pytest

import shardface.faces.workers
from shardface.infer.enrolment import enrol
from shardface.infer.model import load_model
from shardface.scripts.embed import main as embed_tool
from shardface.scripts.make_bin import main as make_bin
from tests.astronaut import align_photos
from tests.tool_files import tiny_model


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    return align_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The worker count of every pool started (one worker runs in this process, without a pool)."""
    started, real = [], shardface.faces.workers._pooled

    def counting(fn, items, workers, *args):
        started.append(workers)
        return real(fn, items, workers, *args)

    monkeypatch.setattr(shardface.faces.workers, "_pooled", counting)
    return started


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_make_bin_align_writes_the_same_bin_with_one_and_two_workers(photos, tmp_path, capsys, pools):
    out = {}
    for workers in ("1", "2"):
        dst = str(tmp_path / f"w{workers}.bin")
        assert make_bin([photos, dst, "--align", "--pairs", "10", "--workers", workers]) == 0
        out[workers] = (_bytes(dst), capsys.readouterr().out.replace(dst, "OUT"))
    assert out["1"] == out["2"]
    assert pools and set(pools) == {2}  # the second run did use two processes


def test_make_bin_align_of_a_pair_list_is_the_same_with_one_and_two_workers(photos, tmp_path, capsys, pools):
    """The list names the wall (no face: a fallback crop) and the photo holding two faces."""
    listing = tmp_path / "pairs.txt"
    listing.write_text(
        "p/h0.png p/h1.png 1\np/two.png q/wall.png 0\nq/m0.jpg q/m1.jpg 1\np/h2.png q/a.jpg 0\n"
        "p/h1.png p/h2.png 1\nq/a.jpg q/m0.jpg 0\np/h0.png p/two.png 1\nq/a.png q/wall.png 0\n"
        "q/a.jpg q/a.png 1\np/h0.png q/m1.jpg 0\n"
    )
    out = {}
    for workers in ("1", "2"):
        dst = str(tmp_path / f"w{workers}.bin")
        cache = str(tmp_path / f"cache{workers}")  # each run detects afresh
        os.makedirs(cache)
        assert (
            make_bin(
                [
                    photos,
                    dst,
                    "--align",
                    "--pairs_list",
                    str(listing),
                    "--workers",
                    workers,
                    "--cache_dir",
                    cache,
                ]
            )
            == 0
        )
        said = capsys.readouterr().out.replace(dst, "OUT").replace(cache, "CACHE")
        out[workers] = (_bytes(dst), said)
    assert out["1"] == out["2"]
    assert pools and set(pools) == {2}  # the second run did use two processes
    assert "wall.png" in out["1"][1]  # the fallback is named, with either count


def test_embed_align_writes_the_same_arrays_and_listing_with_one_and_two_workers(photos, tmp_path, pools):
    model = tiny_model(str(tmp_path / "run"))
    out = {}
    for workers in ("1", "2"):
        dst = str(tmp_path / f"w{workers}.npy")
        assert (
            embed_tool([model, photos, "--out", dst, "--align", "--workers", workers, "--batch_size", "2"])
            == 0
        )
        out[workers] = (_bytes(dst), _bytes(dst[: -len(".npy")] + ".txt"))
    assert out["1"] == out["2"]
    assert pools and set(pools) == {2}  # the second run did use two processes
    assert len(np.load(str(tmp_path / "w1.npy"))) >= 7  # every photo with a face, both faces of two.png


def _rows(path: str) -> list:
    """A gallery file's header and rows, in key order (the database's pages may differ)."""
    import sqlite3

    with sqlite3.connect(path) as db:
        return (
            db.execute("SELECT json FROM header").fetchall()
            + db.execute("SELECT * FROM rows ORDER BY key").fetchall()
        )


def test_a_gallery_enrolled_with_two_workers_is_the_one_enrolled_with_one(photos, tmp_path, pools):
    """The same gallery file (its header and rows) and the same templates."""
    model = load_model(tiny_model(str(tmp_path / "run")))
    got = {}
    for workers in (1, 2):
        cache = str(tmp_path / f"gallery{workers}.sqlite")
        gallery = enrol(photos, model, align=True, cache=cache, show_progress=False, workers=workers)
        got[workers] = (_rows(cache), gallery.names, gallery.templates.tobytes(), gallery.images)
    assert got[1] == got[2]
    assert pools and set(pools) == {2}
    assert got[1][1] == ["p", "q"] and got[1][3] >= 7
