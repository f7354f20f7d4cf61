"""A run's own threshold (threshold.json) belongs to the weights it was measured on: it records
their fingerprint, a reader takes it only for weights of that fingerprint, and a run that
overwrites an earlier one deletes the earlier run's file (issue #54, item 11)."""

import json
import os
import shutil

from shardface import train
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.checkpoint.load import read_backbone_weights
from shardface.checkpoint.state import weights_fingerprint
from shardface.infer.model import load_model
from shardface.infer.thresholds import THRESHOLD_FILE, run_threshold
from tests.train_runs import train_argv

VERIFIED = ("--val_targets", "['drawn_faces_val']", "--verbose", "4")


def _run(data, out, *extra) -> None:
    assert train.main(train_argv(data, out, "--max_steps", "4", "--checkpoint_interval", "4", *extra)) == 0


def test_the_threshold_records_the_fingerprint_of_the_weights_the_tools_load(drawn_faces, tmp_path):
    out = str(tmp_path / "run")
    _run(drawn_faces, out, *VERIFIED)
    records = json.load(open(os.path.join(out, THRESHOLD_FILE)))
    assert set(records) == {"raw", "ema"} and records["ema"]["fingerprint"] != records["raw"]["fingerprint"]
    for path, ema, kind in (
        (out, True, "ema"),
        (out, False, "raw"),
        (os.path.join(out, "model.pt"), True, "ema"),
    ):
        model = load_model(path, ema=ema)
        assert model.fingerprint == records[kind]["fingerprint"]
        assert model.threshold is not None and model.threshold.record == records[kind]
    raw, _ = read_backbone_weights(resolve_checkpoint(out), ema=False)
    assert weights_fingerprint(raw) == records["raw"]["fingerprint"]


def test_another_runs_threshold_at_the_same_step_is_not_taken(drawn_faces, tmp_path):
    """Two runs saved at the same step: the first one's threshold.json beside the second's weights
    names no threshold for them (the step alone would match)."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _run(drawn_faces, first, *VERIFIED)
    _run(drawn_faces, second, "--seed", "7")
    shutil.copy(os.path.join(first, THRESHOLD_FILE), os.path.join(second, THRESHOLD_FILE))
    assert run_threshold(first) is not None
    for path in (second, os.path.join(second, "model.pt"), resolve_checkpoint(second)):
        assert run_threshold(path) is None
    assert load_model(second).threshold is None


def test_an_overwrite_deletes_the_earlier_runs_threshold(drawn_faces, tmp_path):
    """--resume false --overwrite true: the new run, saving at the same steps without verification,
    has no threshold, not the earlier model's."""
    out = str(tmp_path / "run")
    _run(drawn_faces, out, *VERIFIED)
    assert run_threshold(out) is not None
    _run(drawn_faces, out, "--seed", "7", "--resume", "false", "--overwrite", "true")
    assert not os.path.exists(os.path.join(out, THRESHOLD_FILE))
    assert run_threshold(out) is None and load_model(out).threshold is None
