"""Checkpoints a real user's mistakes cannot lose: a second run into the same output, elastic
restarts (`resume auto`), broken `latest`, missing or truncated files, another optimizer."""

import logging
import os
import re
import shutil

import pytest
import torch

from shardface import train
from shardface.checkpoint.files import CheckpointError, safe_load
from shardface.checkpoint.folders import (
    find_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    resolve_checkpoint,
)
from shardface.checkpoint.load import read_backbone_weights
from shardface.dataset.pack import write_insightface_rec
from tests.train_runs import train_argv


def _fake_checkpoint(output, step, run_id):
    path = os.path.join(output, f"checkpoint-{step:08d}")
    os.makedirs(path)
    torch.save(
        {"step": step, "run_id": run_id, "num_classes": 4, "world_size": 2}, os.path.join(path, "meta.pt")
    )
    for name in (
        "backbone.pt",
        "optimizer.pt",
        "head-0000000000-0000000002.pt",
        "head-0000000002-0000000004.pt",
        "rng-rank0.pt",
        "rng-rank1.pt",
    ):
        torch.save({}, os.path.join(path, name))
    return path


def _steps(output):
    return [step for step, _ in list_checkpoints(output)]


def test_pruning_removes_only_this_runs_older_checkpoints(tmp_path):
    out = str(tmp_path)
    for step, run in [(2, "other"), (4, "me"), (8, "me"), (12, "me"), (16, "me"), (20, "other")]:
        _fake_checkpoint(out, step, run)
    assert prune_checkpoints(out, 12, "me", keep=2) == [os.path.join(out, "checkpoint-00000004")]
    assert _steps(out) == [2, 8, 12, 16, 20]  # other runs and newer checkpoints stay
    assert prune_checkpoints(out, 12, "me", keep=0) == []  # 0 keeps every one
    prune_checkpoints(out, 12, "me", keep=1)
    assert _steps(out) == [2, 12, 16, 20]


def test_dangling_or_garbage_latest_falls_back_to_newest_intact_checkpoint(tmp_path, caplog):
    out = str(tmp_path)
    _fake_checkpoint(out, 4, "r")
    newest = _fake_checkpoint(out, 8, "r")
    broken = _fake_checkpoint(out, 12, "r")
    os.remove(os.path.join(broken, "meta.pt"))
    for content in (b"checkpoint-00000099\n", b"\x00\xff garbage", b"checkpoint-00000012\n"):
        with open(os.path.join(out, "latest"), "wb") as f:
            f.write(content)
        with caplog.at_level(logging.WARNING, logger="shardface"):
            caplog.clear()
            assert find_checkpoint(out) == newest
        assert "not an intact checkpoint" in caplog.text


@pytest.mark.parametrize(
    "lost,named",
    [("head-0000000002-0000000004.pt", "head files for classes [2, 4)"), ("rng-rank1.pt", "rng-rank1.pt")],
)
def test_checkpoint_missing_a_head_or_rng_file_is_not_intact(tmp_path, caplog, lost, named):
    """A save interrupted (or raced) after some ranks wrote their files: not a checkpoint to resume."""
    out = str(tmp_path)
    whole = _fake_checkpoint(out, 4, "r")
    partial = _fake_checkpoint(out, 8, "r")
    os.remove(os.path.join(partial, lost))
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("checkpoint-00000008\n")
    with caplog.at_level(logging.WARNING, logger="shardface"):
        assert find_checkpoint(out) == whole
    assert f"(it lacks {named})" in caplog.text
    shutil.rmtree(whole)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint-00000008, lacks {named})")):
        resolve_checkpoint(out)


def _train(data, out, *extra):
    return train.main(train_argv(data, out, "--max_steps", "8", "--ema", "true", *extra))


@pytest.fixture(scope="module")
def eight_steps(drawn_faces, tmp_path_factory):
    """A one-rank run of 8 steps with checkpoints at 4 and 8."""
    out = str(tmp_path_factory.mktemp("first") / "run")
    assert _train(drawn_faces, out) == 0
    return out


