"""Exact inner-product search over a gallery: one small interface, as faiss's `Index`, over two
engines that give the same answer, and "auto", which picks the faster of them for the search.

    index = make_index(dim, "auto", size=N, queries=Q)   # or engine "exact" / "faiss"
    index.add(gallery)                        # N x D float rows, ids 0 .. N-1 in order added
    scores, ids = index.search(queries, k)    # Q x min(k, N) float32 scores, int64 ids

Rows come back best first, equal scores by the lower id, in both engines: a result never depends
on the engine, the block sizes or the thread count. k is clamped to the gallery's size before
anything is allocated, so `--top 1000000000` gives N columns, not Q x k places of nothing (faiss
would allocate them, padded with score -inf and id -1). Neither engine is the faster everywhere:
`pick_engine` reads the table `FASTER` (benchmarks/runs/search_grid.md)."""

from __future__ import annotations

import numpy as np
import torch

ENGINES = ("auto", "exact", "faiss")

# The faster engine per (N, Q) as `benchmarks/search.py --grid` measured it (N random unit 512-D vectors, Q
# queries at once, top 10; the run, its machine and date: benchmarks/runs/search_grid.md), for (1 thread,
# float32), (all threads, float32), (1 thread, float16), (all threads, float16).
FASTER = {
    (10_000, 1): ("faiss", "faiss", "faiss", "faiss"),
    (10_000, 10): ("exact", "exact", "faiss", "faiss"),
    (10_000, 100): ("exact", "exact", "exact", "exact"),
    (10_000, 1000): ("faiss", "faiss", "exact", "exact"),
    (100_000, 1): ("faiss", "faiss", "faiss", "faiss"),
    (100_000, 10): ("exact", "exact", "exact", "exact"),
    (100_000, 100): ("exact", "exact", "exact", "exact"),
    (100_000, 1000): ("faiss", "faiss", "exact", "exact"),
    (1_000_000, 1): ("faiss", "faiss", "faiss", "faiss"),
    (1_000_000, 10): ("exact", "exact", "exact", "faiss"),
    (1_000_000, 100): ("exact", "exact", "exact", "exact"),
    (1_000_000, 1000): ("faiss", "faiss", "exact", "exact"),
}


