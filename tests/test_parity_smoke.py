"""benchmarks/parity.py at its smoke size (so that the script cannot rot): train.py's half always;
arcface_torch's where a snapshot of insightface's recognition/arcface_torch is at hand, named by
the ARCFACE_TORCH environment variable (CI has no internet: without it, that half is not run,
and the script says so). Nothing here is timed: the figures of a smoke run mean nothing."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOT = os.environ.get("ARCFACE_TORCH", "")


def _smoke(*extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "benchmarks/parity.py", "--smoke", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_train_py_half_trains_under_torchrun_and_its_model_loads():
    out = _smoke()
    ours = re.search(r"^smoke shardface: (\d+) samples in [\d.]+ s, embeddings \(2, 64\)$", out, re.M)
    assert ours and int(ours[1]) == 2 * 2 * 2, out  # 2 steps of 2 per rank at W=2
    assert "arcface_torch: not run (no --arcface_torch DIR)" in out, out


@pytest.mark.skipif(not SNAPSHOT, reason="ARCFACE_TORCH names no snapshot of recognition/arcface_torch")
def test_arcface_torch_half_trains_from_its_snapshot_under_torchrun():
    out = _smoke("--arcface_torch", SNAPSHOT)
    theirs = re.search(r"^smoke arcface_torch: (\d+) samples in [\d.]+ s, (.+)$", out, re.M)
    assert theirs and int(theirs[1]) == 8 and theirs[2] in ("embeddings (2, 64)", "weights non-finite"), out
