"""AdaFace, MagFace, CurricularFace and sub-center ArcFace, class-sharded and chunked, equal
their papers' single-process formulations (tests/margin_references.py)."""

import copy
import os

import pytest
import torch

from shardface.heads import PartialFC, class_shard
from shardface.losses import AdaFace, ArcFace, CombinedMarginLoss, CurricularFace, MagFace, SubCenterArcFace
from tests import margin_references as ref
from tests.distributed import run_distributed

C, D, B_LOCAL, STEPS, S = 13, 8, 4, 3, 16.0
HEADS = {
    "adaface": (lambda: AdaFace(s=S, m=0.4, h=0.333, t_alpha=0.01), ref.adaface_loss, dict(s=S)),
    "magface": (lambda: MagFace(s=S), ref.magface_loss, dict(s=S)),
    "magface_hard": (lambda: MagFace(s=S, easy_margin=False), ref.magface_loss, dict(s=S, easy_margin=False)),
    "curricularface": (lambda: CurricularFace(s=S, m=0.5), ref.curricularface_loss, dict(s=S)),
    "subcenter_arcface": (
        lambda: SubCenterArcFace(s=S, margin=0.5, k=3),
        ref.subcenter_arcface_loss,
        dict(s=S, k=3),
    ),
}
# (classes per tile, rows per block, sample_rate): unchunked, chunked with several blocks, Partial FC
LAYOUTS = [(None, 128, 1.0), (4, 3, 1.0), (4, 5, 0.5)]


def _data(world_size, step):
    g = torch.Generator().manual_seed(10 + step)
    n = world_size * B_LOCAL
    emb = (
        torch.randn(n, D, generator=g)
        * torch.linspace(3.0, 130.0, n)[torch.randperm(n, generator=g)][:, None]
        / 3
    )
    labels = torch.randint(0, C, (n,), generator=g)
    labels[:2] = torch.tensor([0, C - 1])
    return emb, labels


def _weight(k):
    return torch.randn(C * k, D, generator=torch.Generator().manual_seed(9))


def _worker(rank, world_size):
    torch.manual_seed(50 + rank)
    shard = class_shard(C, world_size, rank)
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    out = {}
    for name, (make, _, _) in HEADS.items():
        for chunk, row_block, rate in LAYOUTS:
            margin = make()
            k = margin.subcenters
            head = PartialFC(margin, D, C, sample_rate=rate, chunk_size=chunk, row_block=row_block)
            with torch.no_grad():
                head.weight.copy_(_weight(k)[shard.start * k : shard.end * k])
            steps = []
            for step in range(STEPS):
                emb, labels = _data(world_size, step)
                local = emb[rows].clone().requires_grad_(True)
                head.weight.grad = None
                loss = head(local, labels[rows])
                loss.backward()
                index = head.sampled.index()
                head.sampled.clear()
                classes = None if index is None else index[::k] // k + shard.start
                steps.append((loss.detach(), head.weight.grad.clone(), local.grad.clone(), classes))
            out[(name, chunk, rate)] = (steps, copy.deepcopy(dict(margin.named_buffers())))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_margin_heads_match_their_papers_sharded_chunked_and_sampled(world_size):
    results = run_distributed(_worker, world_size, timeout=300)
    for name, (make, reference, kw) in HEADS.items():
        k = make().subcenters
        for chunk, _, rate in LAYOUTS:
            state = copy.deepcopy(ref.INITIAL_STATE[name.replace("_hard", "")])
            for step in range(STEPS):
                emb, labels = _data(world_size, step)
                parts = [r[(name, chunk, rate)][0][step] for r in results]
                classes = None if parts[0][3] is None else torch.cat([p[3] for p in parts])
                w = _weight(k).requires_grad_(True)
                e = emb.clone().requires_grad_(True)
                loss, state = reference(e, w, labels, state, classes=classes, **kw)
                loss.backward()
                where = f"{name} chunk={chunk} rate={rate} step={step}"
                for p in parts:
                    torch.testing.assert_close(p[0], loss.detach(), rtol=1e-5, atol=1e-5, msg=where)
                dw = torch.cat([p[1] for p in parts])
                torch.testing.assert_close(
                    dw, w.grad, rtol=1e-5, atol=1e-5 * w.grad.abs().max().item(), msg=where
                )
                de = torch.cat([p[2] for p in parts]) / world_size
                torch.testing.assert_close(
                    de, e.grad, rtol=1e-5, atol=1e-5 * e.grad.abs().max().item(), msg=where
                )
            buffers = results[0][(name, chunk, rate)][1]
            for key, value in state.items():  # running statistics, identical on every rank
                own = {"mean": "batch_mean", "std": "batch_std", "t": "t"}[key]
                for r in results:
                    torch.testing.assert_close(
                        r[(name, chunk, rate)][1][own], value.float(), msg=f"{name} {key}"
                    )
            del buffers


