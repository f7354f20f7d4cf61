"""Faces on every core and on many machines: shardface.scripts.align and faces.stream.find_faces give the
same output whatever the number of worker processes, a photo's error is named as with one
process, and a killed worker ends the tool with one line naming its photo and keeps the earlier
output (faces/workers.py; many machines: tests/test_tool_ranks.py).
Photos are small copies of scikit-image's astronaut (a real, detectable face)."""

import os
import signal
import time

import numpy as np
import pytest

from shardface.dataset.errors import DataError, ImageDecodeError
from shardface.faces.detect import Detection
from shardface.faces.stream import find_faces
from shardface.faces.workers import WorkerDied, default_workers, map_photos
from shardface.scripts.align import main as align_tool
from tests.astronaut import align_photos, file_tree

DOOMED = os.path.join("q", "m1.jpg")  # the photo whose worker kills itself in the kill test


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    return align_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def one_process(photos, tmp_path_factory) -> dict[str, bytes]:
    """shardface.scripts.align's output with one worker (in this process)."""
    dst = str(tmp_path_factory.mktemp("one") / "crops")
    assert align_tool([photos, dst, "--workers", "1"]) == 0
    return file_tree(dst)


def _summary(out: str, dst: str) -> str:
    return out.replace(dst, "DST")


def test_align_writes_the_same_bytes_and_says_the_same_with_one_and_two_workers(
    photos, one_process, tmp_path, capsys
):
    said = []
    for workers in ("1", "2"):
        dst = str(tmp_path / f"crops{workers}")
        assert align_tool([photos, dst, "--workers", workers]) == 0
        assert file_tree(dst) == one_process
        said.append(_summary(capsys.readouterr().out, dst))
    assert said[0] == said[1] and "of 8 photos with faces" in said[0] and "no face found in 1 of 9" in said[0]
    crops = [f for f in one_process if f.endswith(".png")]
    assert "q/a.jpg.png" in crops and "q/a.png.png" in crops and "p/h0.png" in crops


def test_find_faces_finds_the_same_faces_with_one_and_two_workers(photos):
    paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(photos) for f in fs)
    one, two = find_faces(paths, workers=1), find_faces(paths, workers=2)
    assert list(one.faces) == list(two.faces) == paths
    for path in paths:
        assert len(one.faces[path]) == len(two.faces[path])
        for a, b in zip(one.faces[path], two.faces[path]):
            assert a.box == b.box and a.score == b.score and np.array_equal(a.points, b.points)
    assert one.without_face == [os.path.join(photos, "q", "wall.png")]


def test_an_unreadable_photo_in_a_worker_is_the_error_one_process_raises_for_the_first_one(photos, tmp_path):
    bad = []
    for name in ("b1.jpg", "b2.jpg"):
        (tmp_path / name).write_bytes(b"not a jpeg")
        bad.append(str(tmp_path / name))
    paths = sorted(os.path.join(photos, "p", f) for f in os.listdir(os.path.join(photos, "p")))
    paths = paths[:2] + [bad[0]] + paths[2:] + [bad[1]]
    messages = []
    for workers in (1, 2):
        with pytest.raises(ImageDecodeError) as err:
            find_faces(paths, workers=workers)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and messages[0].startswith(f"{bad[0]}: cannot read image")


def _square_or_fail(i: int) -> int:
    time.sleep(0.002 * (i % 4))  # later items often finish first
    if i == 13:
        raise DataError(f"item {i}: refused")
    return i * i


def test_results_come_in_input_order_from_a_bounded_window_then_the_first_error(tmp_path):
    pulled, got, ticks = [], [], []

    def items():
        for i in range(20):
            pulled.append(i)
            yield i

    with pytest.raises(DataError, match="^item 13: refused$"):
        for r in map_photos(_square_or_fail, items(), workers=2, progress=lambda: ticks.append(1), window=4):
            got.append(r)
            assert len(pulled) <= len(got) + 4  # never more than the window ahead of the caller
    assert got == [i * i for i in range(13)] and len(ticks) == 13


class _DieOnDoomed(Detection):
    """The tools' detection, except that the worker handed DOOMED kills itself: it is the only
    photo whose corner is black (rotated without a fill colour)."""

    def faces(self, img):
        if sum(img.getpixel((0, 0))) < 40:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().faces(img)


def test_a_killed_worker_ends_align_with_one_line_naming_its_photo_and_keeps_the_earlier_output(
    photos, tmp_path, monkeypatch, capsys
):
    import shardface.scripts.align

    dst = tmp_path / "crops"
    os.makedirs(dst)
    (dst / "earlier.txt").write_text("kept")
    monkeypatch.setattr(shardface.scripts.align, "detection_from", lambda args: _DieOnDoomed())
    assert align_tool([photos, str(dst), "--workers", "2", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: {os.path.join(photos, DOOMED)}: the worker process on this photo died (killed by a "
        "signal: the out-of-memory killer sends SIGKILL)"
    )
    assert file_tree(dst) == {"earlier.txt": b"kept"} and os.listdir(tmp_path) == ["crops"]


def _name_or_die(item):
    if item[0] == DOOMED:
        os.kill(os.getpid(), signal.SIGKILL)
    return item[0]


def test_a_worker_killed_by_the_engine_test_function_is_named_with_its_item():
    with pytest.raises(
        WorkerDied, match=r"^q/m1\.jpg: the worker process on this photo died \(killed by a signal"
    ):
        list(
            map_photos(
                _name_or_die, [("p/x", ""), (DOOMED, ""), ("p/y", "")], workers=2, name=lambda item: item[0]
            )
        )


def test_worker_counts_below_one_are_refused_in_one_line(photos, tmp_path, capsys):
    assert align_tool([photos, str(tmp_path / "out"), "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --workers 0: at least 1")
    assert os.listdir(tmp_path) == []


def test_default_workers_are_the_cores_shared_among_the_ranks_of_this_machine():
    cores = len(os.sched_getaffinity(0))
    assert default_workers({}) == cores
    assert default_workers({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert default_workers({"LOCAL_WORLD_SIZE": str(cores * 4)}) == 1
