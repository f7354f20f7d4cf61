"""Ranks whose losses differ still stop together (issue #39): with distillation each rank's
loss holds its own term, so one rank's NaN must stop every rank, at once, with the same exit
code; and the relational loss refuses a gathered batch whose ranks hold unequal rows."""

import time

import pytest
import torch

from shardface import train
from shardface.distill.head import DistillLoss
from tests.distributed import run_distributed
from tests.train_runs import train_argv

POISONED_STEP = 2


def _nan_on_rank_one(rank, world_size, args):
    """A test hook: rank 1's loss (and only rank 1's) is NaN at step POISONED_STEP, a logging step."""
    import shardface.distill.run

    if rank == 1:
        real, calls = shardface.distill.run.Distillation.loss, []

        def poisoned(self, *a):
            calls.append(None)
            loss = real(self, *a)
            return loss * float("nan") if len(calls) == POISONED_STEP else loss

        shardface.distill.run.Distillation.loss = poisoned
    start = time.monotonic()
    code = train.main(args)
    return code, time.monotonic() - start


def test_nan_loss_on_one_rank_stops_every_rank_with_exit_3_within_seconds(drawn_faces, teacher_pt, tmp_path):
    args = train_argv(
        drawn_faces,
        str(tmp_path / "run"),
        "--teacher",
        teacher_pt,
        "--teacher_network",
        "tiny",
        "--max_steps",
        "6",
        "--checkpoint_interval",
        "6",
        "--frequent",
        "1",
    )
    (code0, took0), (code1, took1) = run_distributed(_nan_on_rank_one, 2, args, timeout=120)
    assert (code0, code1) == (3, 3)
    assert max(took0, took1) < 60, (took0, took1)  # not the collective timeout
    log = open(str(tmp_path / "run" / "training.log")).read()  # rank 0's, whose own loss was finite
    assert f"loss is not finite on another rank at step {POISONED_STEP}" in log, log[-2000:]


def test_relational_loss_refuses_ranks_with_unequal_batches_in_one_line():
    loss = DistillLoss("relational", 1.0)
    loss.world_size, loss.rank = 2, 1  # as rank 1 of 2 would be built
    local, teacher = torch.randn(3, 8), torch.randn(3, 4)
    with pytest.raises(
        ValueError,
        match=r"^relational distillation: 4 gathered rows are not 2 ranks x this "
        r"rank's 3",
    ):
        loss.term(local, teacher, torch.randn(4, 8))
