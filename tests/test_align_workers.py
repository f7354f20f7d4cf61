"""Faces on every core and on many machines: shardface.scripts.align and faces.stream.find_faces give the
same output whatever the number of worker processes, a photo's error is named as with one
process, a killed worker ends the tool with one line naming its photo and keeps the earlier
output, and two ranks joined give what one process writes (faces/workers.py, dataset/shares.py).
Photos are small copies of scikit-image's astronaut (a real, detectable face)."""

import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from shardface.dataset.errors import DataError, ImageDecodeError
from shardface.dataset.shares import PartError, Parts, launch_rank, list_key, share_of
from shardface.faces.detect import Detection
from shardface.faces.stream import find_faces
from shardface.faces.workers import WorkerDied, default_workers, map_photos
from shardface.scripts.align import main as align_tool
from tests.astronaut import align_photos
from tests.distributed import run_distributed

DOOMED = os.path.join("q", "m1.jpg")  # the photo whose worker kills itself in the kill test


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    return align_photos(tmp_path_factory.mktemp("photos"))


def _tree(folder) -> dict[str, bytes]:
    """Every file under `folder`: relative path -> bytes."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def one_process(photos, tmp_path_factory) -> dict[str, bytes]:
    """shardface.scripts.align's output with one worker (in this process)."""
    dst = str(tmp_path_factory.mktemp("one") / "crops")
    assert align_tool([photos, dst, "--workers", "1"]) == 0
    return _tree(dst)


def _summary(out: str, dst: str) -> str:
    return out.replace(dst, "DST")


def test_align_writes_the_same_bytes_and_says_the_same_with_one_and_two_workers(
    photos, one_process, tmp_path, capsys
):
    said = []
    for workers in ("1", "2"):
        dst = str(tmp_path / f"crops{workers}")
        assert align_tool([photos, dst, "--workers", workers]) == 0
        assert _tree(dst) == one_process
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
    assert _tree(dst) == {"earlier.txt": b"kept"} and os.listdir(tmp_path) == ["crops"]


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


def _rank_aligns(rank, world, photos, dst):
    return align_tool([photos, dst, "--workers", "1"])  # torchrun's RANK and WORLD_SIZE say which share


def test_two_ranks_publish_what_one_process_writes(photos, one_process, tmp_path):
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, photos, dst, init=False) == [0, 0]
    assert _tree(dst) == one_process
    assert os.listdir(tmp_path) == ["crops"]  # the parts are removed once joined


def test_ranks_run_one_after_another_by_hand_join_to_one_process_output(
    photos, one_process, tmp_path, capsys
):
    """--rank/--world on one machine in turn: the later rank 0 finds rank 1's part and joins it;
    a rank whose part is complete keeps it (a job run again redoes only what is missing)."""
    dst = str(tmp_path / "crops")
    assert align_tool([photos, dst, "--rank", "1", "--world", "2", "--workers", "1"]) == 0
    [part] = os.listdir(tmp_path)
    made = os.path.getmtime(os.path.join(tmp_path, part, "rank-1-of-2", "part.json"))
    assert align_tool([photos, dst, "--rank", "1", "--world", "2", "--workers", "1"]) == 0
    assert os.path.getmtime(os.path.join(tmp_path, part, "rank-1-of-2", "part.json")) == made
    assert "rank 1 of 2: its share" in capsys.readouterr().out
    assert align_tool([photos, dst, "--rank", "0", "--world", "2", "--workers", "1"]) == 0
    assert _tree(dst) == one_process and os.listdir(tmp_path) == ["crops"]


def _write_part(parts: Parts, rank: int, items: list[str], rows: list[str] | None = None) -> None:
    r = share_of(len(items), rank, parts.world)
    with parts.writing(rank, items) as part:
        with open(os.path.join(part.folder, "report.csv"), "w") as f:
            f.write("photo,crop\n" + "".join(f"{p},{p}.png\n" for p in (rows or items[r.start : r.end])))
        for p in items[r.start : r.end]:
            open(os.path.join(part.folder, f"{p}.png"), "w").write(p)


def test_the_join_is_checked_and_a_missing_part_is_named_after_the_wait(tmp_path):
    items = [f"f{i}" for i in range(7)]
    parts = Parts(str(tmp_path / "out"), list_key(items), 3)
    _write_part(parts, 0, items)
    _write_part(parts, 2, items)
    os.makedirs(Parts(str(tmp_path / "out"), list_key(items[1:]), 3).folder(1))  # another list's rank 1
    with pytest.raises(
        PartError,
        match=r"no complete part of rank 1 of 3 after 0 s; .* \(\S+out\.parts-\w+ came "
        r"from another photo list or other options\)",
    ):
        parts.wait(items, 0.1, poll_s=0.02)
    _write_part(parts, 1, items, rows=["f3", "f2", "f4"])  # its share is f3, f4: a report of another list
    os.makedirs(tmp_path / "joined")
    with pytest.raises(
        PartError, match=r"rank-1-of-3/report.csv: its rows list 3 photos, not the 2 of its share"
    ):
        parts.join(str(tmp_path / "joined"), items, "report.csv")
    parts.remove()
    for rank in range(3):
        _write_part(parts, rank, items)
    os.remove(os.path.join(parts.folder(2), "f6.png"))
    os.makedirs(tmp_path / "joined2")
    with pytest.raises(PartError, match=r"rank-2-of-3: holds 2 files, its manifest 3"):
        parts.join(str(tmp_path / "joined2"), items, "report.csv")
    other = Parts(str(tmp_path / "out"), list_key(items), 3)
    with pytest.raises(PartError, match="does not match rank 0's share"):
        other.manifest(0, items[:-1])  # a list with a photo less: another count and hash


