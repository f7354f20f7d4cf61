"""Launched with torchrun like users do: a stop signal on one rank saves and exits cleanly on
every rank; a rank that dies makes the others exit instead of hanging."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import train_argv
from utils.checkpoint import resolve_checkpoint


def _launch(data_dir, output, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "train.py", *train_argv(data_dir, output, "--max_steps", "100000", "--num_epoch", "1000",
                                   "--checkpoint_interval", "100000", *extra)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    console = open(os.path.join(os.path.dirname(output), os.path.basename(output) + ".console"), "w")
    return subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _workers(launcher_pid):
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _wait_for_step(output, step, proc, timeout=120):
    log = os.path.join(output, "training.log")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isfile(log) and f"step {step}/" in open(log).read():
            return
        if proc.poll() is not None:
            console = open(output + ".console").read()
            raise AssertionError(f"training exited early:\n{console[-3000:]}")
        time.sleep(0.5)
    raise AssertionError("training did not reach step %d" % step)


def test_sigterm_on_one_rank_checkpoints_and_exits_cleanly_on_all(drawn_faces, tmp_path):
    out = str(tmp_path / "sigterm")
    proc = _launch(drawn_faces, out)
    try:
        _wait_for_step(out, 3, proc)
        workers = _workers(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGTERM)  # one rank only: the ranks must agree
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(os.path.join(out, "training.log")).read()
    assert "stop signal: saving a checkpoint" in text
    step = int(resolve_checkpoint(out).rsplit("-", 1)[1])
    assert step >= 3 and os.path.isfile(os.path.join(out, "model.pt"))


def test_dead_rank_makes_the_job_exit_instead_of_hanging(drawn_faces, tmp_path):
    out = str(tmp_path / "dead")
    proc = _launch(drawn_faces, out, "--dist_timeout_min", "1")
    try:
        _wait_for_step(out, 3, proc)
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)
        try:
            code = proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail("the surviving rank still runs 150 s after its peer was killed")
        assert code != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
