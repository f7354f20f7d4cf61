"""The run's checkpoint policy: what to save, where, and not the same step twice."""
from __future__ import annotations

import os

from utils.checkpoint import TrainState, atomic_save, load_checkpoint, save_checkpoint


class Checkpointer:
    """Saves the run's checkpoints (see utils/checkpoint.py) and `model.pt`, the backbone
    weights for export (EMA weights when EMA is on). `save` is collective: every rank calls
    it at the same step. It remembers the last step it saved, so the final save right after
    an interval save of the same step writes nothing."""

    def __init__(self, output: str, *, backbone, backbone_opt, head, head_opt, ema=None, scaler=None,
                 config=None, rank: int = 0, world_size: int = 1, keep: int = 2):
        self.output, self.config, self.rank, self.world_size, self.keep = output, config, rank, world_size, keep
        self.parts = dict(backbone=backbone, backbone_opt=backbone_opt, head=head, head_opt=head_opt,
                          ema=ema, scaler=scaler)
        self.last_saved_step: int | None = None

    def load(self, batch_size: int | None = None) -> tuple[TrainState, dict]:
        """Restore every part from the run's latest checkpoint, resharded to this world size."""
        state, meta = load_checkpoint(self.output, **self.parts, rank=self.rank, world_size=self.world_size,
                                      batch_size=batch_size)
        self.last_saved_step = state.step
        return state, meta

    def save(self, state: TrainState) -> None:
        if self.last_saved_step == state.step:
            return
        self.last_saved_step = state.step
        save_checkpoint(self.output, state, **self.parts, config=self.config, rank=self.rank,
                        world_size=self.world_size, keep=self.keep)
        ema, backbone = self.parts["ema"], self.parts["backbone"]
        weights = ema.state_dict() if ema is not None else backbone.state_dict()  # collective with EMA
        if self.rank == 0:
            atomic_save(weights, os.path.join(self.output, "model.pt"))
