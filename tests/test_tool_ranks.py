"""Tools on many machines (dataset/shares.py): torchrun's ranks share the photo list, each writes
its part, rank 0 joins the parts into the bytes one process writes and removes them only once its
output is published. The ranks agree on the job through the process group before any work: copies
of the photos with other modification times join, other photos end the job at once, naming the
difference. A rank that fails ends every rank, naming it. Photos are small copies of
scikit-image's astronaut (a real, detectable face)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from shardface.dataset.shares import Part, PartError, Parts, Ranks, list_key, share_of, tool_ranks
from shardface.errors import DataError, OutputError
from shardface.faces.detect import Detection
from shardface.scripts.align import main as align_tool
from shardface.scripts.embed import main as embed_tool
from shardface.scripts.make_bin import main as make_bin_tool
from tests.astronaut import align_photos, file_tree
from tests.distributed import run_distributed
from tests.tool_files import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> str:
    return align_photos(tmp_path_factory.mktemp("photos"))


@pytest.fixture(scope="module")
def one_process(photos, tmp_path_factory) -> dict[str, bytes]:
    dst = str(tmp_path_factory.mktemp("one") / "crops")
    assert align_tool([photos, dst, "--workers", "1"]) == 0
    return file_tree(dst)


def _rank_aligns(rank, world, photos, dst, fault=None):
    """One rank of `align` (torchrun's variables, set by run_distributed, say which share), `photos` a
    folder, or one per rank; `fault` on rank 0 makes its publishing fail, on rank 1 its work."""
    import shardface.scripts.align as tool

    src = photos[rank] if isinstance(photos, (list, tuple)) else photos
    calls = []
    real = tool.align_into
    tool.align_into = lambda *a, **k: calls.append(rank) or real(*a, **k)
    if fault == "publish" and rank == 0:

        def refused(path):
            raise OutputError(f"{path}: no space left (a test's fault)")

        tool.publishing_dir = refused
    if fault == "work" and rank == 1:

        def broken(*a, **k):
            raise DataError("q/a.png: the photo broke (a test's fault)")

        tool.align_into = broken
    return tool.main([src, dst, "--workers", "1"]), calls


def _parts_of(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".parts-" in n)


def test_two_ranks_publish_what_one_process_writes_and_remove_their_parts(photos, one_process, tmp_path):
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, photos, dst, init=False) == [(0, [0]), (0, [1])]
    assert file_tree(dst) == one_process
    assert os.listdir(tmp_path) == ["crops"]


def test_parts_stay_until_the_output_is_published_and_a_run_again_completes_from_them(
    photos, one_process, tmp_path
):
    """Rank 0 cannot publish (its disk full, say): every rank's part stays; run again, no rank
    aligns anything, and rank 0 publishes what one process writes."""
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, photos, dst, "publish", init=False) == [(2, [0]), (0, [1])]
    [parts] = _parts_of(tmp_path)
    assert sorted(os.listdir(tmp_path / parts)) == ["rank-0-of-2", "rank-1-of-2"] and not os.path.exists(dst)
    assert run_distributed(_rank_aligns, 2, photos, dst, init=False) == [(0, []), (0, [])]
    assert file_tree(dst) == one_process and os.listdir(tmp_path) == ["crops"]


def test_a_photo_replaced_under_its_name_is_aligned_again_not_taken_from_a_kept_part(photos, tmp_path):
    src = tmp_path / "photos"
    shutil.copytree(photos, src)
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, str(src), dst, "publish", init=False)[1] == (0, [1])
    one = os.path.join("q", "a.png")  # in rank 1's share of the sorted photos
    Image.open(src / "p" / "h2.png").save(src / one)  # another photo under the same name
    os.utime(src / one, ns=(1, 1))
    again = run_distributed(_rank_aligns, 2, str(src), dst, init=False)
    assert again[1] == (0, [1]) and again[0][0] == 0  # rank 1 aligned its share again
    fresh = str(tmp_path / "fresh")
    assert align_tool([str(src), fresh, "--workers", "1"]) == 0
    assert file_tree(dst) == file_tree(fresh)


@pytest.mark.slow  # the photo replaced under its name, above, holds the same check of a kept part
def test_a_kept_part_whose_photos_were_touched_since_is_made_again_the_others_kept(photos, tmp_path):
    src = tmp_path / "photos"
    shutil.copytree(photos, src)
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, str(src), dst, "publish", init=False)[1] == (0, [1])
    os.utime(src / "q" / "a.png", ns=(1, 1))  # in rank 1's share: its part no longer says what it holds
    assert run_distributed(_rank_aligns, 2, str(src), dst, init=False) == [(0, []), (0, [1])]


def test_ranks_on_their_own_copies_of_the_photos_join_whatever_the_modification_times(
    photos, one_process, tmp_path
):
    """Each node's local copy, or an rsync without --times: the same job."""
    copies = []
    for rank in range(2):
        copy = tmp_path / f"copy{rank}"
        shutil.copytree(photos, copy)
        for dirpath, _, names in os.walk(copy):
            for name in names:
                os.utime(os.path.join(dirpath, name), ns=(10**9 * (rank + 1), 10**9 * (rank + 1)))
        copies.append(str(copy))
    dst = str(tmp_path / "crops")
    assert [code for code, _ in run_distributed(_rank_aligns, 2, copies, dst, init=False)] == [0, 0]
    assert file_tree(dst) == one_process


def test_ranks_whose_photos_differ_end_at_once_naming_the_difference(photos, tmp_path, capfd):
    copies = []
    for rank in range(2):
        shutil.copytree(photos, tmp_path / f"copy{rank}")
        copies.append(str(tmp_path / f"copy{rank}"))
    Image.open(os.path.join(photos, "p", "h2.png")).save(os.path.join(copies[1], "q", "a.png"))
    start = time.monotonic()
    assert run_distributed(_rank_aligns, 2, copies, str(tmp_path / "crops"), init=False) == [(2, []), (2, [])]
    assert time.monotonic() - start < 60
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == [
        "error: rank 1 of 2 has the same 9 photos with other file sizes (another copy of them?): run every "
        "rank with the same photos and options"
    ]
    assert _parts_of(tmp_path) == []


def test_a_rank_whose_work_fails_ends_every_rank_with_its_error_naming_it(photos, tmp_path, capfd):
    dst = str(tmp_path / "crops")
    assert run_distributed(_rank_aligns, 2, photos, dst, "work", init=False) == [(2, [0]), (2, [])]
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert errors == ["error: rank 1 of 2 failed: q/a.png: the photo broke (a test's fault)"]
    assert not os.path.exists(dst)


def _rank_packs(rank, world, photos, out, *argv):
    from shardface.scripts.pack_rec import main as pack_rec

    return pack_rec([photos, out, *argv, "--workers", "1"])


def test_two_ranks_of_pack_rec_align_write_the_recordio_of_one_process(photos, tmp_path):
    """Each rank finds its share's faces into a part; rank 0 packs them all: the same bytes as one
    process with two workers, and the parts are gone once the set is written."""
    from shardface.scripts.pack_rec import main as pack_rec

    assert pack_rec([photos, str(tmp_path / "one"), "--align", "--workers", "2"]) == 0
    assert run_distributed(_rank_packs, 2, photos, str(tmp_path / "two"), "--align", init=False) == [0, 0]
    assert file_tree(tmp_path / "two") == file_tree(tmp_path / "one")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]


