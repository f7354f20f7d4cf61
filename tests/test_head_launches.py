"""On a GPU the head's step is launch-bound (benchmarks/runs/gpu.md): its time follows the
kernels the host launches, not only the bytes they move. This test counts a step's kernels (the
dispatched ops that are not views) on the meta device, which takes the choices of a GPU (any
device but the CPU does) and computes nothing, at the shapes of one rank of an 8-GPU job (the
global batch 8 x 128, D = 512). A tile must cost a fixed number of kernels, whatever its rows
(no loop over slices of a tile's rows, as the CPU's cache-sized row dot products are), and no
more than today's: each `(block, tile)` visit forms its targets with one comparison and puts
them with three kernels."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.losses import ArcFace

B, D = 1024, 512

# kernels per tile of ArcFace's step (SGD with momentum), measured when this test was written
# (before: 78, 58, 88, 35): two row blocks (B > D); fused optimizer (the batch in one block);
# Partial FC at 0.5; one row block (B = 128)
PER_TILE = {"two blocks": 41, "fused": 31, "sampled": 53, "one block": 22}
CASES = {
    "two blocks": {},
    "fused": {"fused_optimizer": True},
    "sampled": {"sample_rate": 0.5},
    "one block": {"batch": 128},
}


class _Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _step_kernels(classes: int, tile: int, batch: int = B, **head_args) -> tuple[int, int]:
    """(kernels of the third step (forward, backward, optimizer step), its tiles)."""
    torch.manual_seed(0)
    head = PartialFC(
        ArcFace(s=64.0, margin=0.5), D, classes, chunk_size=tile, row_block=512, validate=False, **head_args
    ).to("meta")
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9)
    emb = torch.randn(batch, D, device="meta", requires_grad=True)
    labels = torch.randint(0, classes, (batch,), device="meta")

    def step():
        head(emb, labels).backward()
        opt.step()
        opt.zero_grad()

    step()
    step()  # the optimizer's state exists by now
    with _Kernels() as kernels:
        step()
    used = head.num_sample if head_args.get("sample_rate", 1.0) < 1 else classes
    return kernels.count, -(-used // tile)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tile_costs_a_fixed_number_of_kernels_whatever_its_rows(case):
    args = dict(CASES[case])
    per_tile = {}
    for tile in (2048, 8192):  # 8192 rows x 512: one 4M-value slice of the row dot products
        (more, more_tiles), (fewer, fewer_tiles) = (_step_kernels(n * tile, tile, **args) for n in (4, 2))
        per_tile[tile] = (more - fewer) / (more_tiles - fewer_tiles)
    assert per_tile[2048] == per_tile[8192], per_tile
    assert per_tile[8192] <= PER_TILE[case], f"{per_tile[8192]} kernels a tile, more than {PER_TILE[case]}"
