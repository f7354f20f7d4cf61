"""The run's checkpoint policy: where a run starts, what is saved, and what is never saved."""

from __future__ import annotations

import logging
import os
import shutil

from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.folders import find_checkpoint, list_checkpoints
from shardface.checkpoint.load import load_checkpoint
from shardface.checkpoint.save import save_checkpoint
from shardface.checkpoint.state import TrainState, new_run_id
from shardface.parallel.dist import barrier, from_rank0
from shardface.utils.divergence import check_weights, weight_norm

logger = logging.getLogger("shardface")
# what a run writes beside its checkpoints, of its weights: an overwrite deletes them with the
# checkpoints (threshold.json: eval/callback.py's, infer.thresholds.THRESHOLD_FILE)
RUN_FILES = ("latest", "model.pt", "threshold.json")


def start_logs_over(output: str) -> None:
    """A start-over's logs show only the new run: the earlier run's TensorBoard events are
    deleted (before this run's writer exists) and training.log is emptied. This run's own lines
    so far are still held in memory (train.py opens its log only once the run is accepted), so
    the log holds all of them and nothing of the earlier run."""
    shutil.rmtree(os.path.join(output, "tensorboard"), ignore_errors=True)
    log = os.path.join(output, "training.log")
    if os.path.isfile(log):
        os.truncate(log, 0)


class Checkpointer:
    """Saves the run's checkpoints (see the checkpoint package) and `model.pt`, the backbone
    weights for export (EMA weights when EMA is on). Every method is collective: all ranks
    call it at the same step. `save` remembers the last step it saved, so the final save
    right after an interval save of the same step writes nothing."""

    def __init__(
        self,
        output: str,
        *,
        backbone,
        backbone_opt,
        head,
        head_opt,
        ema=None,
        scaler=None,
        config=None,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 2,
    ):
        self.output = output
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.parts = dict(
            backbone=backbone, backbone_opt=backbone_opt, head=head, head_opt=head_opt, ema=ema, scaler=scaler
        )
        self.last_saved_step: int | None = None
        self.resumed_meta: dict | None = None
        self.extra_meta: dict | None = None  # joins every checkpoint's meta.pt (distillation's centre)
        self.start_norm = weight_norm(backbone)  # built weights: the reference of the divergence rule

    def start(self, resume, overwrite: bool = False, batch_size: int | None = None) -> TrainState:
        """Where this run begins. `resume` True: from the output's latest checkpoint (an error
        if none); "auto": from it if there is one, else fresh; False: fresh, and an output that
        already holds checkpoints is refused unless `overwrite`, which deletes them and the
        earlier run's RUN_FILES first (so a second run can never prune or overwrite the first
        one's checkpoints, nor take its threshold) and starts its logs over (`start_logs_over`)."""
        ema_optional = bool(self.config is not None and self.config.reset_ema)
        existing = find_checkpoint(self.output, ema_optional) if os.path.isdir(self.output) else None
        barrier()  # every rank has looked before rank 0 may delete anything
        if (
            resume is True and existing is None and not list_checkpoints(self.output)
        ):  # (a broken one: its own error)
            raise CheckpointError(
                f"--resume true but {self.output} holds no checkpoint to continue: pass --resume auto "
                f"to continue when there is one and start fresh otherwise, or check --output"
            )
        if resume is True or (resume == "auto" and existing is not None):
            # the checkpoint found above: resolving the output again would repeat its fallback warning
            state, self.resumed_meta = load_checkpoint(
                existing or self.output,
                **self.parts,
                rank=self.rank,
                world_size=self.world_size,
                batch_size=batch_size,
                config=self.config,
            )
            self.last_saved_step = state.step
            return state
        leftovers = list_checkpoints(self.output)
        if not leftovers and not overwrite and os.path.isfile(os.path.join(self.output, "model.pt")):
            # its checkpoints deleted to save space, the trained weights are all that is left of it
            raise CheckpointError(
                f"{self.output} holds model.pt of an earlier run (and no checkpoint to resume): pass --overwrite "
                f"true to replace it, or choose another --output"
            )
        if leftovers and resume is False:
            if not overwrite:
                raise CheckpointError(
                    f"{self.output} holds checkpoints of an earlier run (newest {os.path.basename(leftovers[-1][1])}): "
                    f"pass --resume true (or auto) to continue it, or --overwrite true to delete them and start over"
                )
            if self.rank == 0:
                for _, path in leftovers:
                    shutil.rmtree(path)
                for name in RUN_FILES:
                    if os.path.exists(os.path.join(self.output, name)):
                        os.remove(os.path.join(self.output, name))
                start_logs_over(self.output)
                logger.warning(
                    "overwrite: deleted %d checkpoints of an earlier run in %s", len(leftovers), self.output
                )
            barrier()
        return TrainState(run_id=from_rank0(new_run_id()))

    def save(self, state: TrainState, batch=None) -> None:
        """Write a checkpoint of `state` and `model.pt`, unless this step was saved already.
        Raises TrainingStopped instead when the weights are not finite, give a non-finite loss on
        `batch` (the step's last images and labels), or exploded (utils/divergence.py's rule):
        no poisoned checkpoint is written."""
        if self.last_saved_step == state.step:
            return
        backbone, backbone_opt = self.parts["backbone"], self.parts["backbone_opt"]
        if hasattr(backbone_opt, "wait_params"):  # ZeRO-2's parameter all-gather may still be writing them
            backbone_opt.wait_params()
        check_weights(state.step, backbone, self.parts["head"], batch, self.start_norm)
        self.last_saved_step = state.step
        save_checkpoint(
            self.output,
            state,
            **self.parts,
            config=self.config,
            rank=self.rank,
            world_size=self.world_size,
            keep=self.keep,
            export_to=os.path.join(self.output, "model.pt"),
            extra_meta=self.extra_meta,
        )