def _rank_packs_searching(rank, world, photos, out, break_after=None):
    """One rank of `pack_rec --align`; -> (its exit, the photos its face search was given). With
    `break_after`, rank 1's search fails after that many photos (a kill, say)."""
    import shardface.infer.ranked as ranked
    from shardface.scripts.pack_rec import main as pack_rec

    given, real = [], ranked.stream

    def searching(paths, *a, **k):
        given.extend(paths)
        for i, photo in enumerate(real(paths, *a, **k)):
            if break_after is not None and rank == 1 and i == break_after:
                raise DataError("the search broke (a test's fault)")
            yield photo

    ranked.stream = searching
    return pack_rec([photos, out, "--align", "--workers", "1"]), given


def test_a_rank_stopped_part_way_keeps_the_faces_it_found_and_a_run_again_searches_only_the_rest(
    photos, tmp_path, capfd
):
    from shardface.scripts.pack_rec import main as pack_rec

    assert pack_rec([photos, str(tmp_path / "one"), "--align", "--workers", "1"]) == 0
    out = str(tmp_path / "two")
    first = run_distributed(_rank_packs_searching, 2, photos, out, 2, init=False)
    assert [code for code, _ in first] == [2, 2] and not os.path.exists(out)
    share = first[1][1]
    again = run_distributed(_rank_packs_searching, 2, photos, out, init=False)
    assert again[0] == (0, []) and again[1] == (0, share[2:])  # rank 0's part was complete: kept
    assert f"rank 1 of 2: the faces of 2 of its {len(share)} photos were found by an earlier run" in (
        capfd.readouterr().out
    )
    assert file_tree(out) == file_tree(tmp_path / "one")
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]  # the parts, and their caches, removed


