"""Tool outputs are published atomically (utils/atomic.py): a run that fails or is killed leaves
the earlier output whole, a set of files is never left mixed in a form a reader takes for good,
staging files of killed runs are cleaned, an output that is an input is refused, and outputs
of the wrong kind are refused before the work."""

import os
import signal
import socket

import pytest

from shardface.dataset import build_dataset
from shardface.scripts.embed import main as embed
from shardface.scripts.export_onnx import main as export_onnx
from shardface.scripts.make_bin import main as make_bin
from shardface.scripts.pack_rec import main as pack_rec
from tests.tool_files import dead_pid, photos, tiny_model


def _contents(path) -> dict | bytes:
    """A file's bytes, or a folder's files and their bytes."""
    if os.path.isfile(path):
        return open(path, "rb").read()
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _fail_on_call(n: int, real=os.replace):
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == n:
            raise KeyboardInterrupt(f"stopped at rename {n}")
        return real(src, dst)

    return replace


def test_export_onto_its_own_model_pt_is_refused_and_the_weights_stay(tmp_path, capsys):
    pt = tiny_model(tmp_path)
    before = open(pt, "rb").read()
    assert export_onnx([pt, pt]) == 2
    assert capsys.readouterr().err == f"error: output {pt} is also an input ({pt}); write it elsewhere\n"
    assert open(pt, "rb").read() == before


