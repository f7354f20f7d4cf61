"""A config, data or checkpoint error reaches the user as one line, `error: <message>`, printed
once per job (one process or a torchrun job), with exit code 2 and no traceback unless
SHARDFACE_DEBUG=1; its message says how to fix it."""

import datetime
import io
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from shardface.checkpoint.files import CheckpointError
from shardface.dataset.errors import DataError
from shardface.errors import ConfigError, UserError
from shardface.parallel.user_errors import EXIT_USER_ERROR, one_line, report_user_error
from tests.distributed import free_port
from tests.train_runs import train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


def _cli(monkeypatch, capsys, argv: list[str]):
    """train.py's command line run in this process: (its exit code, what it printed)."""
    from shardface import train

    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    return exit_.value.code, capsys.readouterr()


def _cases(data, out):
    """(train.py arguments, error type, fragments the message must hold) per kind of user error."""
    return {
        "unknown_key": (train_argv(data, out, "--batch_szie", "8"), ConfigError, ["batch_szie"]),
        "batch_size_1": (
            train_argv(data, out, "--batch_size", "1"),
            ConfigError,
            ["batch_size", "BatchNorm"],
        ),
        "missing_rec": (train_argv(out + "_nowhere", out), DataError, [out + "_nowhere"]),
        "resume_true_fresh_output": (
            train_argv(data, out, "--resume", "true"),
            CheckpointError,
            ["--resume auto"],
        ),
        "resume_and_overwrite": (
            train_argv(data, out, "--resume", "auto", "--overwrite", "true"),
            ConfigError,
            ["--resume auto and --overwrite true", "pass one"],
        ),
        "missing_val_bin": (
            train_argv(data, out, "--val_targets", "['lfw']", "--verbose", "4"),
            DataError,
            ["lfw.bin", "--val_targets '[]'", "--val_dir"],
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown_key",
        "batch_size_1",
        "missing_rec",
        "resume_true_fresh_output",
        "resume_and_overwrite",
        "missing_val_bin",
    ],
)
def test_user_error_prints_one_line_and_exits_2_without_config_dump(
    drawn_faces, tmp_path, monkeypatch, capsys, case
):
    from shardface import train

    argv, kind, fragments = _cases(drawn_faces, str(tmp_path / "run"))[case]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    assert exit_.value.code == EXIT_USER_ERROR
    captured = capsys.readouterr()
    lines = _error_lines(captured.out + captured.err)
    assert len(lines) == 1, captured.out + captured.err
    assert all(f in lines[0] for f in fragments), lines[0]
    assert "network " not in captured.out  # the config dump comes only after the run is accepted
    monkeypatch.setenv("SHARDFACE_DEBUG", "1")  # the opt-in: the exception itself, traceback and all
    with pytest.raises(kind):
        train.cli()


def test_a_resume_with_another_network_is_one_line_naming_both_networks(
    drawn_faces, tmp_path, monkeypatch, capsys
):
    out = str(tmp_path / "run")
    assert _cli(monkeypatch, capsys, train_argv(drawn_faces, out, "--max_steps", "4"))[0] in (0, None)
    argv = train_argv(drawn_faces, out, "--resume", "true", "--network", "mbf", "--embedding_size", "32")
    code, captured = _cli(monkeypatch, capsys, argv)
    assert code == EXIT_USER_ERROR
    lines = _error_lines(captured.out + captured.err)
    assert len(lines) == 1 and len(lines[0]) < 400, lines
    assert (
        "the checkpoint's backbone is tiny, embedding_size 128; this run builds mbf, embedding_size 32"
        in lines[0]
    )
    assert "size mismatch" not in captured.out + captured.err


def test_a_resume_of_a_checkpoint_without_its_rng_file_names_it_with_a_hint_for_train_py(
    drawn_faces, tmp_path, monkeypatch, capsys
):
    import glob

    out = str(tmp_path / "run")
    assert _cli(monkeypatch, capsys, train_argv(drawn_faces, out, "--max_steps", "4"))[0] in (0, None)
    for rng in glob.glob(os.path.join(out, "checkpoint-*", "rng-rank0.pt")):
        os.remove(rng)
    code, captured = _cli(monkeypatch, capsys, train_argv(drawn_faces, out, "--resume", "true"))
    assert code == EXIT_USER_ERROR
    [line] = _error_lines(captured.out + captured.err)
    assert "lacks rng-rank0.pt" in line, line
    assert "for its weights" not in line and f"--init_backbone {os.path.join(out, 'model.pt')}" in line, line