def test_pack_rec_shares_only_face_finding_among_ranks(photos, tmp_path, capfd):
    assert run_distributed(_rank_packs, 2, photos, str(tmp_path / "out"), "--resize", init=False) == [2, 2]
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "only --align's face finding is shared" in errors[0]
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
    assert file_tree(dst) == one_process
    assert (
        "RANK=0 and WORLD_SIZE=2 are set, but torchrun did not start this process" in capsys.readouterr().err
    )
    assert tool_ranks(env={}) == Ranks(0, 1)


def _fill(rows: list[str], files: list[str]):
    def fill(part: Part) -> None:
        with open(os.path.join(part.folder, "report.csv"), "w") as f:
            f.write("photo,crop\n" + "".join(f"{p},{p}.png\n" for p in rows))
        for p in files:
            open(os.path.join(part.folder, f"{p}.png"), "w").write(p)

    return fill


def _make(parts: Parts, rank: int, items: list[str], rows: list[str] | None = None) -> dict:
    r = share_of(len(items), rank, parts.world)
    share = items[r.start : r.end]
    return parts.make(rank, items, _fill(rows or share, share))


def test_the_join_is_checked_and_a_part_of_another_list_is_made_again(tmp_path):
    items = [f"f{i}" for i in range(7)]
    parts = Parts(str(tmp_path / "out"), list_key(items), 3)
    manifests = [
        _make(parts, 0, items),
        _make(parts, 1, items, rows=["f3", "f2", "f4"]),
        _make(parts, 2, items),
    ]
    os.makedirs(tmp_path / "joined")
    with pytest.raises(
        PartError, match=r"rank-1-of-3/report.csv: its rows list 3 photos, not the 2 of its share"
    ):
        parts.join(str(tmp_path / "joined"), manifests, items, "report.csv")
    parts.remove()
    manifests = [_make(parts, rank, items) for rank in range(3)]
    os.remove(os.path.join(parts.folder(2), "f6.png"))
    os.makedirs(tmp_path / "joined2")
    with pytest.raises(PartError, match=r"rank-2-of-3: holds 2 files, its manifest 3"):
        parts.join(str(tmp_path / "joined2"), manifests, items, "report.csv")
    assert parts.manifest(0, items) == manifests[0]  # complete and current: kept
    assert parts.manifest(0, items[:-1]) is None  # a list with a photo less: another share, made again


def test_shares_are_contiguous_cover_the_list_and_differ_by_one_at_most():
    for count in (0, 1, 5, 13):
        for world in (1, 2, 3, 5):
            shares = [share_of(count, r, world) for r in range(world)]
            assert [i for s in shares for i in range(s.start, s.end)] == list(range(count))
            assert max(s.size for s in shares) - min(s.size for s in shares) <= 1


