"""Reusable 1-D buffers for ZeRO-2's gradient buckets and received gradient pieces."""

from __future__ import annotations

import torch


class ScratchPool:
    """Lends 1-D buffers and takes them back for reuse.

    On CPU every fresh allocation of a few MB is new pages, which the kernel zeroes on first
    touch: allocating the gradient buckets every backward cost as much as the whole gradient
    exchange (benchmarks/README.md). On GPU torch's caching allocator already reuses blocks.

    `take` lends the smallest free buffer that is large enough (as a view of the requested
    length) or allocates one; free buffers too small for a request that missed are dropped,
    so the pool settles on a few buffers sized for the largest requests instead of growing.
    `held_bytes` counts everything the pool owns, lent or free; `peak_held_bytes` its maximum.
    """

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its buffer
        self.held_bytes = 0
        self.peak_held_bytes = 0

    @staticmethod
    def _bytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        same_kind = [i for i, b in enumerate(self.free) if b.dtype == dtype and b.device == device]
        fits = [i for i in same_kind if self.free[i].numel() >= numel]
        if fits:
            buffer = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            for i in reversed(same_kind):  # all too small: give their memory back
                self.held_bytes -= self._bytes(self.free.pop(i))
            buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.held_bytes += self._bytes(buffer)
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        view = buffer[:numel]
        self.lent[view.data_ptr()] = buffer
        return view

    def give(self, view: torch.Tensor) -> None:
        self.free.append(self.lent.pop(view.data_ptr()))