def _check_rows(x: np.ndarray, dim: int, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2 or x.shape[1] != dim:
        raise ValueError(f"{what}: expected N x {dim} vectors, got shape {x.shape}")
    return x


def _clamped(k: int, ntotal: int) -> int:
    """The places a search fills: k (at least 1) clamped to the gallery's size, before any allocation."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    return min(k, ntotal)


def _order(scores: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k of each row by (score descending, id ascending): two stable sorts."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    by_score = torch.argsort(scores, dim=1, descending=True, stable=True)[:, :k]
    return scores.gather(1, by_score), ids.gather(1, by_score)


def _block_top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best columns of each row of a Q x B score block, a tie at the k-th place going to the lower
    column (`_order` orders the k). torch.topk breaks ties arbitrarily, so it is asked for k + 1: a row
    whose k-th and (k+1)-th scores are equal (rare) is sorted stably instead, with no second pass."""
    if k >= scores.shape[1]:
        return scores, torch.arange(scores.shape[1], device=scores.device).expand(len(scores), -1)
    values, cols = torch.topk(scores, k + 1, dim=1)
    crowded = values[:, k - 1] == values[:, k]
    if bool(crowded.any()):
        rows = crowded.nonzero().squeeze(1)
        cols[rows] = torch.argsort(scores[rows], dim=1, descending=True, stable=True)[:, : k + 1]
        values[rows] = scores[rows].gather(1, cols[rows])
    return values[:, :k], cols[:, :k]


class ExactIndex:
    """Blocked exact search in torch on `device` (the CPU by default; a GPU where faiss-gpu is absent: the
    same code, the same answer), the gallery kept in blocks of float32 or float16 (half the memory; scores
    accumulate in float32). A search reads each gallery block once (float16 made float32 in one reused
    buffer) and scores it against one block of queries at a time, each query keeping a running top k, so
    memory beyond the gallery is the two block sizes, never Q x N. Scores are computed as B x Q (the faster
    product: benchmarks/README.md, '1:N search'), laid out as Q x B for torch.topk along contiguous rows,
    in two reused tiles (a fresh one of several MB per block would cost its page faults every time)."""

    def __init__(
        self,
        dim: int,
        dtype: torch.dtype = torch.float32,
        gallery_block: int = 8192,
        query_block: int = 512,
        device: torch.device | str = "cpu",
    ):
        self.dim, self.dtype, self.device = dim, dtype, torch.device(device)
        self.gallery_block, self.query_block = gallery_block, query_block
        self.blocks: list[torch.Tensor] = []

    @property
    def ntotal(self) -> int:
        return sum(len(b) for b in self.blocks)

    def add(self, x: np.ndarray) -> None:
        x = torch.as_tensor(_check_rows(x, self.dim, "add")).to(self.device)
        if self.blocks and len(self.blocks[-1]) < self.gallery_block:  # fill the last block first
            room = self.gallery_block - len(self.blocks[-1])
            self.blocks[-1] = torch.cat([self.blocks[-1], x[:room].to(self.dtype)])
            x = x[room:]
        self.blocks += [piece.to(self.dtype).clone() for piece in x.split(self.gallery_block) if len(piece)]

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = _clamped(k, self.ntotal)
        on = {"device": self.device}
        q_all = (
            torch.as_tensor(_check_rows(x, self.dim, "search"), dtype=torch.float32)
            .to(self.device)
            .contiguous()
        )
        best_s = torch.full((len(q_all), k), -torch.inf, **on)
        best_i = torch.full((len(q_all), k), -1, dtype=torch.int64, **on)
        if not len(q_all) or not self.blocks:
            return best_s.cpu().numpy(), best_i.cpu().numpy()
        rows = len(self.blocks[0])  # every block but the last is full
        tile = min(self.query_block, len(q_all)) * rows
        by_gallery, by_query = torch.empty(tile, **on), torch.empty(tile, **on)
        as_float = torch.empty(rows, self.dim, **on) if self.dtype != torch.float32 else None
        offset = 0
        for block in self.blocks:
            g = block if as_float is None else as_float[: len(block)].copy_(block)
            for qs in range(0, len(q_all), self.query_block):
                q = q_all[qs : qs + self.query_block]
                n = len(g) * len(q)
                scores = torch.mm(g, q.T, out=by_gallery[:n].view(len(g), len(q)))
                scores = by_query[:n].view(len(q), len(g)).copy_(scores.T)
                s, cols = _block_top(scores, k)
                mine = slice(qs, qs + len(q))
                best_s[mine], best_i[mine] = _order(
                    torch.cat([best_s[mine], s], 1), torch.cat([best_i[mine], cols + offset], 1), k
                )
            offset += len(block)
        return best_s.cpu().numpy(), best_i.cpu().numpy()


class FaissIndex:
    """faiss-cpu's exact IndexFlatIP (`fp16`: IndexScalarQuantizer QT_fp16, float16 storage scored in float32).
    Which of equal scores at the k-th place faiss keeps is its heap's choice, so it is asked for more places
    until the k-th score is above the last returned (or all are), and the answer sorted, ties by the lower id."""

    def __init__(self, dim: int, fp16: bool = False):
        import faiss  # only this engine needs it

        self.dim = dim
        self.index = (
            faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
            if fp16
            else faiss.IndexFlatIP(dim)
        )

    @property
    def ntotal(self) -> int:
        return self.index.ntotal

    def add(self, x: np.ndarray) -> None:
        self.index.add(np.ascontiguousarray(_check_rows(x, self.dim, "add"), dtype=np.float32))

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        kk = _clamped(k, self.ntotal)
        q = np.ascontiguousarray(_check_rows(x, self.dim, "search"), dtype=np.float32)
        out_s = np.full((len(q), kk), -np.inf, np.float32)
        out_i = np.full((len(q), kk), -1, np.int64)
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


def _nearest(value: int, measured) -> int:
    """The measured point nearest to `value` on a log scale (sizes and counts grow by factors)."""
    return min(measured, key=lambda m: (abs(np.log(max(value, 1) / m)), m))


def pick_engine(size: int, queries: int, threads: int, fp16: bool = False) -> str:
    """FASTER's engine at the point nearest `size` gallery rows and `queries` queries, on `threads` (1, or 'all')."""
    n = _nearest(size, {n for n, _ in FASTER})
    q = _nearest(queries, {q for m, q in FASTER if m == n})
    return FASTER[n, q][(threads > 1) + 2 * fp16]


def make_index(
    dim: int,
    engine: str = "exact",
    fp16: bool = False,
    size: int | None = None,
    queries: int | None = None,
    device: torch.device | str = "cpu",
) -> ExactIndex | FaissIndex:
    """An empty index of `engine` for `dim`-D vectors: "exact" (ours), "faiss" (IndexFlatIP) or "auto", the
    faster by `pick_engine` for a gallery of `size` rows, `queries` queries at once and torch's thread count;
    on a GPU `device` (the model's) auto is ours there, as faiss-cpu cannot search on it."""
    device = torch.device(device)
    if engine == "auto":
        if size is None or queries is None:
            raise ValueError(
                "engine auto picks by the gallery's size and the number of queries: give size and queries"
            )
        engine = (
            "exact" if device.type == "cuda" else pick_engine(size, queries, torch.get_num_threads(), fp16)
        )
    if engine == "exact":
        return ExactIndex(dim, torch.float16 if fp16 else torch.float32, device=device)
    if engine == "faiss":
        return FaissIndex(dim, fp16)
    raise ValueError(f"unknown search engine {engine!r}; choose one of {', '.join(ENGINES)}")