def _reference_logits_loss(margin, emb, weight, labels):
    w = weight.clone().requires_grad_(True)
    e = emb.clone().requires_grad_(True)
    cos = torch.nn.functional.normalize(e) @ torch.nn.functional.normalize(w).t()
    loss = torch.nn.functional.cross_entropy(margin(cos, labels, e.norm(dim=1)), labels)
    reg = margin.regularizer(e.norm(dim=1))
    if reg is not None:
        loss = loss + reg
    loss.backward()
    return loss.detach(), w.grad, e.grad


def test_subcenter_arcface_with_one_centre_is_arcface():
    torch.manual_seed(1)
    emb, labels, weight = torch.randn(6, D), torch.randint(0, C, (6,)), torch.randn(C, D)
    results = []
    for margin in (SubCenterArcFace(s=S, margin=0.5, k=1), ArcFace(s=S, margin=0.5)):
        head = PartialFC(margin, D, C, chunk_size=4, row_block=4)
        with torch.no_grad():
            head.weight.copy_(weight)
        e = emb.clone().requires_grad_(True)
        loss = head(e, labels)
        loss.backward()
        results.append((loss.detach(), head.weight.grad, e.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_magface_with_a_fixed_margin_and_no_regulariser_is_arcface():
    torch.manual_seed(2)
    emb, labels, weight = torch.randn(6, D) * 20, torch.randint(0, C, (6,)), torch.randn(C, D)
    mag = MagFace(s=S, l_m=0.5, u_m=0.5, lambda_g=0.0, easy_margin=False)
    a = _reference_logits_loss(mag, emb, weight, labels)
    b = _reference_logits_loss(ArcFace(s=S, margin=0.5), emb, weight, labels)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_straight_through_keeps_the_loss_and_takes_the_margin_derivative_as_one():
    torch.manual_seed(3)
    cos = (torch.rand(5) * 1.8 - 0.9).requires_grad_(True)
    exact, straight = (
        CombinedMarginLoss(S, 1.0, 0.5, 0.0),
        CombinedMarginLoss(S, 1.0, 0.5, 0.0, straight_through=True),
    )
    torch.testing.assert_close(straight.target_logit(cos), exact.target_logit(cos))
    (g,) = torch.autograd.grad(straight.target_logit(cos).sum(), cos)
    torch.testing.assert_close(g, torch.full_like(g, S))
    (g_exact,) = torch.autograd.grad(exact.target_logit(cos).sum(), cos)
    assert not torch.allclose(g_exact, g)


def test_running_statistics_survive_state_dict_and_eval_does_not_move_them():
    ada, cur = AdaFace(s=S), CurricularFace(s=S)
    ada.begin_step(torch.rand(8), torch.rand(8) * 50)
    cur.begin_step(torch.rand(8), torch.ones(8))
    ada2, cur2 = AdaFace(s=S), CurricularFace(s=S)
    ada2.load_state_dict(ada.state_dict())
    cur2.load_state_dict(cur.state_dict())
    assert float(ada2.batch_mean) == float(ada.batch_mean) != 20.0
    assert float(cur2.t) == float(cur.t) != 0.0
    cur2.eval()
    before = float(cur2.t)
    cur2.begin_step(torch.rand(8), torch.ones(8))
    assert float(cur2.t) == before


def test_dominant_subcenters_keep_the_centre_most_images_are_nearest():
    from shardface.losses.subcenter import dominant_subcenters, drop_subcenters, far_from_dominant

    k = 3
    weight = torch.eye(6).repeat_interleave(1, 0)[:6]  # 2 classes x 3 centres, orthogonal
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    emb = torch.stack([weight[1], weight[1], weight[0], weight[5], weight[5], -weight[5]])
    dominant = dominant_subcenters(weight, emb, labels, k)
    assert dominant.tolist() == [1, 2]
    torch.testing.assert_close(drop_subcenters(weight, dominant, k), weight[[1, 5]])
    assert far_from_dominant(weight, dominant, emb, labels, k).tolist() == [2, 5]


class _CurricularWithTwoCentres(CurricularFace):
    subcenters = 2


def _checkpoint_worker(rank, world_size, output, save):
    from shardface.checkpoint.load import load_checkpoint
    from shardface.checkpoint.save import save_checkpoint
    from shardface.checkpoint.state import TrainState
    from shardface.parallel.ddp import DDPOptimizer

    torch.manual_seed(0)
    backbone = torch.nn.Linear(4, D)
    backbone_opt = DDPOptimizer(backbone, torch.optim.SGD, lr=0.1)
    curricular = _CurricularWithTwoCentres(s=S)  # sub-centre rows and a running statistic: both travel
    head = PartialFC(curricular, D, C, row_block=3)
    shard = class_shard(C, world_size, rank)
    full = torch.arange(C * 2 * D, dtype=torch.float32).view(C * 2, D)
    head_opt = torch.optim.SGD([head.weight], lr=0.1)
    if save:
        with torch.no_grad():
            head.weight.copy_(full[shard.start * 2 : shard.end * 2])
            curricular.t.fill_(0.25)
        save_checkpoint(
            output,
            TrainState(3, 0, 0),
            backbone=backbone,
            backbone_opt=backbone_opt,
            head=head,
            head_opt=head_opt,
            rank=rank,
            world_size=world_size,
        )
        return None
    load_checkpoint(
        output,
        backbone=backbone,
        backbone_opt=backbone_opt,
        head=head,
        head_opt=head_opt,
        rank=rank,
        world_size=world_size,
    )
    return head.weight.detach().clone(), float(curricular.t), full[shard.start * 2 : shard.end * 2]


@pytest.mark.parametrize("load_world", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_margin_state_and_subcentre_rows_resume_on_another_world_size(tmp_path, load_world):
    run_distributed(_checkpoint_worker, 2, str(tmp_path), True)
    for weight, t, expected in run_distributed(_checkpoint_worker, load_world, str(tmp_path), False):
        torch.testing.assert_close(weight, expected)
        assert t == 0.25


# scales whose s * (1 - eps) is far from its fp32 rounding (30, 60) as well as exact ones
@pytest.mark.parametrize("s", [S, 30.0, 60.0, 64.0])
# 4 <= D / 2: logits kept
@pytest.mark.parametrize(
    "chunk,rate,rows", [(None, 1.0, 6), (4, 1.0, 6), (4, 0.5, 6), (None, 1.0, 4), (4, 1.0, 4)]
)
def test_adaface_non_target_cosines_past_its_clamp_carry_no_gradient(chunk, rate, rows, s):
    """AdaFace clamps every cosine to [-1 + eps, 1 - eps]: embeddings pointing along (or against)
    a non-target class give that logit no gradient, in the head as in the paper's formulation."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(C, D, generator=g)
    labels = torch.arange(6) % C
    emb = torch.randn(6, D, generator=g) * 10
    # rows 0, 1: cos 0.9995 with class 5, -0.9995 with class 7 (past the clamp, not at +-1,
    # where the normalisation's own derivative would vanish anyway)
    for row, cls, cos in ((0, 5, 0.9995), (1, 7, -0.9995)):
        u = weight[cls] / weight[cls].norm()
        v = torch.randn(D, generator=g)
        v = (v - (v @ u) * u) / (v - (v @ u) * u).norm()
        emb[row] = (cos * u + (1 - cos * cos) ** 0.5 * v) * (row + 5) * 4
    assert labels[0] != 5 and labels[1] != 7
    emb, labels = emb[:rows], labels[:rows]  # (rows 0 and 1 are the ones past the clamp)
    head = PartialFC(AdaFace(s=s), D, C, chunk_size=chunk, row_block=4, sample_rate=rate)
    with torch.no_grad():
        head.weight.copy_(weight)
    e = emb.clone().requires_grad_(True)
    loss = head(e, labels)
    loss.backward()
    index = head.sampled.index()
    w = weight.clone().requires_grad_(True)
    ref_e = emb.clone().requires_grad_(True)
    expected, _ = ref.adaface_loss(
        ref_e,
        w,
        labels,
        copy.deepcopy(ref.INITIAL_STATE["adaface"]),
        s=s,
        classes=None if index is None else index,
    )
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.weight.grad, w.grad, rtol=1e-5, atol=1e-5 * w.grad.abs().max().item())
    torch.testing.assert_close(e.grad, ref_e.grad, rtol=1e-5, atol=1e-5 * ref_e.grad.abs().max().item())


@pytest.fixture(scope="module")
def subcenter_run(drawn_faces, tmp_path_factory):
    from shardface import train
    from tests.train_runs import train_argv

    out = str(tmp_path_factory.mktemp("subcenter") / "run")
    assert (
        train.main(
            train_argv(
                drawn_faces,
                out,
                "--max_steps",
                "2",
                "--margin",
                "subcenter_arcface",
                "--subcenter_k",
                "2",
                "--ema",
                "false",
            )
        )
        == 0
    )
    return out


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--max_degrees", "nan"], "--max_degrees nan: an angle above 0 and at most 180 degrees"),
        (["--max_degrees", "-5"], "--max_degrees -5: an angle above 0"),
        (["--max_degrees", "181"], "--max_degrees 181: an angle above 0"),
        (["--batch_size", "0"], "--batch_size 0: at least 1"),
    ],
)
def test_drop_subcenters_checks_each_option_at_start_in_one_line(subcenter_run, tmp_path, capsys, argv, said):
    from shardface.scripts import drop_subcenters

    assert drop_subcenters.main([subcenter_run, "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {said}"] or (len(err) == 1 and err[0].startswith(f"error: {said}"))
    assert not os.path.exists(tmp_path / "out")


def test_drop_subcenters_checks_its_output_before_the_pass(subcenter_run, tmp_path, monkeypatch, capsys):
    from shardface.scripts import drop_subcenters

    taken = tmp_path / "taken"
    taken.write_text("a file")
    monkeypatch.setattr(
        drop_subcenters, "build_train_dataset", lambda *a, **k: pytest.fail("embedded before checking")
    )
    assert drop_subcenters.main([subcenter_run, "--out", str(taken)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out {taken}: a file is in its place")
    assert taken.read_text() == "a file"
    out = tmp_path / "out"  # an earlier result is replaced only with --overwrite, checked before the pass
    out.mkdir()
    (out / "noisy_images.txt").write_text("an earlier list")
    assert drop_subcenters.main([subcenter_run, "--out", str(out)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: output {out / 'noisy_images.txt'} exists; pass --overwrite to replace it\n"
    )
    assert (out / "noisy_images.txt").read_text() == "an earlier list"
    ckpt = sorted(n for n in os.listdir(subcenter_run) if n.startswith("checkpoint-"))[-1]
    inside = os.path.join(subcenter_run, ckpt)  # writing into the checkpoint it reads: its files are refused
    os.link(os.path.join(inside, os.listdir(inside)[0]), os.path.join(str(tmp_path), "head_dominant.pt"))
    assert drop_subcenters.main([subcenter_run, "--out", str(tmp_path), "--overwrite"]) == 2
    assert "is also an input" in capsys.readouterr().err


def test_drop_subcenters_reads_the_data_as_the_run_did(tmp_path):
    """A run trained with `resize true` on a folder of 120x120 images: drop_subcenters embeds
    those images resized, as training read them, instead of refusing their size."""
    import numpy as np
    from PIL import Image

    from shardface import train
    from shardface.scripts import drop_subcenters

    rng = np.random.default_rng(0)
    for i in range(4):
        os.makedirs(tmp_path / "faces" / f"id{i}")
        for j in range(4):
            pixels = rng.integers(0, 256, (120, 120, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / "faces" / f"id{i}" / f"{j}.png")
    out = str(tmp_path / "run")
    assert (
        train.main(
            [
                "configs/demo.py",
                "--rec",
                str(tmp_path / "faces"),
                "--num_classes",
                "4",
                "--resize",
                "true",
                "--batch_size",
                "8",
                "--num_workers",
                "0",
                "--val_targets",
                "[]",
                "--max_steps",
                "2",
                "--warmup_epoch",
                "0",
                "--margin",
                "subcenter_arcface",
                "--subcenter_k",
                "2",
                "--ema",
                "false",
                "--output",
                out,
            ]
        )
        == 0
    )
    assert drop_subcenters.main([out, "--out", str(tmp_path / "clean")]) == 0
    assert torch.load(tmp_path / "clean" / "head_dominant.pt").shape == (4, 128)
    assert len(open(tmp_path / "clean" / "noisy_images.txt").read().split()) <= 16


def test_drop_subcenters_on_a_checkpoint_directory_reads_meta_config(subcenter_run, tmp_path):
    from shardface.checkpoint.folders import find_checkpoint
    from shardface.scripts import drop_subcenters

    assert drop_subcenters.main([find_checkpoint(subcenter_run), "--out", str(tmp_path / "clean")]) == 0
    assert torch.load(tmp_path / "clean" / "head_dominant.pt").shape == (16, 128)  # one centre per class
