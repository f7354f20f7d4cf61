"""The head's step makes no pass over its C x D weight shard beyond the GEMMs and what the
arithmetic needs: the rows' norms once, and the normalisation's radial correction once, in
each tile's dW step (or the fused optimizer's row step). On a GPU each extra pass moves the
shard's bytes through memory once more (2 GB at 1M classes, D = 512, fp32): this test fails if
one is added back (tests/shard_passes.py counts them, by op, in units of the shard).

The correction's coefficient sum_i dcos_ij cos_ij comes from the tile where that moves fewer
bytes: its product and column sum move 4 x rows x K values, the rows' dot products <g_j, w_j>
2 x K x D, so the tile where the batch is one block of at most D / 2 rows, the dot products
(a mul and a sum over the shard) beyond that."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.losses import AdaFace, ArcFace, CosFace, CurricularFace, SubCenterArcFace
from tests.shard_passes import ShardPassCounter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# D, the tile rows (16, and 12 for the last of 60 classes; a sample of 30: 16, 14) and the
# batch's row counts (batches and row blocks) are all different, so the counter cannot take
# one for another
C, D, TILE, ROW_BLOCK = 60, 24, 16, 5
NORM_AND_CORRECTION = {
    "linalg_vector_norm": 1.0,  # the rows' norms, once per step
    "addcmul_": 1.0,
}  # g_j -= r_j inv_j^2 w_j, each tile right after its dW GEMM
ROW_DOTS = {"mul": 1.0, "sum": 1.0}  # <g_j, w_j> over the complete gradient rows, once
MARGINS = {
    "arcface": lambda: ArcFace(s=16.0, margin=0.5),
    "cosface": lambda: CosFace(s=16.0, m=0.35),
    "adaface": lambda: AdaFace(s=16.0),
    "curricularface": lambda: CurricularFace(s=16.0, m=0.5),
    "subcenter": lambda: SubCenterArcFace(s=16.0, margin=0.5, k=3),
}


def _step_passes(
    margin="arcface",
    batch=10,
    sample_rate=1.0,
    fused=False,
    precision="fp32",
    optimizer=torch.optim.SGD,
    **opt_args,
):
    """Shard passes of the third forward+backward (the optimizer's state exists by then), in
    units of the whole shard's C x k x D values; GEMM passes summed."""
    torch.manual_seed(0)
    m = MARGINS[margin]()
    k = m.subcenters
    head = PartialFC(
        m,
        D,
        C,
        sample_rate=sample_rate,
        chunk_size=TILE,
        row_block=ROW_BLOCK,
        validate=False,
        fused_optimizer=fused,
        precision=precision,
    )
    opt = SampledRowsOptimizer(head, optimizer, lr=0.1, **(opt_args or dict(momentum=0.9, weight_decay=1e-3)))
    emb = torch.randn(batch, D, requires_grad=True)
    labels = torch.randint(0, C, (batch,))
    for _ in range(2):
        head(emb, labels).backward()
        opt.step()
        opt.zero_grad()
    used = head.num_sample if sample_rate < 1 else C
    weight_rows = {C * k, used * k} | {min(TILE, used - c0) * k for c0 in range(0, used, TILE)}
    batch_rows = {batch, batch * k, min(batch, D), ROW_BLOCK, (batch - min(batch, D)) % ROW_BLOCK}
    assert not weight_rows & batch_rows and D not in weight_rows, "sizes the counter could confuse"
    with ShardPassCounter(D, weight_rows, C * k) as count:
        head(emb, labels).backward()
    return count.gemm_passes(), count.other_passes()


@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_unfused_step_passes_over_the_shard_in_its_three_gemms_its_norms_and_one_correction(margin):
    """Everything else works on tiles of rows x K: with 2 x 6 rows <= D the radial term comes
    from the tile (exp(logit) margins keep their logits beside it in the gradient's buffer), and
    the incoming gradient (1 here, or a loss scale) goes into the row scale of the gradient,
    formed in backward."""
    gemms, other = _step_passes(margin, batch=6)
    assert gemms == 3.0  # logits (reads W), dE (reads W), dW (writes the gradient)
    assert other == NORM_AND_CORRECTION


@pytest.mark.parametrize("margin", sorted(MARGINS))
def test_batches_over_half_of_d_take_the_radial_term_from_the_rows_dot_products(margin):
    gemms, other = _step_passes(margin, batch=20)  # 2 x 20 > D = 24: one block, no room for logits
    assert gemms == 3.0
    assert other == {**NORM_AND_CORRECTION, **ROW_DOTS}


def test_bf16_logits_add_one_cast_of_the_weight():
    gemms, other = _step_passes(precision="bf16")
    assert gemms == 3.0
    assert other == {**NORM_AND_CORRECTION, "_to_copy": 1.0}  # the logits GEMM's bf16 operand


def test_rows_beyond_the_first_block_add_the_incoming_gradients_scale_of_the_earlier_sum():
    """B > D: the first D rows and the row blocks after them form their gradients in forward at
    scale 1; the last block's dW step scales their sum by the incoming gradient, tile by tile.
    Each block's GEMMs read the shard again (that is what a block costs)."""
    batch = 40  # blocks of 24, 5, 5, 5, 1 rows
    gemms, other = _step_passes(batch=batch)
    assert gemms == 3.0 * 5
    assert other == {**NORM_AND_CORRECTION, **ROW_DOTS, "mul_": 1.0}


@pytest.mark.parametrize("decay", [1e-3, 0.0])
@pytest.mark.parametrize("batch", [10, 20])
def test_fused_optimizer_folds_the_correction_into_its_sgd_step(decay, batch):
    """Fused: a fourth GEMM (the logits again, in backward), no weight gradient. The correction
    and SGD's L2 weight decay are one addcmul_ on the tile's gradient; the rest is SGD's own
    momentum update (mul_, add_) and the weight's (add_). The radial term from the tile (its
    logits in a second tile) at 2 x 10 <= D, from the rows' dot products at 2 x 20 > D."""
    gemms, other = _step_passes(fused=True, batch=batch, momentum=0.9, weight_decay=decay)
    assert gemms == 4.0
    assert other == {**NORM_AND_CORRECTION, "mul_": 1.0, "add_": 2.0, **(ROW_DOTS if 2 * batch > D else {})}


def test_fused_adamw_adds_only_its_own_update():
    """AdamW's weight decay is decoupled (it scales the weight), so the correction stays its own
    addcmul_; every other pass is AdamW's update (moments, bias correction, step)."""
    gemms, other = _step_passes(fused=True, optimizer=torch.optim.AdamW, weight_decay=0.01)
    adamw = {
        "lerp_": 1.0,
        "mul_": 2.0,
        "addcmul_": 1.0,
        "sqrt": 1.0,
        "div": 1.0,
        "add_": 1.0,
        "addcdiv_": 1.0,
    }
    assert gemms == 4.0
    assert other == {"linalg_vector_norm": 1.0, **adamw, "addcmul_": 2.0}


@pytest.mark.parametrize("batch,blocks", [(4, 1), (12, 3)])
def test_partial_fc_touches_the_sampled_rows_and_zeroes_the_rest(batch, blocks):
    """Sampling half the classes: the dense gradient's exact zeros (one write of the shard), the
    sampled rows gathered for each GEMM pass (statistics and gradient, per row block), their
    norms once, their gradient written once (index_copy_); earlier blocks add theirs
    (index_add_), which the last block gathers back to scale by the incoming gradient. The
    block buffer holds no logits: the radial term from the sampled rows' dot products."""
    gemms, other = _step_passes(batch=batch, sample_rate=0.5)
    half = 0.5
    assert gemms == 3.0 * half * blocks
    expected = {
        "zeros": 1.0,
        "index": 2 * half * blocks,
        "linalg_vector_norm": half,
        "addcmul_": half,
        "index_copy_": half,
        "mul": half,
        "sum": half,
    }
    if blocks > 1:
        expected.update(
            {"index": 2 * half * blocks + half, "index_add_": half * (blocks - 1), "addcmul_": 2 * half}
        )
    assert other == pytest.approx(expected)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile's CPU kernels need a C++ compiler")
def test_fusion_benchmark_times_both_sides():
    """benchmarks/head_fusion.py (the tile passes eager and compiled) runs: one round's row."""
    done = subprocess.run(
        [sys.executable, "benchmarks/head_fusion.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rounds = re.findall(r"\n\s+1\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\n", done.stdout)
    assert len(rounds) == 1 and all(float(v) > 0 for v in rounds[0]), done.stdout
