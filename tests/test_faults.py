"""Launched with torchrun like users do: a stop signal on one rank saves and exits cleanly on
every rank; a rank that dies makes the others exit instead of hanging."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from shardface.checkpoint.folders import resolve_checkpoint
from tests.train_runs import train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(data_dir, output, *extra, console=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train.py",
        *train_argv(
            data_dir,
            output,
            "--max_steps",
            "100000",
            "--num_epoch",
            "1000",
            "--checkpoint_interval",
            "100000",
            *extra,
        ),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    console = open(console or output + ".console", "w")
    return subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _workers(launcher_pid):
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _log_size(output):
    log = os.path.join(output, "training.log")
    return os.path.getsize(log) if os.path.isfile(log) else 0


def _wait_for_step(output, step, proc, timeout=120, after=0):
    """Until training.log shows `step` or later past its first `after` bytes (an earlier run's lines)."""
    log = os.path.join(output, "training.log")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isfile(log) and any(
            int(n) >= step for n in re.findall(r"step (\d+)/", open(log).read()[after:])
        ):
            return
        if proc.poll() is not None:
            console = open(output + ".console").read()
            raise AssertionError(f"training exited early:\n{console[-3000:]}")
        time.sleep(0.5)
    raise AssertionError("training did not reach step %d" % step)


def _finish(proc, timeout, what):
    """The launcher's exit code; fails (and kills the job) if it runs past `timeout` s."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        pytest.fail(f"{what}: still running after {timeout} s")


def _console(output):
    return open(output + ".console").read()


def _bad_label(data):
    import struct

    from shardface.dataset.recordio import read_index

    index = read_index(os.path.join(data, "train.idx"))
    with open(os.path.join(data, "train.rec"), "r+b") as f:
        for key in range(121, 129):  # the images of identity 15 now carry label 16, out of range
            f.seek(index[key] + 8 + 4)  # past the record's magic and length, the header's flag
            f.write(struct.pack("<f", 16.0))
    return ("--num_classes", "16"), "label 16 outside [0, 16)"


def _corrupt_record(data):
    from shardface.dataset.recordio import read_index

    offset = read_index(os.path.join(data, "train.idx"))[40]
    with open(os.path.join(data, "train.rec"), "r+b") as f:
        f.seek(offset)
        f.write(b"\0\0\0\0")  # the record's magic word
    return ("--num_classes", "16"), "bad magic"


@pytest.mark.parametrize(
    "spoil",
    [pytest.param(_bad_label, marks=pytest.mark.slow), _corrupt_record],
    ids=["bad_label", "corrupt_record"],
)
def test_data_error_with_loader_workers_exits_within_seconds(drawn_faces, tmp_path, spoil):
    """A worker's data error must end the job: workers get the default signal mask, so the
    SIGTERM Python sends them at exit is not ignored."""
    data = str(tmp_path / "spoilt")
    shutil.copytree(drawn_faces, data)
    extra, message = spoil(data)
    out = str(tmp_path / "run")
    proc = _launch(data, out, *extra, "--num_workers", "1")
    code = _finish(proc, 90, f"a run with a {spoil.__name__[1:]} and loader workers")
    assert code != 0
    assert message in _console(out)


def _listening(port):
    """Whether some process listens on TCP `port` (read from /proc, no connection made)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.isfile(table):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def test_sigterm_during_process_group_setup_exits_promptly(drawn_faces, tmp_path):
    """Rank 0 of two waits in init_process_group for a rank that never comes; torchrun's
    SIGTERM must end it within seconds, not after the rendezvous timeout."""
    from tests.distributed import free_port

    port = free_port()
    out = str(tmp_path / "setup")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    proc = subprocess.Popen(
        [sys.executable, "train.py", *train_argv(drawn_faces, out, "--dist_timeout_min", "5")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while not _listening(port):  # rank 0's store is up: it is waiting for rank 1
            assert proc.poll() is None and time.time() < deadline, "rank 0 never started its store"
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert _finish(proc, 15, "SIGTERM while waiting for a peer") == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


DUE_FOR_BOTH = """
import os, signal, sys, time
import shardface.train as train
from shardface.eval.callback import VerificationCallback
from shardface.parallel.stop import StopSignal

made = StopSignal.__init__

def short_grace(self, grace_s=20.0):
    made(self, 2.0)  # a 2 s grace

StopSignal.__init__ = short_grace
VerificationCallback.due = lambda self, step: step == 4
VerificationCallback.__call__ = lambda self, step: time.sleep(6)  # outlasts the grace
real = train.Run.optimizer_step

def step_then_sigterm(self):
    if self.state.step == 3:  # the signal arrives during step 4, the step due for both, taken by
        import shardface.parallel.stop as stop  # the stop signal's thread (as where no other thread
        signal.pthread_kill(stop._ACTIVE.waiter.ident, signal.SIGTERM)  # of an older mask runs)
        time.sleep(0.5)
    real(self)

train.Run.optimizer_step = step_then_sigterm
sys.exit(train.main(sys.argv[1:]))
"""


def test_sigterm_at_a_step_due_for_verification_and_a_checkpoint_saves_the_checkpoint_first(
    drawn_faces, tmp_path
):
    """Verification due at the same step would outlast the stop signal's grace: the checkpoint is
    saved first, and the verification skipped."""
    out = str(tmp_path / "run")
    argv = train_argv(drawn_faces, out, "--checkpoint_interval", "4", "--max_steps", "12")
    done = subprocess.run(
        [sys.executable, "-c", DUE_FOR_BOTH, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert resolve_checkpoint(out).endswith("checkpoint-00000004")
    assert (
        "stop signal: saving a checkpoint at step 4 and exiting"
        in open(os.path.join(out, "training.log")).read()
    )


@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_sigterm_on_one_rank_checkpoints_and_exits_cleanly_on_all(drawn_faces, tmp_path, workers):
    out = str(tmp_path / "sigterm")
    proc = _launch(drawn_faces, out, "--num_workers", str(workers))
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


@pytest.mark.parametrize("how", ["job", pytest.param("torchrun", marks=pytest.mark.slow)])
def test_preemption_of_a_torchrun_job_with_loader_workers_saves_and_exits(drawn_faces, tmp_path, how):
    """A pre-emption as clusters send it: SLURM signals every process of the job step
    (torchrun, ranks and their loader workers: "job"); `kill -TERM <torchrun pid>` makes
    torchrun signal each rank's process group, workers included ("torchrun"). Workers must
    outlive the signal so that every rank finishes its step and saves."""
    out = str(tmp_path / how)
    proc = _launch(drawn_faces, out, "--num_workers", "2")
    try:
        _wait_for_step(out, 3, proc)
        if how == "job":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _finish(proc, 90, f"a job pre-empted through {how}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = open(os.path.join(out, "training.log")).read()
    saved = re.findall(r"stop signal: saving a checkpoint at step (\d+)", log)
    assert saved, _console(out)[-3000:]
    assert "is killed by signal" not in _console(out)
    assert resolve_checkpoint(out).endswith(f"checkpoint-{int(saved[0]):08d}")
    assert int(saved[0]) >= 3 and os.path.isfile(os.path.join(out, "model.pt"))


@pytest.mark.slow
def test_second_job_on_a_live_jobs_output_is_refused_at_once_and_the_first_saves(drawn_faces, tmp_path):
    """A SLURM requeue or a double submission while the first job runs: the second job's
    ranks all stop at start, naming the live run; the first one goes on and saves."""
    out = str(tmp_path / "twice")
    first = _launch(drawn_faces, out, "--checkpoint_interval", "2")
    second = None
    try:
        _wait_for_step(out, 3, first)
        holder = json.load(open(os.path.join(out, "run.lock")))
        assert holder["pid"] in _workers(first.pid)
        second = _launch(drawn_faces, out, "--resume", "auto", console=out + ".second")
        assert _finish(second, 90, "the second job") != 0
        console = open(out + ".second").read()
        assert (
            f"in use by a live run (host {socket.gethostname()}, pid {holder['pid']}, user {holder['user']}"
            in console
        )
        log = open(os.path.join(out, "training.log")).read()
        assert log.count("config configs/demo.py") == 1 and "resumed at step" not in log  # it wrote nothing
        assert first.poll() is None  # the first job is unharmed and still training
        os.kill(_workers(first.pid)[1], signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert not os.path.exists(os.path.join(out, "run.lock"))
    _assert_resumable(drawn_faces, out)


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


def _assert_resumable(data_dir, out):
    """The newest intact checkpoint loads and training continues from it (one process)."""
    from shardface import train

    step = int(resolve_checkpoint(out).rsplit("-", 1)[1])
    # the launches' epoch count: the checkpoint may lie past train_argv's 3 epochs
    assert (
        train.main(
            train_argv(data_dir, out, "--resume", "auto", "--max_steps", str(step + 1), "--num_epoch", "1000")
        )
        == 0
    )
    assert int(resolve_checkpoint(out).rsplit("-", 1)[1]) == step + 1


@pytest.mark.slow
def test_repeated_kills_during_checkpoint_writes_leave_an_intact_checkpoint(drawn_faces, tmp_path):
    out = str(tmp_path / "kills")
    for round, delay in enumerate((0.3, 0.7, 1.1)):
        # a checkpoint every step: the kill lands in or near a write
        before = _log_size(out)
        proc = _launch(
            drawn_faces, out, "--resume", "auto", "--checkpoint_interval", "1", "--num_workers", "1"
        )
        try:
            _wait_for_step(out, 3 + 3 * round, proc, after=before)
            time.sleep(delay)
            os.kill(_workers(proc.pid)[0], signal.SIGKILL)
            assert _finish(proc, 60, "the job after a rank was killed") != 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert resolve_checkpoint(out)
    _assert_resumable(drawn_faces, out)


@pytest.mark.slow
def test_elastic_restart_with_resume_auto_continues_from_the_last_checkpoint(drawn_faces, tmp_path):
    out = str(tmp_path / "elastic")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "--max-restarts",
        "1",
        "train.py",
        *train_argv(
            drawn_faces,
            out,
            "--resume",
            "auto",
            "--max_steps",
            "40",
            "--num_epoch",
            "10",
            "--checkpoint_interval",
            "5",
            "--num_workers",
            "1",
        ),
    ]
    console = open(out + ".console", "w")
    proc = subprocess.Popen(
        cmd,
        stdout=console,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )
    try:
        _wait_for_step(out, 12, proc)
        os.kill(_workers(proc.pid)[1], signal.SIGKILL)  # torchrun restarts both ranks
        assert _finish(proc, 240, "the elastic job") == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = open(os.path.join(out, "training.log")).read()
    resumed = re.findall(r"resumed at step (\d+) ", log)
    assert resumed and int(resumed[0]) >= 10, log[-2000:]  # a checkpoint every 5 steps, killed after 12
    assert resolve_checkpoint(out).endswith("checkpoint-00000040")
