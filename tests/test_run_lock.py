"""One live run per output: a second start on a live run's output is refused at once, naming
the live run, and changes nothing there; a lock left by a dead run is taken over."""

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from shardface import train
from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.folders import find_checkpoint
from shardface.checkpoint.load import read_backbone_weights
from shardface.checkpoint.run_lock import LOCK_NAME, STALE_S, RunLock
from tests.train_runs import train_argv


def _snapshot(output):
    """Every path under `output` with its size and mtime."""
    found = {}
    for root, dirs, files in os.walk(output):
        for name in dirs + files:
            path = os.path.join(root, name)
            st = os.stat(path)
            found[os.path.relpath(path, output)] = (st.st_size, st.st_mtime_ns)
    return found


def _dead_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _write_lock(output, **holder):
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, LOCK_NAME)
    with open(path, "w") as f:
        json.dump(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "user": "someone",
                "start": "2026-01-01T00:00:00+00:00",
                **holder,
            },
            f,
        )
    return path


def test_start_on_an_output_locked_by_a_live_process_writes_nothing(drawn_faces, tmp_path):
    """The fast form of the test below: the live holder is a sleeping process of this host."""
    out = str(tmp_path / "run")
    holder = subprocess.Popen(["sleep", "60"])
    try:
        _write_lock(out, pid=holder.pid)
        (tmp_path / "run" / "training.log").write_text("the live run's log\n")
        before = _snapshot(out)
        with pytest.raises(
            CheckpointError,
            match=rf"in use by a live run \(host {socket.gethostname()}, "
            rf"pid {holder.pid}, user someone, started 2026-01-01",
        ):
            train.main(train_argv(drawn_faces, out, "--resume", "auto", "--max_steps", "10"))
        assert _snapshot(out) == before
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_second_run_on_a_live_output_is_refused_at_once_naming_the_first(drawn_faces, tmp_path):
    out = str(tmp_path / "run")
    first = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            *train_argv(
                drawn_faces, out, "--max_steps", "100000", "--num_epoch", "1000", "--checkpoint_interval", "2"
            ),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while find_checkpoint(out) is None:
            assert first.poll() is None and time.time() < deadline, "the first run saved no checkpoint"
            time.sleep(0.2)
        holder = json.load(open(os.path.join(out, LOCK_NAME)))
        first.send_signal(signal.SIGSTOP)  # frozen: the output cannot change under the snapshot
        before = _snapshot(out)
        with pytest.raises(CheckpointError) as refused:  # a double submission with another lr
            train.main(train_argv(drawn_faces, out, "--resume", "auto", "--lr", "0.2"))
        message = str(refused.value)
        assert "\n" not in message
        assert f"in use by a live run (host {socket.gethostname()}, pid {first.pid}," in message
        assert f"started {holder['start']}" in message
        assert _snapshot(out) == before  # nothing written, nothing deleted
        first.send_signal(signal.SIGCONT)
        first.send_signal(signal.SIGTERM)  # the first run saves and exits normally
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not os.path.exists(os.path.join(out, LOCK_NAME))  # released at its exit
    weights, config = read_backbone_weights(out)  # its newest checkpoint is intact and loads
    assert config["lr"] == 0.05 and all(
        torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()
    )


def test_a_stopped_run_on_this_host_keeps_its_lock_however_long_it_has_not_refreshed(
    drawn_faces, tmp_path, monkeypatch
):
    """Ctrl-Z or a SLURM suspend (SIGSTOP) past the stale window: its pid is alive here, so a second
    run into its output is refused, not let in to write beside it; once it is gone, it is taken over."""
    import shardface.checkpoint.run_lock as run_lock

    monkeypatch.setattr(run_lock, "STALE_S", 0.5)  # the window, short for the test
    out = str(tmp_path / "run")
    holder = subprocess.Popen(["sleep", "60"])
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        path = _write_lock(out, pid=holder.pid)
        old = time.time() - 3600  # not refreshed for an hour
        os.utime(path, (old, old))
        with pytest.raises(CheckpointError, match=rf"in use by a live run \(host \S+, pid {holder.pid}"):
            train.main(train_argv(drawn_faces, out, "--resume", "auto", "--max_steps", "4"))
        assert json.load(open(path))["pid"] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock()
    lock.acquire(out)  # its holder gone: taken over
    lock.release()


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, caplog):
    out = str(tmp_path / "run")
    dead = _dead_pid()
    path = _write_lock(out, pid=dead)  # a run killed by SIGKILL, or ended by the stop grace's os._exit
    lock = RunLock()
    with caplog.at_level(logging.WARNING, logger="shardface"):
        lock.acquire(out)
    try:
        assert (
            f"taking over the stale lock of host {socket.gethostname()}, pid {dead}, user someone"
            in caplog.text
        )
        assert json.load(open(path))["pid"] == os.getpid()
    finally:
        lock.release()
    assert not os.path.exists(path)


def test_stale_rule_for_another_hosts_lock_is_its_last_refresh(tmp_path):
    out = str(tmp_path / "run")
    path = _write_lock(out, host="elsewhere", pid=1)
    with pytest.raises(CheckpointError, match=r"in use by a live run \(host elsewhere, pid 1, user someone"):
        RunLock().acquire(out)
    old = time.time() - STALE_S - 5  # its holder stopped refreshing it long ago
    os.utime(path, (old, old))
    lock = RunLock()
    lock.acquire(out)
    try:
        assert json.load(open(path))["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match=f"pid {os.getpid()}"):  # held: a second taker is refused
            RunLock().acquire(out)
    finally:
        lock.release()
    assert not os.path.exists(path)


def test_output_that_cannot_be_written_is_refused_before_any_step(drawn_faces, tmp_path):
    in_place = tmp_path / "a_file"
    in_place.write_text("not a directory")
    with pytest.raises(CheckpointError, match=f"{in_place}: cannot create the output directory"):
        train.main(train_argv(drawn_faces, str(in_place)))
    assert in_place.read_text() == "not a directory"


def test_read_only_output_is_refused_before_any_step(drawn_faces, tmp_path):
    out = tmp_path / "read_only"
    out.mkdir()
    out.chmod(0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip(
                "running as root: chmod does not deny root's writes (the file-in-its-place test covers it)"
            )
        with pytest.raises(
            CheckpointError, match=rf"{out}: cannot write into the output directory \(Permission"
        ):
            train.main(train_argv(drawn_faces, str(out)))
        assert os.listdir(out) == []
    finally:
        out.chmod(0o755)


def test_failed_start_leaves_nothing_behind(drawn_faces, tmp_path, monkeypatch):
    """A start refused for its data writes no output directory (no stray work_dirs/ in the cwd)."""
    monkeypatch.chdir(tmp_path)
    argv = train_argv(str(tmp_path / "no_such_data"), "work_dirs/demo")
    argv[0] = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo.py")
    with pytest.raises(Exception, match="no_such_data"):
        train.main(argv)
    assert os.listdir(tmp_path) == []


def test_empty_lock_left_by_a_start_killed_mid_write_is_stale(tmp_path):
    out = str(tmp_path / "run")
    os.makedirs(out)
    path = os.path.join(out, LOCK_NAME)
    open(path, "w").close()
    with pytest.raises(CheckpointError, match="in use by a live run"):  # a racer may be writing it right now
        RunLock().acquire(out)
    old = time.time() - 10
    os.utime(path, (old, old))
    lock = RunLock()
    lock.acquire(out)
    lock.release()
    assert not os.path.exists(path)