def test_shares_are_contiguous_cover_the_list_and_differ_by_one_at_most():
    for count in (0, 1, 5, 13):
        for world in (1, 2, 3, 5):
            shares = [share_of(count, r, world) for r in range(world)]
            assert [i for s in shares for i in range(s.start, s.end)] == list(range(count))
            assert max(s.size for s in shares) - min(s.size for s in shares) <= 1


def test_rank_and_worker_options_are_checked_in_one_line(photos, tmp_path, capsys):
    for argv, message in (
        (["--workers", "0"], "--workers 0: at least 1"),
        (["--rank", "2", "--world", "2"], "--rank 2 --world 2: the world is at least 1"),
        (["--rank", "1"], "--rank and --world: give both"),
    ):
        assert align_tool([photos, str(tmp_path / "out"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {message}")
    assert os.listdir(tmp_path) == []
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job"}
    assert launch_rank(env=torchrun) == (3, 4) and launch_rank(env={}) == (0, 1)


def test_default_workers_are_the_cores_shared_among_the_ranks_of_this_machine():
    cores = len(os.sched_getaffinity(0))
    assert default_workers({}) == cores
    assert default_workers({"LOCAL_WORLD_SIZE": "2"}) == max(1, cores // 2)
    assert default_workers({"LOCAL_WORLD_SIZE": str(cores * 4)}) == 1


def test_list_key_depends_on_the_list_its_order_and_the_options():
    photos = ["a/1.jpg", "a/2.jpg"]
    key = list_key(photos, Detection(), 112)
    assert key == list_key(list(photos), Detection(), 112)
    assert (
        len(
            {
                key,
                list_key(photos[::-1], Detection(), 112),
                list_key(photos, Detection(upsample=2), 112),
                list_key(photos, Detection(), 128),
            }
        )
        == 4
    )


def _rank_packs(rank, world, photos, out):
    from shardface.scripts.pack_rec import main as pack_rec

    return pack_rec(
        [photos, out, "--align", "--workers", "1"]
    )  # torchrun's RANK and WORLD_SIZE say which share


def test_two_ranks_of_pack_rec_align_write_the_recordio_of_one_process(photos, tmp_path):
    """Each rank finds its share's faces into a part; rank 0 packs them all: the same bytes as one
    process with two workers, and the parts are gone."""
    from shardface.scripts.pack_rec import main as pack_rec

    assert pack_rec([photos, str(tmp_path / "one"), "--align", "--workers", "2"]) == 0
    assert run_distributed(_rank_packs, 2, photos, str(tmp_path / "two"), init=False) == [0, 0]
    assert _tree(tmp_path / "two") == _tree(tmp_path / "one")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]


def test_pack_rec_shares_only_face_finding_among_machines(photos, tmp_path, capsys):
    from shardface.scripts.pack_rec import main as pack_rec

    assert pack_rec([photos, str(tmp_path / "out"), "--rank", "0", "--world", "2", "--resize"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "only --align's face finding is shared" in err
    assert not os.path.exists(tmp_path / "out")


def test_rank_variables_left_in_a_shell_are_named_and_align_runs_as_one_process(
    photos, one_process, tmp_path, monkeypatch, capsys
):
    """RANK and WORLD_SIZE without torchrun (no TORCHELASTIC_RUN_ID) once made align take half
    the photos and wait 600 s in silence for a rank that never comes."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    dst = str(tmp_path / "crops")
    assert align_tool([photos, dst, "--workers", "1"]) == 0
    assert _tree(dst) == one_process
    assert (
        "RANK=0 and WORLD_SIZE=2 are set, but torchrun did not start this process" in capsys.readouterr().err
    )


def test_a_photo_replaced_under_its_name_is_aligned_again_not_taken_from_a_finished_part(photos, tmp_path):
    import shutil

    src = tmp_path / "photos"
    shutil.copytree(photos, src)
    dst = str(tmp_path / "crops")
    assert align_tool([str(src), dst, "--rank", "1", "--world", "2", "--workers", "1"]) == 0
    one = os.path.join("q", "a.png")  # in rank 1's share of the sorted photos
    Image.open(src / "p" / "h2.png").save(src / one)  # another photo under the same name
    os.utime(src / one, ns=(1, 1))
    assert align_tool([str(src), dst, "--rank", "1", "--world", "2", "--workers", "1"]) == 0
    assert align_tool([str(src), dst, "--rank", "0", "--world", "2", "--workers", "1"]) == 0
    fresh = str(tmp_path / "fresh")
    assert align_tool([str(src), fresh, "--workers", "1"]) == 0
    assert _tree(dst) == _tree(fresh)


def test_a_part_of_another_world_size_is_named_when_the_wait_ends(tmp_path):
    items = [f"f{i}" for i in range(7)]
    _write_part(Parts(str(tmp_path / "out"), list_key(items), 3), 1, items)
    two = Parts(str(tmp_path / "out"), list_key(items), 2)
    _write_part(two, 0, items)
    with pytest.raises(
        PartError,
        match=r"no complete part of rank 1 of 2 after 0 s; .*rank-1-of-3 in \S+ came "
        r"from another world size",
    ):
        two.wait(items, 0.1, poll_s=0.02)


def test_rank_0_says_what_it_waits_for_and_how_long(tmp_path, capsys):
    items = [f"f{i}" for i in range(4)]
    parts = Parts(str(tmp_path / "out"), list_key(items), 2)
    _write_part(parts, 0, items)
    with pytest.raises(PartError):
        parts.wait(items, 0.2, poll_s=0.05)
    assert f"waiting up to 0 s for the part of rank 1 of 2 in {parts.root}" in capsys.readouterr().err
