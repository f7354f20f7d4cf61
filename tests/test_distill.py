"""Distillation (issue #29): the losses against formulas written here, W ranks = one process,
the teacher's start checks, and training with a teacher (exact resume, teacher files)."""

import math

import pytest
import torch
import torch.distributed as dist

from shardface.distill.head import DistillLoss
from shardface.distill.losses import cosine_distill, relational_distill
from shardface.heads import PartialFC
from shardface.losses import CosFace
from tests.distributed import run_distributed


def _cos(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_cosine_loss_is_mean_of_one_minus_cosine():
    g = torch.Generator().manual_seed(0)
    s, t = (
        torch.randn(5, 6, generator=g, dtype=torch.float64),
        torch.randn(5, 6, generator=g, dtype=torch.float64),
    )
    expected = sum(1 - _cos(s[i].tolist(), t[i].tolist()) for i in range(5)) / 5
    assert abs(cosine_distill(s, t).item() - expected) < 1e-6


def test_relational_loss_compares_cosine_matrices_of_different_sizes():
    g = torch.Generator().manual_seed(1)
    s, t = torch.randn(6, 4, generator=g), torch.randn(6, 9, generator=g)  # no projection needed
    rows = [1, 2]
    expected = sum(
        (_cos(s[i].tolist(), s[j].tolist()) - _cos(t[i].tolist(), t[j].tolist())) ** 2
        for i in rows
        for j in range(6)
    ) / (len(rows) * 6)
    assert abs(relational_distill(s[rows], s, t[rows], t).item() - expected) < 1e-6
    assert relational_distill(s, s, s * 3.0, s).item() < 1e-10  # scale-free


B, D, DT, C = 8, 6, 5, 11  # global batch, student dims, teacher dims, classes (11 % 2 != 0)


def _problem():
    g = torch.Generator().manual_seed(7)
    return dict(
        x=torch.randn(B, 10, generator=g),
        labels=torch.randint(0, C, (B,), generator=g),
        teacher=torch.randn(B, DT, generator=g),
        net=torch.randn(D, 10, generator=g) * 0.3,
        proj=torch.randn(DT, D, generator=g) * 0.4,
    )


def _step(rank, world_size, kind, with_head):
    """One rank's loss and, after the backbone optimizer's averaging, its gradients."""
    p = _problem()
    b = B // world_size
    mine = slice(rank * b, (rank + 1) * b)
    net = torch.nn.Linear(10, D, bias=False)
    proj = torch.nn.Linear(D, DT, bias=False)
    with torch.no_grad():
        net.weight.copy_(p["net"])
        proj.weight.copy_(p["proj"])
    torch.manual_seed(3)  # the head's initial rows: the same at any world size
    head = PartialFC(CosFace(s=16.0, m=0.2), D, C) if with_head else None
    loss = DistillLoss(kind, 0.7, proj if kind == "cosine" else None)(
        head, net(p["x"][mine]), p["labels"][mine], p["teacher"][mine]
    )
    loss.backward()
    replicated = [net.weight.grad] + ([proj.weight.grad] if kind == "cosine" else [])
    if world_size > 1:  # what ZeRO-2 / DDP do to replicated parameters' gradients
        for grad in replicated:
            dist.all_reduce(grad)
            grad.div_(world_size)
    return loss.detach(), [g.clone() for g in replicated], head.weight.grad.clone() if head else None


CASES = [(kind, with_head) for kind in ("cosine", "relational") for with_head in (True, False)]


def _label_free_probe(rank):
    """Whether this rank refuses a label-free save whose embeddings overflow on rank 1 alone
    (utils.divergence.check_weights with no head)."""
    from shardface.utils.divergence import TrainingStopped, check_weights

    net = torch.nn.Linear(3, 2)
    with torch.no_grad():
        net.weight.fill_(2e38)  # finite; three of them summed are not
    try:
        check_weights(1, net, None, (torch.ones(2, 3) if rank == 1 else torch.zeros(2, 3), torch.zeros(2)))
    except TrainingStopped:
        return True
    except Exception as exc:  # reported by the test below, not by the fixture both tests share
        return f"{type(exc).__name__}: {exc}"
    return False


def _steps(rank, world_size):
    return [_step(rank, world_size, *case) for case in CASES], _label_free_probe(rank)


@pytest.fixture(scope="module")
def two_ranks():
    """One spawn for every case of the tests below."""
    return run_distributed(_steps, 2)


def test_two_ranks_equal_one_process_with_the_global_batch(two_ranks):
    """Values and gradients (backbone, projection, head rows), both losses, with a margin head
    and label-free (no head); the W=1 reference runs in this process."""
    two = [steps for steps, _ in two_ranks]
    for i, case in enumerate(CASES):
        one = _step(0, 1, *case)
        # every rank's loss is its rows' estimate; their mean is the global batch's loss
        torch.testing.assert_close(sum(r[i][0] for r in two) / 2, one[0], rtol=1e-6, atol=1e-6, msg=str(case))
        for rank in two:
            for got, want in zip(rank[i][1], one[1]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=str(case))
        if case[1]:
            torch.testing.assert_close(
                torch.cat([r[i][2] for r in two]), one[2], rtol=1e-5, atol=1e-6, msg=str(case)
            )


def test_label_free_ranks_refuse_a_save_together(two_ranks):
    """With no head the save's probe is every rank's embeddings, agreed by an all-reduce: a rank
    whose batch overflows stops the others too (else they would wait in the save for it)."""
    assert [refused for _, refused in two_ranks] == [True, True]
