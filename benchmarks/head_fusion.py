#!/usr/bin/env python
"""Would a fused kernel make the head's elementwise tile work cheaper? (issue 37)

Beside its three GEMMs, the head's exp path spends its time on a few passes over each tile of
B x chunk cosines: the logits (s cos) and their exponentials with the row sums in forward;
d loss / d cos (the row scale), the radial column sums and the column scale in backward. This
times those passes as the head runs them (eager PyTorch ops into kept buffers) against the same
arithmetic compiled by torch.compile (inductor: one generated C++ kernel a pass), stepped in
turn in one process, one thread; and each op alone, to show what sets the pace.

Defaults are one rank of benchmarks/head.py's side-by-side run (W = 2 x b = 128 rows, 50,000
classes a rank, chunk_size 2048). Needs a C++ compiler for the compiled side.
Run from the repository root: `.venv/bin/python benchmarks/head_fusion.py [--chunk 32768]`.
`--smoke` shrinks the classes 50-fold (figures mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch
from common import table


def _eager_forward(raw, inv_s, logits):
    torch.mul(raw, inv_s, out=logits)
    torch.exp(logits, out=raw)
    return raw.sum(1)


def _eager_backward(x, logits, row_scale, inv, dcos):
    torch.mul(x, row_scale, out=dcos)
    radial = logits.mul_(dcos).sum(0)
    dcos.mul_(inv)
    return radial


def _fused_forward(raw, inv_s):
    logits = raw * inv_s
    x = torch.exp(logits)
    return logits, x, x.sum(1)


def _fused_backward(x, logits, row_scale, inv):
    dcos = x * row_scale
    return dcos * inv, (logits * dcos).sum(0)


def _median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--classes", type=int, default=50000, help="one rank's shard")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.classes, a.steps, a.rounds = a.classes // 50, 2, 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, C = a.rows, a.classes
    tiles = [(c, min(c + a.chunk, C)) for c in range(0, C, a.chunk)]
    cos = torch.rand(b, C) * 2 - 1
    inv = torch.rand(C) + 0.5
    inv_s = inv * 64.0
    row_scale = torch.rand(b, 1) * 1e-3
    raw, logits, dcos = torch.empty(b, C), torch.empty(b, C), torch.empty(b, C)
    fwd, bwd = torch.compile(_fused_forward, dynamic=False), torch.compile(_fused_backward, dynamic=False)

    def eager():
        raw.copy_(cos)  # stands for the logits GEMM's output (also in the fused step)
        for c0, c1 in tiles:
            _eager_forward(raw[:, c0:c1], inv_s[c0:c1], logits[:, c0:c1])
        for c0, c1 in tiles:
            _eager_backward(raw[:, c0:c1], logits[:, c0:c1], row_scale, inv[c0:c1], dcos[:, c0:c1])

    def fused():
        raw.copy_(cos)
        kept = [fwd(raw[:, c0:c1], inv_s[c0:c1]) for c0, c1 in tiles]
        for (c0, c1), (lg, x, _) in zip(tiles, kept):
            bwd(x, lg, row_scale, inv[c0:c1])

    t = time.perf_counter()
    fused()  # compiles (once a tile width)
    print(
        f"compiled in {time.perf_counter() - t:.1f} s; {b} x {C}, {len(tiles)} tiles of {a.chunk}, one thread"
    )
    rows = []
    for r in range(a.rounds):
        eager(), fused()
        e, f = _median_ms(eager, a.steps), _median_ms(fused, a.steps)
        rows.append(
            {
                "round": r + 1,
                "eager ms": f"{e:.1f}",
                "compiled ms": f"{f:.1f}",
                "compiled/eager": f"{f / e:.2f}",
            }
        )
    print(table(rows, ["round", "eager ms", "compiled ms", "compiled/eager"]))
    x, y = cos.clone(), torch.empty_like(cos)
    ops = {
        "copy (the GEMM's stand-in)": lambda: y.copy_(x),
        "exp": lambda: torch.exp(x, out=y),
        "mul by a column": lambda: torch.mul(x, inv, out=y),
        "sum(0)": lambda: x.sum(0),
        "sum(1)": lambda: x.sum(1),
    }
    print(
        table(
            [{"op over B x C": k, "ms": f"{_median_ms(fn, a.steps):.1f}"} for k, fn in ops.items()],
            ["op over B x C", "ms"],
        )
    )


if __name__ == "__main__":
    main()
