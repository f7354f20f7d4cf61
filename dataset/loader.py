"""Distributed, resumable sampling and the DataLoader around it."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ResumableDistributedSampler(Sampler[int]):
    """Each rank reads a disjoint 1/W of a per-epoch permutation (seed + epoch).

    `set_epoch(epoch, start_batch)` positions the sampler; with `start_batch` > 0 the first
    `start_batch * batch_size` indices of this rank's epoch are skipped, so a run resumed
    mid-epoch sees exactly the samples the interrupted run had not yet seen. Every rank gets
    `len(dataset) // (W * batch_size)` full batches (drop_last).
    """

    def __init__(self, dataset_len: int, world_size: int, rank: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True):
        if dataset_len < world_size * batch_size:
            raise ValueError(f"{dataset_len} samples cannot fill one batch of {batch_size} on {world_size} ranks")
        self.n, self.world_size, self.rank = dataset_len, world_size, rank
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.batches_per_epoch = dataset_len // (world_size * batch_size)
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch {start_batch} outside [0, {self.batches_per_epoch}]")
        self.epoch, self.start_batch = epoch, start_batch

    def epoch_indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        used = self.batches_per_epoch * self.batch_size * self.world_size
        return order[self.rank:used:self.world_size]

    def __iter__(self):
        return iter(self.epoch_indices()[self.start_batch * self.batch_size:])

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.start_batch) * self.batch_size


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32  # distinct per worker, per rank, per epoch
    np.random.seed(seed)
    random.seed(seed)


def get_dataloader(dataset: Dataset, sampler: ResumableDistributedSampler, num_workers: int = 2,
                   device: torch.device | str = "cpu", seed: int = 0) -> DataLoader:
    """Batches of `sampler.batch_size`; pinned memory and prefetching when training on GPU."""
    on_gpu = torch.device(device).type == "cuda"
    g = torch.Generator().manual_seed(seed + 1000 * sampler.rank + sampler.epoch)
    return DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler, num_workers=num_workers,
                      drop_last=True, pin_memory=on_gpu, worker_init_fn=_seed_worker, generator=g,
                      prefetch_factor=4 if num_workers > 0 and on_gpu else None,
                      persistent_workers=False)
