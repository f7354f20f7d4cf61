"""A resume names each changed config key, and says the LR schedule changes only where it does."""

import pytest

from shardface.checkpoint.changes import log_resume_changes
from shardface.configs import get_config
from tests.log_capture import shardface_messages


def _total(cfg, steps_per_epoch: int = 8) -> int:
    """train.py's total_steps: num_epoch epochs, capped by max_steps where it is set."""
    return min(cfg.num_epoch * steps_per_epoch, cfg.max_steps or cfg.num_epoch * steps_per_epoch)


def _said(saved: dict, cfg, steps_per_epoch: int = 8) -> list[str]:
    meta = {"world_size": 1, "batch_size": cfg.batch_size, "config": {**cfg, **saved}}
    return shardface_messages(
        lambda: log_resume_changes(meta, cfg, 1, steps_per_epoch, _total(cfg, steps_per_epoch))
    )


@pytest.mark.parametrize(
    "saved,argv,span_changes",
    [
        ({"num_image": 100}, ["--num_image", "200"], False),  # the data set's images are counted instead
        ({"max_steps": 0}, ["--max_steps", "1000"], False),  # a cap above the 3 x 8 steps
        ({"max_steps": 0}, ["--max_steps", "10"], True),
        ({"num_epoch": 2}, ["--num_epoch", "3"], True),
    ],
)
def test_lr_schedule_is_said_to_span_new_steps_only_when_its_span_changes(saved, argv, span_changes):
    cfg = get_config(None, ["--num_epoch", "3", *argv])
    said = _said(saved, cfg)
    key = argv[0][2:]
    assert len(said) == 1 and said[0].startswith(f"config {key} {saved[key]!r} (checkpoint) -> ")
    assert ("the LR schedule now spans" in said[0]) == span_changes
    if span_changes:
        assert f"now spans {_total(cfg)} steps" in said[0]
    if key == "num_image":
        assert "not used" in said[0]