def test_list_key_depends_on_the_list_its_order_the_sizes_and_the_options_not_the_times(tmp_path):
    for name, size in (("1.jpg", 3), ("2.jpg", 5)):
        (tmp_path / name).write_bytes(b"x" * size)
    photos, root = ["1.jpg", "2.jpg"], str(tmp_path)
    key = list_key(photos, Detection(), 112, root=root)
    os.utime(tmp_path / "1.jpg", ns=(1, 1))
    assert key == list_key(list(photos), Detection(), 112, root=root)
    (tmp_path / "2.jpg").write_bytes(b"x" * 6)
    others = {
        list_key(photos[::-1], Detection(), 112, root=root),
        list_key(photos, Detection(upsample=2), 112, root=root),
        list_key(photos, Detection(), 128, root=root),
        list_key(photos, Detection(), 112, root=root),
    }
    assert len(others | {key}) == 5


@pytest.fixture(scope="module")
def many_photos(tmp_path_factory) -> str:
    """Seconds of work for two ranks: 60 turned copies of the astronaut's head."""
    from tests.astronaut import astronaut_head

    root = tmp_path_factory.mktemp("many")
    head = astronaut_head()
    for i in range(60):
        head.rotate(i % 7, fillcolor=(90, 90, 90)).save(root / f"h{i:02d}.png")
    return str(root)


