"""benchmarks/whole_step.py at its smoke size (so the script cannot rot): our half always; both
halves where a snapshot of insightface's recognition/arcface_torch is at hand, named by the
ARCFACE_TORCH environment variable (CI has no internet, so without it that test skips, saying
so). Nothing here is timed: the figures of a smoke run mean nothing."""

import os
import re
import subprocess
import sys

import pytest

from tests.devices import CUDA, env_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.environ.get("ARCFACE_TORCH", "")
ROW = r"^\s*{}\s+mbf\s+64\s+2\s+fp32\s+(\d+)\s+(\d+\.\d+)\s+(\S+)\s*$"


def _smoke(kind: str, *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "benchmarks/whole_step.py", "--smoke", *extra],
        cwd=ROOT,
        env=env_for(kind),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_our_half_runs_train_py_step_without_a_snapshot(kind):
    out = _smoke(kind)
    ours = re.search(ROW.format("ShardFace"), out, re.M)
    assert ours and int(ours[1]) > 0 and float(ours[2]) > 0, out
    assert "arcface_torch: not run (no --arcface_torch DIR)" in out, out


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--set", "no_such_key=1"], "no_such_key"),
        (["--set", "lr=x"], "error: --lr: could not convert string to float: 'x'"),
        (["--rec", "/nowhere/at/all", "--classes", "16"], "/nowhere/at/all"),
    ],
)
def test_bad_input_is_train_pys_one_line_error(extra, said):
    done = subprocess.run(
        [sys.executable, "benchmarks/whole_step.py", "--smoke", *extra],
        cwd=ROOT,
        env=env_for("cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and len(errors) == 1 and said in errors[0], done.stderr[-2000:]


@pytest.mark.skipif(
    not os.path.isdir(SNAPSHOT),
    reason="no arcface_torch snapshot: set ARCFACE_TORCH to a copy of "
    "insightface's recognition/arcface_torch (docs/gpus.md says how to make one)",
)
@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_both_halves_run_from_the_snapshot_and_start_from_the_same_weights(kind):
    """arcface_torch's own backbone, PartialFC_V2 and margin, imported from the snapshot, load our
    initial weights strictly; on the same first batch, before any update, both steps compute
    the same loss (fp32)."""
    out = _smoke(kind, "--arcface_torch", SNAPSHOT)
    for name in ("ShardFace", "arcface_torch"):
        row = re.search(ROW.format(name), out, re.M)
        assert row and int(row[1]) > 0 and float(row[2]) > 0, out
    assert re.search(
        r"ours / arcface_torch: samples/s \d+\.\d+x, peak memory (n/a|\d+\.\d+x); initial weights: ours "
        r"\(backbone and head\)",
        out,
    ), out
    losses = re.findall(
        r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+\s*$", out.split("first steps' losses")[1], re.M
    )
    assert [int(s) for s, _, _ in losses] == [1, 2], out
    first_ours, first_theirs = float(losses[0][1]), float(losses[0][2])
    assert abs(first_ours - first_theirs) <= 1e-4 * first_theirs + 1e-4, out


def test_a_directory_that_is_not_an_arcface_torch_snapshot_is_refused_by_name(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from whole_step import load_arcface_torch
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    (tmp_path / "losses.py").write_text("")
    with pytest.raises(
        SystemExit,
        match=re.escape(
            f"--arcface_torch {tmp_path}: not a snapshot of insightface's "
            "recognition/arcface_torch (no backbones/__init__.py, "
            "partial_fc_v2.py, lr_scheduler.py)"
        ),
    ):
        load_arcface_torch(str(tmp_path))