def test_saved_weights_are_compact_cpu_tensors(eight_steps):
    # ZeRO-2's parameters are views of one flat buffer (on the GPU, a CUDA one): saved as they
    # are, each tensor would carry the whole buffer, and a CPU-only host could not open the file
    for path in (
        os.path.join(find_checkpoint(eight_steps), "backbone.pt"),
        os.path.join(eight_steps, "model.pt"),
    ):
        for name, t in torch.load(path, weights_only=True).items():
            assert t.device.type == "cpu", (path, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (path, name)


def _copy(src, tmp_path, name="run"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def test_second_run_into_the_same_output_is_refused_and_keeps_the_first(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    with pytest.raises(
        CheckpointError, match="holds checkpoints of an earlier run.*--resume true.*--overwrite"
    ):
        _train(drawn_faces, out, "--max_steps", "4")
    assert _steps(out) == [4, 8] and find_checkpoint(out).endswith("checkpoint-00000008")


def test_overwrite_starts_over_and_its_checkpoints_resume(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    assert _train(drawn_faces, out, "--max_steps", "4", "--overwrite", "true") == 0
    assert _steps(out) == [4] and find_checkpoint(out).endswith("checkpoint-00000004")
    assert _train(drawn_faces, out, "--max_steps", "8", "--resume", "true") == 0
    assert _steps(out) == [4, 8]


def _logged_steps(output, tag="train/loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(output, "tensorboard"))
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


def test_overwrite_starts_tensorboard_and_training_log_over(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    assert (
        _logged_steps(out) == list(range(1, 9))
        and "step 8/8" in open(os.path.join(out, "training.log")).read()
    )
    assert _train(drawn_faces, out, "--max_steps", "3", "--overwrite", "true") == 0
    assert _logged_steps(out) == [1, 2, 3]
    log = open(os.path.join(out, "training.log")).read()
    # one config dump
    assert "step 3/3" in log and "step 8/8" not in log and len(re.findall(r"^network\s", log, re.M)) == 1


def test_resume_drops_the_events_logged_after_its_checkpoint(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    # as if killed after step 8's events, before its save
    shutil.rmtree(os.path.join(out, "checkpoint-00000008"))
    os.remove(os.path.join(out, "latest"))
    assert _train(drawn_faces, out, "--max_steps", "8", "--resume", "true") == 0  # from step 4: 5..8 again
    assert _logged_steps(out) == list(range(1, 9))


def test_resume_auto_starts_fresh_then_continues(drawn_faces, tmp_path):
    out = str(tmp_path / "auto")
    assert _train(drawn_faces, out, "--resume", "auto", "--stop_after_steps", "4") == 0
    assert _steps(out) == [4]
    assert _train(drawn_faces, out, "--resume", "auto") == 0
    assert _steps(out) == [4, 8]
    assert "resumed at step 4" in open(os.path.join(out, "training.log")).read()


def test_missing_ema_file_is_an_error_unless_reset_is_asked_for(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    for _, ckpt in list_checkpoints(out):
        os.remove(os.path.join(ckpt, "ema.pt"))
    with pytest.raises(CheckpointError, match=r"checkpoint-00000008, lacks ema\.pt.*--reset_ema true"):
        _train(drawn_faces, out, "--max_steps", "10", "--resume", "true")
    assert _train(drawn_faces, out, "--max_steps", "10", "--resume", "true", "--reset_ema", "true") == 0
    assert find_checkpoint(out).endswith("checkpoint-00000010")


def test_truncated_backbone_file_is_reported_as_corrupt(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    target = os.path.join(find_checkpoint(out), "backbone.pt")
    data = open(target, "rb").read()
    open(target, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"backbone\.pt: corrupt or unreadable"):
        _train(drawn_faces, out, "--max_steps", "10", "--resume", "true")


def test_resume_with_another_optimizer_names_both(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    with pytest.raises(CheckpointError, match="optimizer 'sgd', this run uses 'adamw'.*--optimizer sgd"):
        _train(drawn_faces, out, "--max_steps", "10", "--resume", "true", "--optimizer", "adamw")


def test_full_disk_names_the_path(tmp_path, monkeypatch):
    import errno

    from shardface.checkpoint import files as checkpoint_files

    def no_space(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_files.torch, "save", no_space)
    target = str(tmp_path / "backbone.pt")
    with pytest.raises(
        CheckpointError, match=rf"{target}: cannot write \(No space left on device\); free space"
    ):
        checkpoint_files.atomic_save({}, target)


def test_resume_with_another_global_batch_says_what_it_does_to_the_schedule(
    drawn_faces, eight_steps, tmp_path
):
    out = _copy(eight_steps, tmp_path)
    assert _train(drawn_faces, out, "--max_steps", "10", "--resume", "true", "--batch_size", "4") == 0
    log = open(os.path.join(out, "training.log")).read()
    assert "global batch 8 (checkpoint) -> 4 (this run): 32 steps per epoch now" in log
    assert "lr 0.05 is not rescaled" in log


def test_fp16_on_the_cpu_is_warned_about(drawn_faces, tmp_path):
    out = str(tmp_path / "fp16")
    assert _train(drawn_faces, out, "--max_steps", "1", "--fp16", "true", "--ema", "false") == 0
    assert (
        "fp16 on the CPU is emulated and many times slower" in open(os.path.join(out, "training.log")).read()
    )


def _repacked(drawn_faces, out, per_id):
    """The drawn faces re-packed with `per_id` images per identity (their own 8, then repeats)."""
    from shardface.dataset import MXFaceDataset, unpack

    source = MXFaceDataset(drawn_faces)
    groups = [[unpack(source.reader.read(1 + 8 * c + i % 8))[1] for i in range(per_id)] for c in range(16)]
    write_insightface_rec(out, groups, 16 * per_id, 16)
    return out


@pytest.mark.parametrize(
    "per_id,change", [(10, "128 -> 160 samples"), (3, "128 -> 48 samples")], ids=["grown", "shrunk"]
)
def test_resume_on_a_changed_data_set_restarts_the_epoch_and_says_so(
    drawn_faces, eight_steps, tmp_path, per_id, change
):
    # stopped at step 8, batch 8 of the 16 in epoch 0; the data set is then replaced (the
    # shrunk one has 6 batches per epoch: the saved batch 8 would lie past its end)
    out, data = _copy(eight_steps, tmp_path), _repacked(drawn_faces, str(tmp_path / "data"), per_id)
    before = safe_load(os.path.join(out, "checkpoint-00000008", "backbone.pt"))
    assert _train(data, out, "--max_steps", "9", "--resume", "true") == 0
    log = open(os.path.join(out, "training.log")).read()
    assert (
        f"{data} changed since the checkpoint of step 8 ({change}): its position (epoch 0, batch 8) is one in "
        f"the old data's order, so epoch 0 restarts from its first batch"
    ) in log
    assert "resumed at step 8 (epoch 0, batch 0)" in log
    meta = safe_load(os.path.join(out, "checkpoint-00000009", "meta.pt"))
    assert (meta["epoch"], meta["batch_in_epoch"], meta["data_size"]) == (0, 1, 16 * per_id)
    assert _steps(out) == [4, 8, 9]  # the earlier checkpoints are kept, and still load
    for step in (4, 8):
        read_backbone_weights(os.path.join(out, f"checkpoint-{step:08d}"))
    for name, t in read_backbone_weights(os.path.join(out, "checkpoint-00000008"), ema=False)[0].items():
        assert torch.equal(t, before[name]), name


def test_resume_on_the_same_data_moved_elsewhere_keeps_its_position(drawn_faces, eight_steps, tmp_path):
    out, data = _copy(eight_steps, tmp_path), str(tmp_path / "moved")
    shutil.copytree(drawn_faces, data)
    meta = safe_load(os.path.join(out, "checkpoint-00000008", "meta.pt"))
    assert meta["data_size"] == 128 and len(meta["data_fingerprint"]) == 16
    assert _train(data, out, "--resume", "true") == 0  # 8 of 8 steps done: it only starts and checks
    log = open(os.path.join(out, "training.log")).read()
    assert "resumed at step 8 (epoch 0, batch 8)" in log and "changed since the checkpoint" not in log


@pytest.mark.parametrize("resume", ["false", "auto"])
def test_output_with_only_model_and_config_is_an_earlier_run(drawn_faces, eight_steps, tmp_path, resume):
    out = _copy(eight_steps, tmp_path)
    for _, ckpt in list_checkpoints(out):  # deleted to save space: the weights are what is left
        shutil.rmtree(ckpt)
    os.remove(os.path.join(out, "latest"))
    kept = {name: open(os.path.join(out, name), "rb").read() for name in ("model.pt", "config.json")}
    with pytest.raises(CheckpointError, match=r"holds model\.pt of an earlier run .*--overwrite true"):
        _train(drawn_faces, out, "--resume", resume)
    assert all(open(os.path.join(out, name), "rb").read() == data for name, data in kept.items())


def test_resume_with_a_margin_that_keeps_statistics_is_refused_naming_the_change(
    drawn_faces, eight_steps, tmp_path
):
    out = _copy(eight_steps, tmp_path)
    before = {name: os.path.getmtime(os.path.join(out, name)) for name in ("model.pt", "latest")}
    for margin in ("adaface", "curricularface"):
        with pytest.raises(
            CheckpointError,
            match=rf"trained with margin 'combined', this run uses '{margin}'.*"
            r"--margin combined, or pass --reset_margin true",
        ):
            _train(drawn_faces, out, "--max_steps", "10", "--resume", "true", "--margin", margin)
    assert {name: os.path.getmtime(os.path.join(out, name)) for name in before} == before
    assert find_checkpoint(out).endswith("checkpoint-00000008")


def test_resume_with_stateless_margin_acc_or_ema_off_continues_saying_what_changes(
    drawn_faces, eight_steps, tmp_path
):
    out = _copy(eight_steps, tmp_path)
    assert (
        _train(
            drawn_faces,
            out,
            "--max_steps",
            "9",
            "--resume",
            "true",
            "--margin",
            "arcface",
            "--gradient_acc",
            "2",
            "--ema",
            "false",
        )
        == 0
    )
    log = open(os.path.join(out, "training.log")).read()
    assert "margin 'combined' (checkpoint) -> 'arcface' (this run): the head's weights carry over" in log
    assert "gradient_acc 1 (checkpoint) -> 2 (this run): an optimizer step now takes 2 batches" in log
    assert "ema turned off: the checkpoint's EMA is dropped, ema.pt is no longer written" in log
    assert not os.path.exists(os.path.join(find_checkpoint(out), "ema.pt"))
    assert find_checkpoint(out).endswith("checkpoint-00000009")


def test_fallback_from_a_broken_latest_is_said_once_on_resume(drawn_faces, eight_steps, tmp_path):
    out = _copy(eight_steps, tmp_path)
    os.remove(os.path.join(find_checkpoint(out), "backbone.pt"))
    assert _train(drawn_faces, out, "--max_steps", "9", "--resume", "true") == 0
    log = open(os.path.join(out, "training.log")).read()
    assert log.count("which is not an intact checkpoint (it lacks backbone.pt)") == 1
    assert "resumed at step 4 " in log


@pytest.mark.slow
def test_epochs_hold_whole_steps_when_batches_are_not_a_multiple_of_gradient_acc(drawn_faces, tmp_path):
    """16 batches per epoch (128 images, batch 8), gradient_acc 3: 5 steps per epoch, the 16th
    batch skipped; no step's micro-batches span two epochs, so each checkpoint's position is
    epoch * 5 steps plus whole steps into the epoch."""
    out = str(tmp_path / "acc")
    assert (
        _train(
            drawn_faces,
            out,
            "--gradient_acc",
            "3",
            "--max_steps",
            "8",
            "--checkpoint_interval",
            "2",
            "--num_epoch",
            "2",
            "--ema",
            "false",
        )
        == 0
    )
    for step, path in list_checkpoints(out):
        meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
        assert meta["batch_in_epoch"] % 3 == 0, (step, meta["batch_in_epoch"])
        assert step == meta["epoch"] * 5 + meta["batch_in_epoch"] // 3, (
            step,
            meta["epoch"],
            meta["batch_in_epoch"],
        )
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6, 8]


def test_a_failed_prune_is_logged_not_silent(tmp_path, monkeypatch, caplog):
    out = str(tmp_path)
    for step in (4, 8, 12):
        _fake_checkpoint(out, step, "me")

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "rmdir", refuse)  # the old checkpoint's directory cannot go
    with caplog.at_level(logging.WARNING, logger="shardface"):
        prune_checkpoints(out, 12, "me", keep=2)
    assert "while pruning old checkpoints" in caplog.text and "checkpoint-00000004" in caplog.text
