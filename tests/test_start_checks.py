"""Refused at start, in one line, with nothing written: what can be known before the first step
(the batch against the data, the wandb login) is checked before the output is touched."""

import os
import sys

import numpy as np
import pytest
from PIL import Image

from shardface import train
from shardface.parallel.user_errors import EXIT_USER_ERROR

DEMO = ["configs/demo.py", "--num_workers", "0", "--val_targets", "[]", "--warmup_epoch", "0"]


def _error_lines(text):
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _cli(monkeypatch, capsys, args):
    """train.py as typed: (exit code, the `error:` lines, all console text)."""
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    captured = capsys.readouterr()
    return exit_.value.code, _error_lines(captured.out + captured.err), captured.out + captured.err


def _small_folder(root, ids=5, per_id=4):
    rng = np.random.default_rng(0)
    for i in range(ids):
        os.makedirs(os.path.join(root, f"id{i}"))
        for j in range(per_id):
            Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(
                os.path.join(root, f"id{i}", f"{j}.png")
            )
    return str(root)


def test_batch_larger_than_a_small_folder_is_one_line_naming_batch_size_and_both_numbers(
    tmp_path, monkeypatch, capsys
):
    """The "your own images" path with the demo config's batch of 64 on 20 images."""
    data, out = _small_folder(tmp_path / "faces"), str(tmp_path / "run")
    code, lines, text = _cli(
        monkeypatch, capsys, [*DEMO, "--rec", data, "--num_classes", "5", "--output", out]
    )
    assert code == EXIT_USER_ERROR and "Traceback" not in text
    assert (
        len(lines) == 1 and "batch_size 64" in lines[0] and "20 samples" in lines[0] and data in lines[0]
    ), lines
    assert "--batch_size 20" in lines[0]
    assert not os.path.exists(out)


def test_gradient_acc_over_the_batches_of_an_epoch_is_one_line_not_a_run_of_0_steps(
    tmp_path, monkeypatch, capsys
):
    """20 images, batch 4: 5 batches per epoch; gradient_acc 6 would leave no optimizer step."""
    data, out = _small_folder(tmp_path / "faces"), str(tmp_path / "run")
    args = [*DEMO, "--rec", data, "--num_classes", "5", "--output", out, "--batch_size", "4"]
    code, lines, text = _cli(monkeypatch, capsys, [*args, "--gradient_acc", "6"])
    assert code == EXIT_USER_ERROR and "Traceback" not in text
    assert (
        len(lines) == 1 and "gradient_acc 6" in lines[0] and "5 batches" in lines[0] and data in lines[0]
    ), lines
    assert "--gradient_acc 5 or less" in lines[0]
    assert not os.path.exists(out)


def _train_cli(rank, world_size, args_per_rank):
    """train.py's entry point on this rank, with this rank's own arguments: its exit code."""
    from shardface.parallel.user_errors import exits_on_user_error

    return exits_on_user_error(train.main)(args_per_rank[rank])


@pytest.mark.slow  # two spawned ranks importing train.py: ~15 s on 2 cores
def test_ranks_started_with_another_lr_refuse_on_every_rank_naming_key_values_and_ranks(
    drawn_faces, tmp_path, capfd, monkeypatch
):
    from tests.distributed import run_distributed
    from tests.train_runs import train_argv

    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    out = str(tmp_path / "run")
    args = [train_argv(drawn_faces, out), train_argv(drawn_faces, out, "--lr", "0.2", "--num_workers", "1")]
    assert run_distributed(_train_cli, 2, args, init=False, timeout=120) == [EXIT_USER_ERROR] * 2
    lines = _error_lines(capfd.readouterr().err)
    # num_workers may differ
    assert lines == [
        "error: the config differs between the ranks of this job: lr 0.05 on rank 0, 0.2 on rank 1; "
        "start every rank with the same config file and --key values"
    ]
    assert not os.path.exists(out)  # nothing trained, nothing written


def test_differences_between_ranks_name_each_key_its_values_and_rank_ranges():
    from shardface.parallel.agreement import describe_differences

    same = {"lr": "0.1", "seed": "1", "wandb_key": "'k'"}
    ranks = [dict(same) for _ in range(8)]
    ranks[3]["seed"] = "2"
    ranks[7]["seed"] = "2"
    for r in (5, 6):
        ranks[r]["wandb_key"] = "'other'"
    assert describe_differences(ranks, secret=["wandb_key"]) == (
        "seed 1 on ranks 0-2, 4-6, 2 on ranks 3, 7; wandb_key <hidden> on ranks 0-4, 7, <hidden> on ranks 5-6"
    )
    assert describe_differences([same, dict(same)]) is None