def _torchrun(src: str, dst: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SHARDFACE_DEBUG")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "scripts.align",
            src,
            dst,
            "--workers",
            "1",
        ],
        cwd=ROOT,
        env={**env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_torchrun_two_ranks_of_align_write_what_one_process_writes(many_photos, tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert align_tool([many_photos, one, "--workers", "1"]) == 0
    job = _torchrun(many_photos, two)
    out, _ = job.communicate(timeout=300)
    assert job.returncode == 0, out
    assert file_tree(two) == file_tree(one) and sorted(os.listdir(tmp_path)) == ["one", "two"]


def _rank_pid(job: subprocess.Popen, rank: int) -> int | None:
    """The pid of the torchrun worker of `rank`: a descendant of the job whose environment says RANK."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rpartition(")")[2].split()[1])
        except OSError:
            continue

    def descends(pid: int) -> bool:
        while pid in parents and pid > 1:
            pid = parents[pid]
            if pid == job.pid:
                return True
        return False

    for pid in filter(descends, parents):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"LOCAL_RANK" in env:
            return pid
    return None


def test_a_killed_rank_ends_the_torchrun_job_at_once_and_is_named(many_photos, tmp_path):
    job = _torchrun(many_photos, str(tmp_path / "crops"))
    try:
        deadline = time.monotonic() + 120
        while not (_parts_of(tmp_path) and _rank_pid(job, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = _rank_pid(job, 1)
        assert pid is not None, "rank 1 never started its part"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        out, _ = job.communicate(timeout=120)
        assert time.monotonic() - killed < 60, out
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode != 0
    assert "rank      : 1" in out or "rank: 1" in out, out
    assert not os.path.exists(tmp_path / "crops")


def _rank_embeds(rank, world, model, photos, out):
    return embed_tool([model, photos, "--out", out, "--align", "--workers", "1", "--batch_size", "2"])


def test_two_ranks_of_embed_write_the_rows_and_listing_of_one_process(photos, tmp_path, capsys):
    """Each rank embeds its share of the sorted photos (the wall, without a face, in rank 1's), and
    rank 0 alone writes the pair: one process's listing, its rows to float tolerance (each share's
    batches start at the share)."""
    model = tiny_model(str(tmp_path / "run"))
    one, two = str(tmp_path / "one.npy"), str(tmp_path / "two.npy")
    assert embed_tool([model, photos, "--out", one, "--align", "--workers", "1", "--batch_size", "2"]) == 0
    assert run_distributed(_rank_embeds, 2, model, photos, two, init=False) == [0, 0]
    listing = open(one[: -len(".npy")] + ".txt").read()
    assert open(two[: -len(".npy")] + ".txt").read() == listing and "wall" not in listing
    np.testing.assert_allclose(np.load(two), np.load(one), rtol=0, atol=1e-5)
    assert sorted(os.listdir(tmp_path)) == ["one.npy", "one.txt", "run", "two.npy", "two.txt"]


# the wall has no face (a fallback crop); two.png holds two
PAIRS = (
    "p/h0.png p/h1.png 1\np/two.png q/wall.png 0\nq/m0.jpg q/m1.jpg 1\np/h2.png q/a.jpg 0\n"
    "p/h1.png p/h2.png 1\nq/a.jpg q/m0.jpg 0\np/h0.png p/two.png 1\nq/a.png q/wall.png 0\n"
    "q/a.jpg q/a.png 1\np/h0.png q/m1.jpg 0\n"
)


def _rank_makes_bin(rank, world, argv, searcher):
    """One rank of make_bin; returns (its exit code, the photos it searched for faces)."""
    import importlib

    module = importlib.import_module(searcher)
    searched, real = [], module.stream
    module.stream = lambda photos, *a, **k: real(searched.extend(photos) or photos, *a, **k)
    return make_bin_tool(argv), searched


@pytest.mark.parametrize("listed", [False, True], ids=["drawn", "pair_list"])
def test_two_ranks_of_make_bin_align_share_the_search_and_write_one_processs_bin(photos, tmp_path, listed):
    """A drawn set's ranks find their shares' faces into parts (infer.ranked), removed once the .bin
    is published; a pair list's ranks share the search rank 0's faces cache leaves to do. Either
    way each photo is searched once, by one rank, and rank 0 writes one process's bytes."""
    (tmp_path / "pairs.txt").write_text(PAIRS)
    searcher = "shardface.infer.pair_photos" if listed else "shardface.infer.ranked"
    out = {}
    for ranks in (1, 2):
        cache = tmp_path / f"cache{ranks}"  # each job detects afresh
        cache.mkdir()
        dst = str(tmp_path / f"w{ranks}.bin")
        argv = [photos, dst, "--align", "--workers", "1"]
        argv += ["--pairs_list", str(tmp_path / "pairs.txt"), "--cache_dir", str(cache)] if listed else []
        if ranks == 1:
            assert make_bin_tool(argv) == 0
        else:
            done = run_distributed(_rank_makes_bin, 2, argv, searcher, init=False)
            assert [rc for rc, _ in done] == [0, 0]
            shares = [searched for _, searched in done]
            assert all(shares) and not set(shares[0]) & set(shares[1])
            assert sorted(shares[0] + shares[1]) == sorted(set(shares[0] + shares[1])) and len(shares[1]) == 4
        with open(dst, "rb") as f:
            out[ranks] = f.read()
    assert out[1] == out[2]
    assert not [n for n in os.listdir(tmp_path) if ".parts-" in n]


def _rank_evaluates(rank, world, argv):
    import contextlib
    import io

    from shardface.scripts.identify_eval import main as identify_eval

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        rc = identify_eval(argv)
    return rc, said.getvalue()


def test_two_ranks_of_identify_eval_report_what_one_process_reports(photos, tmp_path):
    """p/ and q/ are two people (q's wall has no face: named, left out); with --json, rank 0 prints
    one process's document and rank 1 nothing."""
    model = tiny_model(str(tmp_path / "run"))
    argv = [model, photos, "--align", "--workers", "1", "--unknown_ids", "0", "--json"]
    one = _rank_evaluates(0, 1, argv)
    assert one[0] == 0 and "q/wall.png" in one[1]
    assert run_distributed(_rank_evaluates, 2, argv, init=False) == [one, (0, "")]
