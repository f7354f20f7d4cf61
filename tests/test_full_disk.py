"""A disk that fills up during a checkpoint: torch.save's own failure is reported as no space,
naming the file and the space a checkpoint needs; the partial save is removed; every rank
stops alike (none waits at a barrier); the earlier checkpoints still load."""

import errno
import os

import pytest

from shardface import train
from shardface.checkpoint import files as checkpoint_files
from shardface.checkpoint.files import NoSpaceError
from shardface.checkpoint.folders import find_checkpoint, list_checkpoints
from shardface.checkpoint.load import read_backbone_weights
from tests.distributed import run_distributed
from tests.train_runs import train_argv


class _FillingFile:
    """A real file whose writes fail with ENOSPC once `room` bytes are in it, as on a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(bytes(data[: self.room]))  # what fitted stays on disk, as the kernel leaves it
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk_at(monkeypatch, *fragments: str, room: int = 1000) -> None:
    """Writes to files whose path contains every one of `fragments` run out of space after
    `room` bytes."""

    def opening(path, mode="r", *args, **kw):
        f = open(path, mode, *args, **kw)
        return _FillingFile(f, room) if all(f in path for f in fragments) and "w" in mode else f

    monkeypatch.setattr(checkpoint_files, "open", opening, raising=False)


def test_full_disk_during_a_checkpoint_names_file_and_space_and_removes_the_partial_save(
    drawn_faces, tmp_path, monkeypatch
):
    out = str(tmp_path / "run")
    fill_disk_at(monkeypatch, "/.checkpoint-00000004.partial/", "/.backbone.pt.partial-")
    with pytest.raises(NoSpaceError) as full:
        train.main(train_argv(drawn_faces, out, "--max_steps", "4", "--checkpoint_interval", "2"))
    message = str(full.value)
    assert "\n" not in message
    assert message.startswith(
        f"{out}: no space for checkpoint-00000004 (backbone.pt did not fit: No space left"
    )
    assert ".partial" not in message  # the staging folder, removed: not named
    assert "a checkpoint needs about" in message and "the partial save was removed" in message
    assert [os.path.basename(p) for _, p in list_checkpoints(out)] == ["checkpoint-00000002"]
    assert not [n for n in os.listdir(out) if ".partial" in n]
    assert find_checkpoint(out).endswith("checkpoint-00000002")
    read_backbone_weights(out)  # the earlier checkpoint loads
    assert not os.path.exists(os.path.join(out, "run.lock"))


def _save_with_rank1_disk_full(rank, world_size, output):
    import pytest as _pytest

    from shardface.checkpoint.save import save_checkpoint
    from shardface.checkpoint.state import TrainState
    from tests.tiny_zero_run import build_parts, train_step

    parts = build_parts(rank, "collective")
    train_step(parts)
    save_checkpoint(output, TrainState(step=1, run_id="r"), **parts, rank=rank, world_size=world_size)
    train_step(parts)
    with _pytest.MonkeyPatch.context() as mp:
        if rank == 1:  # only rank 1's file system share is full: rank 0 must not wait for it
            fill_disk_at(mp, "rng-rank1.pt", room=10)
        try:
            save_checkpoint(output, TrainState(step=2, run_id="r"), **parts, rank=rank, world_size=world_size)
        except NoSpaceError as exc:
            return str(exc)
    return "saved"


@pytest.mark.slow  # two spawned ranks: ~20 s on a loaded machine
def test_full_disk_on_one_rank_stops_every_rank_alike(tmp_path):
    out = str(tmp_path / "run")
    messages = run_distributed(_save_with_rank1_disk_full, 2, out, timeout=120)
    assert messages[0] == messages[1] and "rng-rank1.pt did not fit: No space left on device" in messages[0]
    assert "a checkpoint needs about" in messages[0]
    assert [step for step, _ in list_checkpoints(out)] == [1]
    assert not [n for n in os.listdir(out) if ".partial" in n]
    assert find_checkpoint(out).endswith("checkpoint-00000001")


def _tool_outputs(tmp_path, tool):
    """(the tool's argv, the output it replaces) with an earlier output already there."""
    from tests.tool_files import photos, tiny_model

    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    model = tiny_model(tmp_path / "m")
    return {
        "pack_rec": ([faces, str(tmp_path / "rec"), "--overwrite"], str(tmp_path / "rec")),
        "make_bin": (
            [faces, str(tmp_path / "v.bin"), "--pairs", "10", "--overwrite"],
            str(tmp_path / "v.bin"),
        ),
        "embed": (
            [model, faces, "--out", str(tmp_path / "emb.npy"), "--overwrite"],
            str(tmp_path / "emb.npy"),
        ),
        "export_onnx": ([model, str(tmp_path / "m.onnx"), "--overwrite"], str(tmp_path / "m.onnx")),
    }[tool]


def _main(tool):
    import importlib

    return importlib.import_module(f"shardface.scripts.{tool}").main


def _contents(path):
    if os.path.isdir(path):
        return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}
    return open(path, "rb").read()


@pytest.mark.parametrize("tool", ["pack_rec", "make_bin", "embed", "export_onnx"])
def test_a_full_disk_under_a_tools_output_is_one_line_naming_it_and_the_earlier_output_stays(
    tmp_path, monkeypatch, capsys, tool
):
    import builtins

    argv, output = _tool_outputs(tmp_path, tool)
    assert _main(tool)(argv) == 0
    before = _contents(output)
    real = builtins.open

    def opening(path, mode="r", *args, **kw):
        f = real(path, mode, *args, **kw)
        staged = isinstance(path, (str, os.PathLike)) and ".partial-" in os.fspath(path)
        return _FillingFile(f, 100) if staged and ("w" in mode or "a" in mode) else f

    monkeypatch.setattr(builtins, "open", opening)
    capsys.readouterr()
    assert _main(tool)(argv) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "Traceback" not in err and ".partial-" not in line, err
    assert line.startswith(f"error: {output}") and "no space left on its device" in line, line
    assert "what was there before is unchanged" in line
    assert _contents(output) == before
