"""Refused at start, in one line, with nothing written: what can be known before the first step
(the batch against the data, the wandb login) is checked before the output is touched."""
import os
import sys

import numpy as np
import pytest
from PIL import Image

import train
from parallel.user_errors import EXIT_USER_ERROR

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
                os.path.join(root, f"id{i}", f"{j}.png"))
    return str(root)


def test_batch_larger_than_a_small_folder_is_one_line_naming_batch_size_and_both_numbers(tmp_path, monkeypatch,
                                                                                          capsys):
    """The "your own images" path with the demo config's batch of 64 on 20 images."""
    data, out = _small_folder(tmp_path / "faces"), str(tmp_path / "run")
    code, lines, text = _cli(monkeypatch, capsys, [*DEMO, "--rec", data, "--num_classes", "5", "--output", out])
    assert code == EXIT_USER_ERROR and "Traceback" not in text
    assert len(lines) == 1 and "batch_size 64" in lines[0] and "20 samples" in lines[0] and data in lines[0], lines
    assert "--batch_size 20" in lines[0]
    assert not os.path.exists(out)
