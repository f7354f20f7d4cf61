"""A saved data position belongs to one data set's order: on other data the epoch restarts.

The sampler's order is a permutation of `len(dataset)` indices drawn from (seed, epoch), and
`batch_in_epoch` counts the batches of it already trained. When the data set has grown,
shrunk or been replaced since the checkpoint, that count names other samples (or lies past
the epoch's end), so the epoch starts again from its first batch: the run keeps its step,
weights and epoch, and says so in one warning.
"""

from __future__ import annotations

import logging

from shardface.checkpoint.state import TrainState

logger = logging.getLogger("shardface")


def follow_data(
    state: TrainState,
    saved_meta: dict | None,
    size: int,
    fingerprint: str,
    source: str,
    batches_per_epoch: int,
) -> bool:
    """Record the data set (`size`, `fingerprint`) in `state`, which every checkpoint saves.
    When resuming (`saved_meta`: the checkpoint's meta) onto another data set than the one the
    checkpoint recorded, or to a position past this data's epoch end (a checkpoint that
    recorded none), reset the position to the epoch's first batch with one warning naming
    `source`. Returns whether it did."""
    state.data_size, state.data_fingerprint = size, fingerprint
    if saved_meta is None:
        return False
    old_size, old_fingerprint = saved_meta.get("data_size") or 0, saved_meta.get("data_fingerprint") or ""
    if old_size:
        if (old_size, old_fingerprint) == (size, fingerprint):
            return False
        change = (
            f"{old_size} -> {size} samples"
            if old_size != size
            else f"{size} samples as before, but other ones or in another order"
        )
    elif state.batch_in_epoch > batches_per_epoch:
        change = f"the saved batch {state.batch_in_epoch} is past this data's {batches_per_epoch} per epoch"
    else:
        return False  # a checkpoint that recorded no data set, at a position this data still has
    logger.warning(
        "%s changed since the checkpoint of step %d (%s): its position (epoch %d, batch %d) is one in "
        "the old data's order, so epoch %d restarts from its first batch",
        source,
        state.step,
        change,
        state.epoch,
        state.batch_in_epoch,
        state.epoch,
    )
    state.batch_in_epoch = 0
    return True