def test_user_error_from_the_command_line_has_no_traceback(drawn_faces, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SHARDFACE_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "train.py", *train_argv(drawn_faces, str(tmp_path / "run"), "--lr", "x")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert _error_lines(proc.stderr) == ["error: --lr: could not convert string to float: 'x'"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown_key", "resume_true_fresh_output", "missing_val_bin"])
def test_user_error_under_torchrun_is_printed_once(drawn_faces, tmp_path, case):
    """Every rank finds the first two (before and after the process group exists); rank 0
    alone the third (only rank 0 loads the val sets)."""
    argv, _, fragments = _cases(drawn_faces, str(tmp_path / "run"))[case]
    env = {k: v for k, v in os.environ.items() if k != "SHARDFACE_DEBUG"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "train.py",
            *argv,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    text = proc.stdout + proc.stderr
    lines = _error_lines(text)
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), text
    assert "exitcode  : 2" in text  # the rank's own exit code, in torchrun's summary
    assert proc.returncode == 1  # torchrun's, for any failed worker
    # the one traceback is torchrun's own (ChildFailedError): no frame of ours
    assert text.count("Traceback (most recent call last)") <= 1 and 'train.py", line' not in text


def test_dataloader_worker_error_is_reported_by_its_own_message():
    from torch._utils import ExceptionWrapper

    try:
        raise DataError("/data/train.rec: record 40 has a bad magic word")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as caught:
        wrapped.reraise()
    assert "Original Traceback" in str(caught.value)
    assert one_line(caught.value) == "/data/train.rec: record 40 has a bad magic word"


def test_config_data_and_checkpoint_errors_are_user_errors_and_keep_their_builtin_bases():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)
    assert issubclass(DataError, UserError) and issubclass(DataError, ValueError)
    assert issubclass(CheckpointError, UserError) and issubclass(CheckpointError, RuntimeError)


@pytest.fixture
def job_store():
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}


def test_only_rank_0_prints_an_error_every_rank_found(job_store):
    store, env = job_store
    rank0, rank1 = io.StringIO(), io.StringIO()
    assert report_user_error(ConfigError("config x = 1: bad"), dict(env, RANK="0"), rank0)
    assert not report_user_error(ConfigError("config x = 1: bad"), dict(env, RANK="1"), rank1, wait_s=5)
    assert rank0.getvalue() == "error: config x = 1: bad\n" and rank1.getvalue() == ""


def test_a_rank_prints_the_error_rank_0_did_not_report(job_store):
    _, env = job_store
    rank1 = io.StringIO()
    assert report_user_error(DataError("/d/train.rec: bad magic"), dict(env, RANK="1"), rank1, wait_s=0.5)
    assert rank1.getvalue() == "error: /d/train.rec: bad magic\n"


def test_a_rank_failing_after_a_peer_reported_a_user_error_exits_2_quietly(job_store, monkeypatch, capsys):
    from shardface.parallel.user_errors import exits_on_user_error

    _, env = job_store
    for key, value in dict(env, RANK="1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)

    def lost_peer():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError):  # nobody reported: a real failure keeps its traceback
        exits_on_user_error(lost_peer)()
    assert report_user_error(ConfigError("config x = 1: bad"), dict(env, RANK="0"), io.StringIO())
    assert exits_on_user_error(lost_peer)() == EXIT_USER_ERROR
    assert capsys.readouterr().err == ""


class _CtrlCAtFirstDraw(io.StringIO):
    """A terminal on which a Ctrl-C lands the moment the first thing written to it is shown."""

    interrupted = False

    def flush(self):
        if self.getvalue() and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt


@pytest.mark.parametrize("when", ["in the bar's construction", "while the bar runs"])
def test_a_ctrl_c_line_starts_a_line_of_its_own_after_an_open_progress_bar(monkeypatch, when):
    from shardface.parallel.user_errors import _interrupt_in_one_line
    from shardface.utils.progress import progress_bar

    terminal = _CtrlCAtFirstDraw() if when == "in the bar's construction" else io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("SHARDFACE_DEBUG", raising=False)
    try:
        bar = progress_bar(80, "aligning")  # the Ctrl-C comes before `with` holds it
        bar.update(1)
        raise KeyboardInterrupt
    except KeyboardInterrupt as exc:
        _interrupt_in_one_line(sys.__excepthook__)(KeyboardInterrupt, exc, exc.__traceback__)
    lines = terminal.getvalue().splitlines()
    assert lines[-1] == "SIGINT received: stopped; outputs are published whole or not at all"
    assert "aligning:" in lines[-2], lines
