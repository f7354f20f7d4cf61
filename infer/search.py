"""Exact inner-product search over a gallery: one small interface, as faiss's `Index`, over two
engines that give the same answer.

    index = make_index(dim, engine="exact")   # or "faiss"
    index.add(gallery)                        # N x D float rows, ids 0 .. N-1 in order added
    scores, ids = index.search(queries, k)    # Q x k float32 scores, Q x k int64 ids

Rows come back best first; equal scores are ordered by the lower id first, in both engines,
so a result never depends on the engine, the block sizes or the thread count. With k larger
than the gallery, the missing places hold score -inf and id -1 (faiss's convention).

`ExactIndex` keeps the gallery in blocks (float32 or float16 storage) and scores one block
of queries against one block of gallery rows at a time, keeping a running top-k: memory
beyond the gallery itself is bounded by the two block sizes, never Q x N. `FaissIndex` is
faiss-cpu's `IndexFlatIP`, the field's standard exact engine, with the tie order made explicit
(faiss leaves the order of equal scores to its heap)."""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

ENGINES = ("exact", "faiss")


class Index(Protocol):
    dim: int

    @property
    def ntotal(self) -> int: ...

    def add(self, x: np.ndarray) -> None: ...

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...


def _check_rows(x: np.ndarray, dim: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what}: expected N x {dim} vectors, got shape {x.shape}")
    return x


def _order(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of each row by (score descending, id ascending): two stable sorts."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, by_score), ids.gather(1, by_score)


def _block_top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top k columns of each row of a Q x B score block, ties at the k-th place resolved to the
    lower column. torch.topk picks among equal scores arbitrarily, so the rows where the k-th
    score is shared beyond the k places (rare with real embeddings) are sorted stably instead."""
    k = min(k, scores.shape[1])
    values, cols = torch.topk(scores, k, dim=1)
    crowded = (scores >= values[:, -1:]).sum(1) > k
    if bool(crowded.any()):
        rows = crowded.nonzero().squeeze(1)
        order = torch.argsort(scores[rows], dim=1, descending=True, stable=True)[:, :k]
        cols[rows] = order
        values[rows] = scores[rows].gather(1, order)
    return values, cols


class ExactIndex:
    """Blocked exact search in torch on the CPU (see the module docstring). `dtype` float16
    halves the gallery's memory; scores are always accumulated in float32."""

    def __init__(self, dim: int, dtype: torch.dtype = torch.float32, gallery_block: int = 32768,
                 query_block: int = 256):
        self.dim, self.dtype = dim, dtype
        self.gallery_block, self.query_block = gallery_block, query_block
        self.blocks: list[torch.Tensor] = []

    @property
    def ntotal(self) -> int:
        return sum(len(b) for b in self.blocks)

    def add(self, x: np.ndarray) -> None:
        x = torch.as_tensor(_check_rows(x, self.dim, "add"))
        for start in range(0, len(x), self.gallery_block):
            piece = x[start:start + self.gallery_block].to(self.dtype)
            if self.blocks and len(self.blocks[-1]) < self.gallery_block:  # fill the last block first
                room = self.gallery_block - len(self.blocks[-1])
                self.blocks[-1] = torch.cat([self.blocks[-1], piece[:room]])
                piece = piece[room:]
            if len(piece):
                self.blocks.append(piece.clone())

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        q_all = torch.as_tensor(_check_rows(x, self.dim, "search"), dtype=torch.float32)
        out_s = torch.full((len(q_all), k), -torch.inf)
        out_i = torch.full((len(q_all), k), -1, dtype=torch.int64)
        for qs in range(0, len(q_all), self.query_block):
            q = q_all[qs:qs + self.query_block]
            best_s = torch.full((len(q), 0), -torch.inf)
            best_i = torch.zeros((len(q), 0), dtype=torch.int64)
            offset = 0
            for block in self.blocks:
                g = block if block.dtype == torch.float32 else block.float()
                s, cols = _block_top(q @ g.T, k)
                best_s, best_i = _order(torch.cat([best_s, s], 1), torch.cat([best_i, cols + offset], 1), k)
                offset += len(block)
            n = best_s.shape[1]
            out_s[qs:qs + len(q), :n], out_i[qs:qs + len(q), :n] = best_s, best_i
        return out_s.numpy(), out_i.numpy()


class FaissIndex:
    """faiss-cpu's exact IndexFlatIP, with equal scores ordered by the lower id. faiss returns a
    true top-k set by score, but which of several equal scores at the k-th place it keeps is
    its heap's choice: so it is asked for more places until the k-th score is strictly above
    the last one returned (or the whole gallery is returned), and the answer is sorted."""

    def __init__(self, dim: int):
        import faiss  # only this engine needs it
        self.dim = dim
        self.index = faiss.IndexFlatIP(dim)

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    def add(self, x: np.ndarray) -> None:
        self.index.add(np.ascontiguousarray(_check_rows(x, self.dim, "add"), dtype=np.float32))

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        q = np.ascontiguousarray(_check_rows(x, self.dim, "search"), dtype=np.float32)
        out_s = np.full((len(q), k), -np.inf, np.float32)
        out_i = np.full((len(q), k), -1, np.int64)
        kk = min(k, self.ntotal)
        if kk == 0 or len(q) == 0:
            return out_s, out_i
        pending, fetch = np.arange(len(q)), min(self.ntotal, max(2 * kk, kk + 8))
        while len(pending):
            s, i = self.index.search(q[pending], fetch)
            settled = (s[:, kk - 1] > s[:, -1]) | (fetch == self.ntotal)
            rows = pending[settled]
            top_s, top_i = _order(torch.from_numpy(s[settled]), torch.from_numpy(i[settled]), kk)
            out_s[rows, :kk], out_i[rows, :kk] = top_s.numpy(), top_i.numpy()
            pending, fetch = pending[~settled], min(self.ntotal, 2 * fetch)
        return out_s, out_i


def make_index(dim: int, engine: str = "exact", fp16: bool = False) -> Index:
    """An empty index of `engine` ("exact": ours, "faiss": IndexFlatIP) for `dim`-D vectors."""
    if engine == "exact":
        return ExactIndex(dim, torch.float16 if fp16 else torch.float32)
    if engine == "faiss":
        if fp16:
            raise ValueError("fp16 storage is an option of the exact engine, not of faiss's IndexFlatIP")
        return FaissIndex(dim)
    raise ValueError(f"unknown search engine {engine!r}; choose one of {', '.join(ENGINES)}")