def test_export_stopped_while_writing_keeps_the_previous_onnx_whole(tmp_path, monkeypatch):
    import torch

    pt = tiny_model(tmp_path)
    onnx_path = str(tmp_path / "model.onnx")
    assert export_onnx([pt, onnx_path]) == 0  # the previous export, which the next one refreshes
    previous = open(onnx_path, "rb").read()

    def killed_midway(model, args, path, **kw):
        with open(path, "wb") as f:
            f.write(b"\x08\x07partial onnx")
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(torch.onnx, "export", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        export_onnx([pt, onnx_path])
    assert open(onnx_path, "rb").read() == previous
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.onnx", "model.pt"]


def _pack_killed_at(src: str, out: str, name: str, n: int) -> None:
    """pack_rec SRC OUT --overwrite in a forked process SIGKILLed at its n-th call of os.<name>
    (no `finally` runs, as in a real kill)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            real, calls = getattr(os, name), []

            def hook(*a, **kw):
                calls.append(a)
                if len(calls) == n:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*a, **kw)

            setattr(os, name, hook)
            pack_rec([src, out, "--overwrite"])
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def test_pack_killed_between_renames_leaves_the_earlier_set_which_the_reader_puts_back(tmp_path):
    out = str(tmp_path / "rec")
    assert pack_rec([photos(tmp_path / "old", ids=2, per_id=2), out]) == 0
    before = _contents(out)
    new = photos(tmp_path / "new", ids=3, per_id=4, first_seed=50)
    _pack_killed_at(new, out, "replace", 2)  # one file of the new set is in place, the others not
    assert not os.path.exists(os.path.join(out, "train.idx"))  # no set reads as good while mixed
    assert len(build_dataset(out, 2)) == 4  # the reader puts the journaled earlier set back
    assert {k: v for k, v in _contents(out).items() if ".partial-" not in k} == before  # no journal left
    assert pack_rec([new, out, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["property", "train.idx", "train.rec"]
    assert len(build_dataset(out, 3)) == 12


@pytest.mark.parametrize(
    "name,n",
    [
        ("link", 1),
        ("link", 3),
        ("remove", 1),
        ("replace", 1),
        ("replace", 2),
        ("replace", 3),
        ("remove", 2),
        ("remove", 4),
    ],
)
def test_pack_killed_at_any_step_of_the_swap_leaves_the_earlier_set_or_the_new_one(tmp_path, name, n):
    """SIGKILL at each link, remove and rename of pack_rec's swap (the journal's hard links, the
    key's removal, the three renames, the journal's removal): the next pack_rec finds the
    earlier set or the new one whole, never neither, and leaves no litter."""
    out = str(tmp_path / "rec")
    assert pack_rec([photos(tmp_path / "old", ids=2, per_id=2), out]) == 0
    old = _contents(out)
    new = photos(tmp_path / "new", ids=3, per_id=4, first_seed=50)
    _pack_killed_at(new, out, name, n)
    from shardface.dataset.pack import recover_rec_set

    recover_rec_set(out)
    visible = {k: v for k, v in _contents(out).items() if not k.startswith(".")}
    assert sorted(visible) == ["property", "train.idx", "train.rec"], sorted(_contents(out))
    assert len(build_dataset(out, 2 if visible == old else 3)) == (4 if visible == old else 12)
    assert not any(".old-" in k for k in os.listdir(out))
    assert pack_rec([new, out, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["property", "train.idx", "train.rec"]


def test_pack_killed_before_the_swap_keeps_the_earlier_set_and_its_litter_is_cleaned(tmp_path):
    out = str(tmp_path / "rec")
    assert pack_rec([photos(tmp_path / "old", ids=2, per_id=2), out]) == 0
    before = _contents(out)
    new = photos(tmp_path / "new", ids=3, per_id=4, first_seed=50)
    _pack_killed_at(new, out, "fsync", 1)  # the new files are written, none is published yet
    assert {n: b for n, b in _contents(out).items() if not n.startswith(".")} == before
    assert len(build_dataset(out, 2)) == 4
    assert any(".partial-" in n for n in os.listdir(out))  # what the killed run left
    assert pack_rec([new, out, "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["property", "train.idx", "train.rec"]


def test_pack_list_file_that_is_also_an_output_is_refused(tmp_path, capsys):
    out = tmp_path / "rec"
    assert pack_rec([photos(tmp_path / "p", ids=2, per_id=2), str(out)]) == 0
    listing = out / "train.idx"
    listing.write_text("../p/id0/0.jpg\t0\n../p/id1/0.jpg\t1\n")
    assert pack_rec([str(listing), str(out), "--overwrite"]) == 2
    assert "is also an input" in capsys.readouterr().err
    assert listing.read_text() == "../p/id0/0.jpg\t0\n../p/id1/0.jpg\t1\n"


def test_embed_replaces_its_pair_only_with_overwrite_and_publishes_the_listing_last(
    tmp_path, monkeypatch, capsys
):
    pt = tiny_model(tmp_path / "m")
    faces = photos(tmp_path / "faces", ids=2, per_id=2)
    out = str(tmp_path / "emb.npy")
    assert embed([pt, faces, "--out", out]) == 0
    pair = _contents(tmp_path / "emb.npy"), _contents(tmp_path / "emb.txt")
    assert embed([pt, os.path.join(faces, "id0"), "--out", out]) == 2
    assert capsys.readouterr().err == f"error: --out {out} exists; pass --overwrite to replace it\n"
    assert (_contents(tmp_path / "emb.npy"), _contents(tmp_path / "emb.txt")) == pair
    monkeypatch.setattr(os, "replace", _fail_on_call(2))  # stopped after emb.npy, before emb.txt
    with pytest.raises(KeyboardInterrupt):
        embed([pt, os.path.join(faces, "id0"), "--out", out, "--overwrite"])
    monkeypatch.undo()
    # the swap put the earlier pair back from its journal before the interrupt went on
    assert (_contents(tmp_path / "emb.npy"), _contents(tmp_path / "emb.txt")) == pair
    assert [n for n in os.listdir(tmp_path) if ".partial-" in n or ".old-" in n] == []


def test_outputs_of_the_wrong_kind_are_refused_before_the_work(tmp_path, capsys):
    pt = tiny_model(tmp_path / "m")
    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    (tmp_path / "e.npy").mkdir()
    assert embed([pt, faces, "--out", str(tmp_path / "e.npy")]) == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'e.npy'} is a directory; name a file\n"
    (tmp_path / "v.bin").mkdir()
    assert make_bin([faces, str(tmp_path / "v.bin"), "--overwrite", "--pairs", "10"]) == 2
    assert capsys.readouterr().err == f"error: output {tmp_path / 'v.bin'} is a directory; name a file\n"
    assert os.listdir(tmp_path / "v.bin") == [] and os.listdir(tmp_path / "e.npy") == []
    from shardface.scripts.import_arcface_torch import main as import_arcface_torch

    (tmp_path / "run").mkdir()
    (tmp_path / "out").write_text("a file")
    assert import_arcface_torch(["configs/demo.py", str(tmp_path / "run"), str(tmp_path / "out")]) == 2
    assert (
        capsys.readouterr().err.splitlines()[-1]
        == f"error: output {tmp_path / 'out'} is a file, not a directory; name a directory"
    )


def test_staging_files_of_dead_runs_on_this_host_are_removed_and_others_kept(tmp_path):
    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    pid, host = dead_pid(), socket.gethostname()
    dead = [f".v.bin.partial-{host}-{pid}", f"v.bin.partial-{pid}"]  # the second: the old naming
    # another output's: its own publish cleans it
    kept = [
        f".v.bin.partial-{host}-{os.getppid()}",  # a live process
        f".v.bin.partial-another-host-{pid}",  # its pid means nothing here
        f".w.bin.partial-{host}-{pid}",
    ]
    for name in dead + kept:
        (tmp_path / name).write_bytes(b"litter")
    assert make_bin([faces, str(tmp_path / "v.bin"), "--pairs", "10"]) == 0
    assert sorted(n for n in os.listdir(tmp_path) if "partial" in n) == sorted(kept)


def test_publishing_a_file_that_fails_leaves_the_earlier_file_and_no_staging_file(tmp_path):
    from shardface.utils import atomic

    path = tmp_path / "out.txt"
    path.write_text("earlier")
    with pytest.raises(RuntimeError):
        with atomic.publishing(str(path)) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("the work failed")
    assert os.listdir(tmp_path) == ["out.txt"] and path.read_text() == "earlier"


def test_an_output_name_too_long_to_stage_is_refused_before_the_work_naming_it(tmp_path, capsys):
    """The staging name adds `.` and `.partial-HOST-PID` to the name: a name that fits alone can
    pass the file system's 255 bytes once staged, which failed only at the publish, after the work."""
    from shardface.errors import OutputError
    from shardface.utils.atomic import staging_path
    from shardface.utils.outputs import check_output_dir, check_output_file

    extra = len(os.path.basename(staging_path(str(tmp_path / "x")))) - 1
    long_name = "v" * (255 - extra + 1 - len(".bin")) + ".bin"  # fits alone; its staging name does not
    assert len(long_name) <= 255
    with pytest.raises(
        OutputError,
        match=rf"{long_name}: a name of {len(long_name)} bytes .* limit of 255: "
        rf"choose a name of at most {255 - extra} bytes",
    ):
        check_output_file(str(tmp_path / long_name))
    check_output_file(str(tmp_path / long_name[len(long_name) - (255 - extra) :]))  # at the limit: fine
    with pytest.raises(OutputError, match="limit of 255"):
        check_output_dir(str(tmp_path / long_name))
    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    capsys.readouterr()
    assert make_bin([faces, str(tmp_path / long_name), "--pairs", "10"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "limit of 255" in err
    assert sorted(os.listdir(tmp_path)) == ["faces"]


def test_an_output_folder_that_takes_no_file_is_refused_even_for_root(tmp_path, monkeypatch):
    """os.access says yes to root everywhere; the check creates the staging file instead."""
    from shardface.errors import OutputError
    from shardface.utils import outputs

    folder = tmp_path / "ro"
    folder.mkdir()
    real_open = os.open

    def refusing(path, flags, *a):
        if os.path.dirname(path) == str(folder):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(outputs.os, "access", lambda *a, **k: True)  # as root
    monkeypatch.setattr(outputs.os, "open", refusing)
    with pytest.raises(OutputError, match=r"out.bin: cannot create a file in .*ro \(Permission denied\)"):
        outputs.check_output_file(str(folder / "out.bin"))
    monkeypatch.undo()
    outputs.check_output_file(str(folder / "out.bin"))
    assert os.listdir(folder) == []  # the probe leaves nothing


def test_pair_cache_of_a_list_read_from_a_pipe_is_refused_before_the_work(tmp_path):
    """verify --pairs_list <(...): the list is /dev/fd/N, whose folder takes no file, not even
    root's; the cache check says so, and how to keep a cache elsewhere."""
    from shardface.errors import OutputError
    from shardface.infer.pair_photos import cache_paths, check_cache

    r, w = os.pipe()
    try:
        faces_cache, emb_cache = cache_paths(f"/dev/fd/{r}", "abc")
        for path in (faces_cache, emb_cache):
            with pytest.raises(
                OutputError, match=rf"cache file /dev/fd/{r}\.shardface_.*pass --cache_dir DIR"
            ):
                check_cache(path)
        for path in cache_paths(f"/dev/fd/{r}", "abc", str(tmp_path)):
            check_cache(path)  # elsewhere, fine
    finally:
        os.close(r), os.close(w)


def test_folder_output_through_a_symlink_replaces_the_linked_folder_and_keeps_the_link(tmp_path):
    """align --overwrite DST where DST links to a folder: the folder it names gets the new crops
    (none of the old left), the link stays a link, and no staging or backup folder is left."""
    from shardface.utils import atomic, outputs

    target = tmp_path / "disk" / "crops"
    target.mkdir(parents=True)
    (target / "old.png").write_bytes(b"old crop")
    link = tmp_path / "crops"
    link.symlink_to(target)
    outputs.check_output_dir(str(link))
    with atomic.publishing_dir(str(link)) as tmp:
        open(os.path.join(tmp, "new.png"), "wb").write(b"new crop")
    assert link.is_symlink() and os.path.realpath(link) == str(target)
    assert os.listdir(target) == ["new.png"] and (link / "new.png").read_bytes() == b"new crop"
    assert sorted(os.listdir(tmp_path)) == ["crops", "disk"] and os.listdir(tmp_path / "disk") == ["crops"]
