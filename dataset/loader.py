"""Distributed, resumable sampling and the DataLoader around it."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from shardface.dataset.errors import DataError
from shardface.dataset.images import jpeg_decoder


class ResumableDistributedSampler(Sampler[int]):
    """Each rank reads a disjoint 1/W of a per-epoch permutation (seed + epoch).

    The epoch's order is `torch.randperm(n)` seeded with seed + epoch; rank r takes every W-th
    index from position r, over the `batches_per_epoch * batch_size * W` positions used.
    `set_epoch(epoch, start_batch)` positions the sampler; with `start_batch` > 0 the first
    `start_batch * batch_size` indices of this rank's epoch are skipped, so a run resumed
    mid-epoch sees exactly the samples the interrupted run had not yet seen. Every rank gets
    `len(dataset) // (W * batch_size)` full batches (drop_last).

    Memory: a rank holds only its own indices, as an int64 tensor (8 bytes each), and turns
    them into Python ints a slice at a time; the full permutation exists only while it is
    drawn. (A list of every index on every rank is ~1.5 GB per rank for WebFace42M.)
    """

    _INTS_PER_SLICE = 16384  # Python ints alive at once while iterating

    def __init__(
        self,
        dataset_len: int,
        world_size: int,
        rank: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        source: str = "the data set",
    ):
        if (
            dataset_len < world_size * batch_size
        ):  # a user's setting, not a bug: one line naming the key (`source`)
            ranks = f" x {world_size} ranks = {world_size * batch_size}" if world_size > 1 else ""
            fit = dataset_len // world_size  # BatchNorm needs 2 or more per rank (configs/validate.py)
            fix = f"use --batch_size {fit} or less, or more data" if fit >= 2 else "use more data"
            raise DataError(
                f"batch_size {batch_size}{ranks} is more than the {dataset_len} samples of {source}: "
                f"one batch per rank cannot be filled; {fix}"
            )
        self.n, self.world_size, self.rank = dataset_len, world_size, rank
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.batches_per_epoch = dataset_len // (world_size * batch_size)
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch {start_batch} outside [0, {self.batches_per_epoch}]")
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_indices(self) -> torch.Tensor:
        """This rank's whole epoch (int64, `batches_per_epoch * batch_size` indices)."""
        used = self.batches_per_epoch * self.batch_size * self.world_size
        if not self.shuffle:
            return torch.arange(self.rank, used, self.world_size)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        # clone: the rank's strided slice must not keep the n-element permutation alive
        return torch.randperm(self.n, generator=g)[self.rank : used : self.world_size].clone()

    def __iter__(self):
        remaining = self.epoch_indices()[self.start_batch * self.batch_size :]
        for part in remaining.split(self._INTS_PER_SLICE):
            yield from part.tolist()

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


class _EpochKeys(Sampler):
    """The sampler's indices as keys `(epoch, seed, index)`, where (epoch, seed) is what the
    main process's dataset was set to when the epoch's iteration began."""

    def __init__(self, sampler: ResumableDistributedSampler, dataset: Dataset):
        self.sampler, self.dataset = sampler, dataset

    def __iter__(self):
        state = (getattr(self.dataset, "epoch", None), getattr(self.dataset, "seed", None))
        return ((*state, index) for index in self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


class _EpochItems(Dataset):
    """Reads `(epoch, seed, index)` keys: persistent workers keep their own copy of the dataset
    from the first epoch, so the epoch (which fixes the mirroring) travels with each index.
    `with_index`: each item ends with its index; `teacher_rows`: with `teacher_rows(index)`, read
    here, in the worker (a teacher file's row of the record)."""

    def __init__(self, dataset: Dataset, with_index: bool = False, teacher_rows=None):
        self.dataset, self.with_index, self.teacher_rows = dataset, with_index, teacher_rows

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, seed, index = key
        current = (getattr(self.dataset, "epoch", None), getattr(self.dataset, "seed", None))
        if epoch is not None and current != (epoch, seed):
            self.dataset.set_epoch(epoch, seed)
        item = self.dataset[index]
        if self.with_index:
            item = (*item, index)
        return (*item, self.teacher_rows(index)) if self.teacher_rows is not None else item


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32  # distinct per worker, per rank
    np.random.seed(seed)
    random.seed(seed)


def get_dataloader(
    dataset: Dataset,
    sampler: ResumableDistributedSampler,
    num_workers: int = 2,
    device: torch.device | str = "cpu",
    seed: int = 0,
    persistent_workers: bool = True,
    with_index: bool = False,
    teacher_rows=None,
) -> DataLoader:
    """Batches of `sampler.batch_size`; pinned memory and prefetching when training on GPU.

    Build it once and iterate it once per epoch, after `sampler.set_epoch(epoch, start_batch)`
    and the dataset's `set_epoch`: with `persistent_workers` the worker processes (and their
    open record files) survive from one epoch to the next, and every item still follows the
    current epoch's order and mirroring. A loader built anew each epoch also works (its
    workers end with it). `with_index`: batches are (images, labels, record indices).
    `teacher_rows` (index -> tensor, a teacher file's `row`): batches end with the rows of their
    records, read by the workers and pinned with the images.
    """
    on_gpu = torch.device(device).type == "cuda"
    if num_workers > 0:
        jpeg_decoder()  # imported once here, not once per worker
    g = torch.Generator().manual_seed(seed + 1000 * sampler.rank + sampler.epoch)
    return DataLoader(
        _EpochItems(dataset, with_index, teacher_rows),
        batch_size=sampler.batch_size,
        sampler=_EpochKeys(sampler, dataset),
        num_workers=num_workers,
        drop_last=True,
        pin_memory=on_gpu,
        worker_init_fn=_seed_worker,
        generator=g,
        prefetch_factor=4 if num_workers > 0 and on_gpu else None,
        persistent_workers=persistent_workers and num_workers > 0,
    )