def _train_cli_patient_1s(rank, world_size, args_per_rank):
    import shardface.checkpoint.run_lock

    shardface.checkpoint.run_lock.SHARED_WAIT_S = (
        1.0  # a local disk shows the lock at once: no network file system to wait for
    )
    return _train_cli(rank, world_size, args_per_rank)


@pytest.mark.slow  # two spawned ranks importing train.py: ~15 s on 2 cores
def test_ranks_writing_different_output_directories_refuse_at_start_naming_ranks_and_hosts(
    drawn_faces, tmp_path, capfd, monkeypatch
):
    """Two nodes without a shared file system, as two directories on one machine: rank 1 does
    not find rank 0's lock in its own output, so both refuse before anything is written."""
    import socket

    from tests.distributed import run_distributed
    from tests.train_runs import train_argv

    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    out0, out1 = str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")
    args = [train_argv(drawn_faces, out0), train_argv(drawn_faces, out1)]
    assert run_distributed(_train_cli_patient_1s, 2, args, init=False, timeout=120) == [EXIT_USER_ERROR] * 2
    lines = _error_lines(capfd.readouterr().err)
    host = socket.gethostname()
    assert len(lines) == 1, lines
    assert f"rank 0 (host {host}) holds its lock {out0}/run.lock" in lines[0], lines[0]
    assert f"rank 1 (host {host}) in {out1} did not find it" in lines[0], lines[0]
    # the lock and the directory it made are gone
    assert not os.path.exists(out0) and not os.path.exists(out1)


def _snapshot(folder):
    """Every file under `folder`: (size, mtime, bytes)."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = (
                os.path.getsize(path),
                os.stat(path).st_mtime_ns,
                open(path, "rb").read(),
            )
    return found


def test_a_refused_resume_or_start_writes_nothing_in_the_output(drawn_faces, tmp_path, monkeypatch, capsys):
    from tests.train_runs import train_argv

    out = str(tmp_path / "run")
    assert train.main(train_argv(drawn_faces, out, "--stop_after_steps", "2", "--ema", "false")) == 0
    before = _snapshot(out)
    assert {"config.json", "training.log", "latest"} <= set(before)
    # a fresh start in an output holding checkpoints
    refused = [
        ("--resume", "true", "--lr", "0.01", "--val_targets", "['nowhere']", "--verbose", "1"),  # val set
        ("--resume", "true", "--lr", "0.01", "--optimizer", "adamw"),  # the checkpoint's optimizer state
        ("--lr", "0.01"),
    ]
    for extra in refused:
        code, lines, _ = _cli(monkeypatch, capsys, train_argv(drawn_faces, out, "--ema", "false", *extra))
        assert code == EXIT_USER_ERROR and len(lines) == 1, (extra, lines)
        assert _snapshot(out) == before, extra  # config.json, training.log, tensorboard/ untouched
    fresh = str(tmp_path / "fresh")
    code, lines, _ = _cli(monkeypatch, capsys, train_argv(drawn_faces, fresh, "--resume", "true"))
    assert code == EXIT_USER_ERROR and "holds no checkpoint" in lines[0]
    assert not os.path.exists(fresh)  # not even the directory, nor an empty training.log in it


@pytest.mark.slow  # a fresh train.py process importing wandb: ~12 s
def test_wandb_without_an_api_key_is_one_line_at_start_and_writes_nothing(drawn_faces, tmp_path):
    """No key in the environment, no ~/.netrc, online mode: refused before the output exists."""
    import subprocess

    from tests.train_runs import train_argv

    pytest.importorskip("wandb")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    home, out = tmp_path / "home", str(tmp_path / "run")
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SHARDFACE_DEBUG", "WANDB_API_KEY", "WANDB_CONFIG_DIR")
    }
    env.update(HOME=str(home), WANDB_MODE="online", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "train.py", *train_argv(drawn_faces, out, "--using_wandb", "true")],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == EXIT_USER_ERROR and "Traceback" not in proc.stderr, proc.stderr
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and "using_wandb = True but wandb has no API key" in lines[0], proc.stderr
    assert "WANDB_API_KEY" in lines[0] and "WANDB_MODE=offline" in lines[0]
    assert not os.path.exists(out) and os.listdir(home) == []
