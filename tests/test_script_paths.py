"""Tools run by file path (`python scripts/verify.py`, arcface_torch's habit) from any directory
behave as `python -m scripts.verify` does: the repository's packages import, the same parser."""

import os
import subprocess
import sys

import pytest

from scripts import plan, verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("tool", [verify, plan], ids=["verify", "plan"])
def test_tool_run_by_file_path_from_another_directory_prints_the_module_help(
    tool, tmp_path, monkeypatch, capsys
):
    path = tool.__file__
    env = {**os.environ, "COLUMNS": "100"}
    env.pop("PYTHONPATH", None)  # only the file path tells Python where the repository is
    run = subprocess.run(
        [sys.executable, path, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "ModuleNotFoundError" not in run.stderr
    # the same parser as the module's main: argparse names the program after argv[0]'s file name
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(sys, "argv", [path])
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--help"])
    assert exit_.value.code == 0
    assert run.stdout == capsys.readouterr().out
    assert run.stdout.startswith(f"usage: {os.path.basename(path)}")


def test_every_tool_with_a_main_carries_the_file_path_preamble():
    scripts = os.path.join(REPO, "scripts")
    for name in sorted(os.listdir(scripts)):
        if not name.endswith(".py") or name == "__init__.py":
            continue
        with open(os.path.join(scripts, name)) as f:
            source = f.read()
        if "\ndef main(" in source:
            head = source[: source.index("\nimport ")] if "\nimport " in source else source
            assert "if not __package__:" in head, f"scripts/{name} cannot run as `python scripts/{name}`"
