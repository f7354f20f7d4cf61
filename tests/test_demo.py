"""The embedded demo end to end (minutes): `make test-all` runs it, `make demo` is the same."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_demo_learns_to_verify_unseen_identities():
    out = subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--nproc", "2", "--min-accuracy", "0.90"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "untrained" in out.stdout and "trained (EMA weights)" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("margin", ["adaface", "magface", "curricularface", "subcenter_arcface"])
def test_demo_learns_with_each_margin_head(margin):
    out = subprocess.run(
        [sys.executable, "-m", "scripts.demo", "--nproc", "2", "--min-accuracy", "0.90", "--margin", margin],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
