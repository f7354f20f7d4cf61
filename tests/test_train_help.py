"""`python train.py --help` / `-h`: exit 0, every config key with its default and comment, from any directory."""

import os
import subprocess
import sys

import pytest

from shardface import train
from shardface.configs.base import config as base

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _assert_lists_every_key(text):
    lines = text.splitlines()
    for key in base:
        assert any(line.startswith(f"  --{key} ") for line in lines), key
    assert "  --sample_rate 1.0    Partial FC: fraction of each shard's classes per step" in lines
    assert "  --using_wandb False    log to Weights & Biases (pip install wandb)" in lines


def test_train_help_lists_every_key_with_default_and_comment(capsys):
    assert train.main(["--help"]) == 0
    _assert_lists_every_key(capsys.readouterr().out)


@pytest.mark.slow  # a fresh interpreter importing torch: several seconds
def test_train_dash_h_by_file_path_from_another_directory_exits_0_writing_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "train.py"), "configs/ms1mv3_r50", "-h"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _assert_lists_every_key(done.stdout)
    assert not os.listdir(tmp_path)


def test_help_and_readme_agree_that_arcface_torch_takes_its_schedule_from_num_image(capsys):
    # arcface_torch: warmup and total steps are num_image // global batch (times the epochs);
    # ShardFace counts the data set's images instead: --help and docs/arcface_torch.md say both
    assert train.main(["--help"]) == 0
    text = capsys.readouterr().out
    line = text[text.index("  --num_image ") :].split("\n  --")[0]
    assert "informational" not in line
    assert "arcface_torch's warmup and total steps come from it; ShardFace" in line
    assert "counts the data set's images instead" in line
    section = open(os.path.join(ROOT, "docs", "arcface_torch.md")).read()
    assert "the schedule counts the images of the data set (a warning names a config `num_image`" in section
