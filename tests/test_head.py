"""The sharded head equals single-process cross-entropy over the concatenated logits."""

import math

import pytest
import torch
import torch.nn.functional as F

from shardface.heads import PartialFC, SampledRowsOptimizer, class_shard
from shardface.losses import ArcFace, CombinedMarginLoss, CosFace, CurricularFace, MarginLoss
from tests.distributed import run_distributed

C, D, B_LOCAL = 13, 8, 4
MARGINS = {
    "cosface": lambda: CosFace(s=16.0, m=0.35),
    "arcface": lambda: ArcFace(s=16.0, margin=0.5),
    "combined": lambda: CombinedMarginLoss(16.0, 1.1, 0.3, 0.1),
    "arcface_filtered": lambda: CombinedMarginLoss(16.0, 1.0, 0.5, 0.0, interclass_filtering_threshold=0.2),
}
CHUNKS = [None, 3]  # classes per tile
ROW_BLOCKS = {None: 128, 3: 5}  # several row blocks, the last one short


def _problem(world_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(C, D, generator=g)
    emb = torch.randn(world_size * B_LOCAL, D, generator=g)
    labels = torch.randint(0, C, (world_size * B_LOCAL,), generator=g)
    # put several targets in one chunk and some classes on every rank
    labels[:3] = torch.tensor([0, C - 1, C // 2])
    return weight, emb, labels


def _reference(margin, weight, emb, labels):
    weight = weight.clone().requires_grad_(True)
    emb = emb.clone().requires_grad_(True)
    logits = margin(F.normalize(emb) @ F.normalize(weight).t(), labels)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return loss.detach(), weight.grad, emb.grad


def _sharded_worker(rank, world_size):
    weight, emb, labels = _problem(world_size)
    shard = class_shard(C, world_size, rank)
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    out = {}
    for name, make in MARGINS.items():
        for chunk in CHUNKS:
            head = PartialFC(make(), D, C, chunk_size=chunk, row_block=ROW_BLOCKS[chunk])
            assert (head.class_start, head.num_local) == (shard.start, shard.size)
            with torch.no_grad():
                head.weight.copy_(weight[shard.start : shard.end])
            local_emb = emb[rows].clone().requires_grad_(True)
            loss = head(local_emb, labels[rows])
            loss.backward()
            out[(name, chunk)] = (loss.detach(), head.weight.grad.clone(), local_emb.grad.clone())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sharded_ce_matches_full_softmax_uneven_classes(world_size):
    weight, emb, labels = _problem(world_size)
    results = run_distributed(_sharded_worker, world_size)
    for name, make in MARGINS.items():
        ref_loss, ref_dw, ref_de = _reference(make(), weight, emb, labels)
        for chunk in CHUNKS:
            dw = torch.cat([r[(name, chunk)][1] for r in results])
            de = torch.cat([r[(name, chunk)][2] for r in results])
            for r in results:
                torch.testing.assert_close(r[(name, chunk)][0], ref_loss, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5 * ref_dw.abs().max().item())
            # documented factor: each rank's embedding gradient is W x that of the global mean
            torch.testing.assert_close(de / world_size, ref_de, rtol=1e-5, atol=1e-6)


def _tiny_backbone():
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(12, 16), torch.nn.PReLU(16), torch.nn.Linear(16, D)
    )


def _train_data(steps, global_batch):
    """The same batch every step (so the loss must fall), half the classes per batch."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(global_batch, 3, 2, 2, generator=g)
    y = torch.randint(0, C, (global_batch,), generator=g)
    return x.expand(steps, *x.shape), y.expand(steps, *y.shape)


STEPS = 5


def _train(rank, world_size, global_batch, chunk):
    """W ranks x b images, backbone grads averaged across ranks like DDP."""
    import torch.distributed as dist

    backbone = _tiny_backbone()
    head = PartialFC(CombinedMarginLoss(16.0, 1.0, 0.3, 0.1), D, C, chunk_size=chunk)
    full_w = torch.randn(C, D, generator=torch.Generator().manual_seed(2))
    shard = class_shard(C, world_size, rank)
    with torch.no_grad():
        head.weight.copy_(full_w[shard.start : shard.end])
    opt = torch.optim.SGD(backbone.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
    hopt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.2, momentum=0.9, weight_decay=1e-3)
    x, y = _train_data(STEPS, global_batch)
    b = global_batch // world_size
    losses = []
    for step in range(STEPS):
        loss = head(backbone(x[step, rank * b : (rank + 1) * b]), y[step, rank * b : (rank + 1) * b])
        loss.backward()
        if world_size > 1:
            for p in backbone.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        hopt.step()
        opt.zero_grad()
        hopt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach() for p in backbone.parameters()], head.weight.detach()


@pytest.mark.parametrize("world_size,chunk", [(2, None), (3, 4)])
def test_w_ranks_train_like_one_process_with_global_batch(world_size, chunk):
    global_batch = 6 * world_size
    results = run_distributed(_train, world_size, global_batch, chunk)
    single_losses, single_params, single_w = _train(0, 1, global_batch, None)
    for losses, params, _ in results:
        assert losses == pytest.approx(single_losses, rel=1e-5)
        for a, b in zip(params, single_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[2] for r in results]), single_w, rtol=1e-5, atol=1e-5)
    assert single_losses[-1] < single_losses[0]


def test_sampling_keeps_positives_and_count_and_equals_restricted_ce():
    torch.manual_seed(3)
    num_classes, rate = 50, 0.2
    head = PartialFC(ArcFace(s=16.0, margin=0.5), D, num_classes, sample_rate=rate)
    emb, labels = torch.randn(6, D), torch.tensor([3, 3, 17, 40, 41, 8])
    loss = head(emb, labels)
    index = head.sampled.index()
    assert set(labels.tolist()) <= set(index.tolist())
    assert index.numel() == int(rate * num_classes) and index.unique().numel() == index.numel()
    sub = head.weight.detach()[index]
    sub_labels = torch.searchsorted(index, labels)
    ref = F.cross_entropy(head.margin_loss(F.normalize(emb) @ F.normalize(sub).t(), sub_labels), sub_labels)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    # more positives than the sample size: exactly the positives are kept
    many = torch.arange(0, 24, 2)
    head.sampled.clear()
    head(torch.randn(12, D), many)
    assert head.sampled.index().tolist() == many.tolist()


def test_unsampled_rows_keep_weights_and_optimizer_state():
    torch.manual_seed(4)
    head = PartialFC(CosFace(s=16.0, m=0.3), D, 40, sample_rate=0.25)
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.5, momentum=0.9, weight_decay=0.1)
    head(torch.randn(4, D), torch.tensor([1, 2, 3, 4])).backward()
    opt.step()
    first = head.sampled.index().clone()
    opt.zero_grad()
    w_before = head.weight.detach().clone()
    buf_before = opt.state[head.weight]["momentum_buffer"].clone()
    head(torch.randn(4, D), torch.tensor([30, 31, 32, 33])).backward()
    opt.step()
    second = head.sampled.index()
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[second] = False
    assert untouched.sum() > 0
    assert torch.equal(head.weight.detach()[untouched], w_before[untouched])
    assert torch.equal(opt.state[head.weight]["momentum_buffer"][untouched], buf_before[untouched])
    moved = second[~torch.isin(second, first)]
    assert not torch.equal(head.weight.detach()[moved], w_before[moved])


def test_sampled_rows_accumulate_over_micro_steps_until_zero_grad():
    torch.manual_seed(5)
    head = PartialFC(CosFace(s=16.0, m=0.3), D, 40, sample_rate=0.1)
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1)
    head(torch.randn(2, D), torch.tensor([1, 2]))
    first = set(head.sampled.index().tolist())
    head(torch.randn(2, D), torch.tensor([30, 31]))
    assert first | {30, 31} <= set(head.sampled.index().tolist())
    opt.zero_grad()
    assert head.sampled.index() is None


def _bad_input_worker(rank, world_size, kind):
    head = PartialFC(CosFace(), D, C)
    b = B_LOCAL + (1 if kind == "batch" and rank == 1 else 0)
    width = D + (1 if kind == "width" and rank == 0 else 0)
    labels = torch.zeros(b, dtype=torch.long)
    if kind == "label" and rank == 1:
        labels[2] = C
    try:
        head(torch.randn(b, width), labels)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    "kind,message", [("label", "outside"), ("batch", "batch sizes differ"), ("width", "embeddings of shape")]
)
def test_bad_input_raises_on_every_rank_without_hanging(kind, message):
    errors = run_distributed(_bad_input_worker, 2, kind, timeout=60)
    assert all(e != "no error" for e in errors)
    assert any(message in e for e in errors)


def _initial_weight_worker(rank, world_size, num_classes=9001):
    torch.manual_seed(7)  # train.py's seed, the same on every rank
    return PartialFC(CosFace(), D, num_classes, chunk_size=512).weight.detach()


def test_initial_head_is_the_same_at_any_world_size_and_no_two_shards_start_alike():
    from shardface.heads.sharding import INIT_BLOCK, initial_class_rows

    C_INIT = 9001  # uneven over 3 ranks; shards start inside and across the generator's blocks
    assert C_INIT > 2 * INIT_BLOCK
    whole = _initial_weight_worker(0, 1, C_INIT)  # one process, no group
    shards = run_distributed(_initial_weight_worker, 3, C_INIT)
    torch.testing.assert_close(torch.cat(shards), whole, rtol=0, atol=0)
    assert not torch.equal(shards[0][:100], shards[1][:100]) and not torch.equal(
        shards[1][:100], shards[2][:100]
    )
    assert abs(whole.std().item() - 0.01) < 2e-4 and abs(whole.mean().item()) < 2e-4
    # sub-centres: k rows per class, class-major, the same for any split of the classes
    k3 = initial_class_rows(class_shard(C_INIT, 1, 0), 3, D, seed=7)
    part = class_shard(C_INIT, 4, 2)
    torch.testing.assert_close(
        initial_class_rows(part, 3, D, seed=7), k3[part.start * 3 : part.end * 3], rtol=0, atol=0
    )


def _device_label_worker(rank, world_size):
    """The path labels on a GPU take (no raise: that would wait on the device), on the CPU."""
    from shardface.parallel import DynamicLossScaler
    from shardface.utils.divergence import TrainingStopped, check_loss

    head = PartialFC(CosFace(), D, C)
    head.raise_on_bad_labels = False
    emb = torch.randn(B_LOCAL, D, requires_grad=True)
    labels = torch.zeros(B_LOCAL, dtype=torch.long)
    counts = []
    for step in range(3):
        labels[2] = C if (rank == 1 and step == 1) else 1
        loss = head(emb, labels)
        loss.backward()
        assert torch.isfinite(emb.grad).all() and torch.isfinite(head.weight.grad).all()
        assert math.isnan(loss.item()) == (step == 1)
        counts.append(head.take_label_errors())
    try:  # the check the loop makes where it reads the loss, with an fp16 scaler that tolerates a NaN loss
        check_loss(1.0, 3, DynamicLossScaler(), label_errors=sum(counts))
    except TrainingStopped as exc:
        return counts, str(exc)
    return counts, "no error"


def test_bad_label_on_a_device_stops_every_rank_at_the_next_check_even_under_fp16():
    for counts, message in run_distributed(_device_label_worker, 2, timeout=60):
        assert counts == [0, 1, 0], counts  # every rank counts the batch that rank 1 read
        assert "label outside the classes" in message, message


class _NormMargin(MarginLoss):
    """A margin that reads the raw norm (with gradient) and adds a regulariser: exercises
    the head's norm path as MagFace does, with a formula simple enough to restate below."""

    uses_norms = True

    def target_logit(self, cos, rows=None):
        return self.s * (cos - 0.05 * rows["norm"].clamp(0.5, 3.0))

    def begin_step(self, target_cos, norms):
        return {"norm": norms}

    def regularizer(self, norms):
        return 0.1 * (norms / 4 + 1 / norms).mean()


class _TwoSubcenters(MarginLoss):
    subcenters = 2

    def target_logit(self, cos, rows=None):
        return self.s * (cos - 0.2)


def _norm_reference(weight, emb, labels, s=16.0):
    weight = weight.clone().requires_grad_(True)
    emb = emb.clone().requires_grad_(True)
    norm = emb.norm(dim=1)
    cos = F.normalize(emb) @ F.normalize(weight).t()
    b = torch.arange(len(labels))
    target = s * (cos[b, labels] - 0.05 * norm.clamp(0.5, 3.0))
    logits = (s * cos).index_put((b, labels), target)
    loss = F.cross_entropy(logits, labels) + 0.1 * (norm / 4 + 1 / norm).mean()
    loss.backward()
    return loss.detach(), weight.grad, emb.grad


def _subcenter_reference(weight, emb, labels, s=16.0):
    weight = weight.clone().requires_grad_(True)
    emb = emb.clone().requires_grad_(True)
    cos = (F.normalize(emb) @ F.normalize(weight).t()).view(len(labels), -1, 2).amax(2)
    b = torch.arange(len(labels))
    logits = (s * cos).index_put((b, labels), s * (cos[b, labels] - 0.2))
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return loss.detach(), weight.grad, emb.grad


def _special_worker(rank, world_size, kind, chunk, row_block):
    margin = _NormMargin(s=16.0) if kind == "norm" else _TwoSubcenters(s=16.0)
    k = margin.subcenters
    weight, emb, labels = _problem(world_size)
    weight = torch.randn(C * k, D, generator=torch.Generator().manual_seed(9))
    emb = emb * torch.linspace(0.6, 2.5, len(emb))[:, None]  # norms on both sides of the clamp
    shard = class_shard(C, world_size, rank)
    head = PartialFC(margin, D, C, chunk_size=chunk, row_block=row_block)
    with torch.no_grad():
        head.weight.copy_(weight[shard.start * k : shard.end * k])
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    local_emb = emb[rows].clone().requires_grad_(True)
    loss = head(local_emb, labels[rows])
    loss.backward()
    with torch.no_grad():
        no_grad_loss = head(emb[rows], labels[rows])
    return loss.detach(), no_grad_loss, head.weight.grad.clone(), local_emb.grad.clone()


@pytest.mark.parametrize("kind", ["norm", "subcenter"])
@pytest.mark.parametrize("world_size,chunk,row_block", [(1, None, 128), (2, 2, 3), (3, 4, 5)])
def test_norm_and_subcenter_margins_match_full_softmax(kind, world_size, chunk, row_block):
    k = 2 if kind == "subcenter" else 1
    _, emb, labels = _problem(world_size)
    weight = torch.randn(C * k, D, generator=torch.Generator().manual_seed(9))
    emb = emb * torch.linspace(0.6, 2.5, len(emb))[:, None]
    ref_loss, ref_dw, ref_de = (_norm_reference if kind == "norm" else _subcenter_reference)(
        weight, emb, labels
    )
    results = run_distributed(_special_worker, world_size, kind, chunk, row_block)
    for loss, no_grad_loss, _, _ in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(no_grad_loss, ref_loss, rtol=1e-5, atol=1e-5)
    dw = torch.cat([r[2] for r in results])
    de = torch.cat([r[3] for r in results])
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5 * ref_dw.abs().max().item())
    torch.testing.assert_close(de / world_size, ref_de, rtol=1e-5, atol=1e-6)


def _sampled_worker(rank, world_size, chunk):
    torch.manual_seed(100 + rank)
    num_classes = 40
    weight = torch.randn(num_classes, D, generator=torch.Generator().manual_seed(7))
    emb = torch.randn(world_size * B_LOCAL, D, generator=torch.Generator().manual_seed(8))
    labels = torch.randint(
        0, num_classes, (world_size * B_LOCAL,), generator=torch.Generator().manual_seed(6)
    )
    shard = class_shard(num_classes, world_size, rank)
    head = PartialFC(
        ArcFace(s=16.0, margin=0.4), D, num_classes, sample_rate=0.5, chunk_size=chunk, row_block=3
    )
    with torch.no_grad():
        head.weight.copy_(weight[shard.start : shard.end])
    rows = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    local_emb = emb[rows].clone().requires_grad_(True)
    loss = head(local_emb, labels[rows])
    loss.backward()
    return loss.detach(), head.weight.grad.clone(), local_emb.grad.clone(), head.sampled.index() + shard.start


@pytest.mark.parametrize("world_size,chunk", [(2, None), (3, 3)])
def test_partial_fc_sampling_matches_softmax_over_the_sampled_classes(world_size, chunk):
    num_classes = 40
    weight = torch.randn(num_classes, D, generator=torch.Generator().manual_seed(7))
    emb = torch.randn(world_size * B_LOCAL, D, generator=torch.Generator().manual_seed(8))
    labels = torch.randint(
        0, num_classes, (world_size * B_LOCAL,), generator=torch.Generator().manual_seed(6)
    )
    results = run_distributed(_sampled_worker, world_size, chunk)
    sampled = torch.cat([r[3] for r in results])
    assert set(labels.tolist()) <= set(sampled.tolist())
    margin = ArcFace(s=16.0, margin=0.4)
    sub_labels = torch.searchsorted(sampled, labels)
    ref_loss, ref_dw_sub, ref_de = _reference(margin, weight[sampled], emb, sub_labels)
    ref_dw = torch.zeros_like(weight).index_copy_(0, sampled, ref_dw_sub)  # unsampled rows: exactly zero
    for r in results:
        torch.testing.assert_close(r[0], ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([r[1] for r in results]), ref_dw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r[2] for r in results]) / world_size, ref_de, rtol=1e-5, atol=1e-6)


def test_bf16_logits_stay_close_to_an_fp64_reference():
    """bf16 GEMM for the logits, fp32 row statistics and gradients, against fp64."""
    torch.manual_seed(11)
    n, b = 300, 24
    head = PartialFC(ArcFace(s=64.0, margin=0.5), 64, n, chunk_size=128, row_block=8, precision="bf16")
    emb = torch.randn(b, 64, requires_grad=True)
    labels = torch.randint(0, n, (b,))
    loss = head(emb, labels)
    loss.backward()
    ref_loss, ref_dw, ref_de = _reference(
        ArcFace(s=64.0, margin=0.5), head.weight.detach().double(), emb.detach().double(), labels
    )
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    assert (head.weight.grad.double() - ref_dw).norm() < 0.05 * ref_dw.norm()
    assert (emb.grad.double() - ref_de).norm() < 0.05 * ref_de.norm()


def _fused_worker(rank, world_size, optimizer, sample_rate, fused):
    torch.manual_seed(200 + rank)  # Partial FC draws the same samples in both runs
    num_classes = 30
    shard = class_shard(num_classes, world_size, rank)
    head = PartialFC(
        CosFace(s=16.0, m=0.3),
        D,
        num_classes,
        sample_rate=sample_rate,
        chunk_size=4,
        row_block=3,
        fused_optimizer=fused,
    )
    with torch.no_grad():
        head.weight.copy_(
            torch.randn(num_classes, D, generator=torch.Generator().manual_seed(3))[shard.start : shard.end]
        )
    cls, kw = {
        "sgd": (torch.optim.SGD, dict(lr=0.5, momentum=0.9, weight_decay=0.05)),
        "adamw": (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.05)),
        "adam": (torch.optim.Adam, dict(lr=0.05, weight_decay=0.05)),
    }[optimizer]
    opt = SampledRowsOptimizer(head, cls, **kw)
    g = torch.Generator().manual_seed(4)
    grads = []
    for step in range(4):
        emb = torch.randn(world_size * B_LOCAL, D, generator=g)[rank * B_LOCAL : (rank + 1) * B_LOCAL]
        labels = torch.randint(0, num_classes, (world_size * B_LOCAL,), generator=g)[
            rank * B_LOCAL : (rank + 1) * B_LOCAL
        ]
        emb.requires_grad_(True)
        (head(emb, labels) * 0.5).backward()  # a grad_output other than 1 reaches the fused update
        grads.append(emb.grad)
        opt.step()
        opt.zero_grad()
    return head.weight.detach(), {k: v for k, v in opt.state[head.weight].items()}, grads


# world size 1: 4 rows <= D / 2, the weight's radial term from the tile (the fused head keeps its
# logits in a second tile); 2: 8 rows, from the rows' dot products
@pytest.mark.parametrize(
    "optimizer,sample_rate,world_size",
    [
        pytest.param("sgd", 1.0, 2, marks=pytest.mark.slow),
        ("adamw", 1.0, 2),
        ("sgd", 0.4, 2),
        ("adam", 0.4, 2),
        ("sgd", 1.0, 1),
        pytest.param("adamw", 0.4, 1, marks=pytest.mark.slow),
    ],
)
def test_fused_head_optimizer_equals_the_unfused_step(optimizer, sample_rate, world_size):
    fused = run_distributed(_fused_worker, world_size, optimizer, sample_rate, True)
    plain = run_distributed(_fused_worker, world_size, optimizer, sample_rate, False)
    for (w_f, s_f, g_f), (w_p, s_p, g_p) in zip(fused, plain):
        torch.testing.assert_close(w_f, w_p, rtol=1e-6, atol=1e-6)
        assert s_f.keys() == s_p.keys()
        for k in s_p:
            torch.testing.assert_close(s_f[k], s_p[k], rtol=1e-6, atol=1e-6, msg=k)
        for a, b in zip(g_f, g_p):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk,sample_rate", [(None, 1.0), (3, 1.0), (3, 0.5)])
@pytest.mark.parametrize("fused", [False, True])
def test_head_forward_and_backward_never_wait_on_the_device(chunk, sample_rate, fused):
    """Zero host syncs in the head's forward+backward (labels handed in on the device path:
    the CPU label check is the only read, and it is skipped with validate=False)."""
    from tests.host_sync import HostSyncCounter

    torch.manual_seed(0)
    head = PartialFC(
        ArcFace(s=16.0, margin=0.5),
        D,
        40,
        sample_rate=sample_rate,
        chunk_size=chunk,
        row_block=3,
        validate=False,
        fused_optimizer=fused,
    )
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9)
    emb = torch.randn(7, D, requires_grad=True)
    labels = torch.randint(0, 40, (7,))
    with HostSyncCounter() as c:
        head(emb, labels).backward()
    assert c.calls == []
    del opt


def test_head_under_no_grad_forms_only_the_logits():
    """Evaluation pays for the logits GEMMs alone: no dE / dW products under torch.no_grad()."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountGEMMs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func._schema.name in ("aten::mm", "aten::addmm", "aten::addmm_")
            return func(*args, **(kwargs or {}))

    head = PartialFC(ArcFace(s=16.0, margin=0.5), D, 40, chunk_size=10, row_block=16)
    emb, labels = torch.randn(6, D, requires_grad=True), torch.randint(0, 40, (6,))
    with CountGEMMs() as with_grad:  # the last block's dE and dW are formed in backward
        head(emb, labels).backward()
    with torch.no_grad(), CountGEMMs() as without:
        head(emb, labels)
    assert without.n == 4 and with_grad.n == 12  # 4 tiles: logits; + dE and dW per tile


def _storages_allocated(head, emb, labels):
    """Byte sizes of every storage the head's forward creates (views report their base's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Storages(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.sizes.add(t.untyped_storage().nbytes())
            return out

    with Storages() as seen:
        head(emb, labels)
    return seen.sizes


def test_first_row_block_is_kept_inside_the_weight_gradient():
    """Up to D rows of the global batch cost no kept-cosine buffer: their cosines live in the
    weight gradient's rows until each tile's gradient overwrites them. More rows than D add
    one buffer of row_block x shard cosines, whatever the batch."""
    n, dim, tile, row_block = 40, 16, 10, 3
    head = PartialFC(ArcFace(s=16.0, margin=0.5), dim, n, chunk_size=tile, row_block=row_block)
    grad_bytes = n * dim * 4
    small = _storages_allocated(
        head, torch.randn(dim // 2, dim, requires_grad=True), torch.randint(0, n, (dim // 2,))
    )
    assert grad_bytes in small
    assert row_block * n * 4 not in small and max(s for s in small if s != grad_bytes) < (dim // 2) * n * 4
    large = _storages_allocated(
        head, torch.randn(3 * dim // 2, dim, requires_grad=True), torch.randint(0, n, (3 * dim // 2,))
    )
    assert row_block * n * 4 in large


def _exp_elements(head, emb, labels):
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountExp(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._schema.name in ("aten::exp", "aten::exp_", "aten::logsumexp"):
                self.n += args[0].numel()
            return out

    with CountExp() as count:
        head(emb, labels).backward()
    return count.n


@pytest.mark.parametrize(
    "margin,passes",
    [(ArcFace(s=64.0, margin=0.5), 1), (CosFace(s=64.0, m=0.35), 1), (CurricularFace(s=64.0, m=0.5), 2)],
)
@pytest.mark.parametrize("rate", [1.0, 0.5])
def test_linear_margins_take_one_exp_per_logit(margin, passes, rate):
    """Where other logits are s * cos, the head keeps exp(logit) from the statistics for the
    gradient: one exponential per logit instead of two (and no separate log-sum-exp)."""
    n, dim, batch = 60, 16, 24
    head = PartialFC(margin, dim, n, chunk_size=7, row_block=5, sample_rate=rate)
    count = _exp_elements(head, torch.randn(batch, dim, requires_grad=True), torch.randint(0, n, (batch,)))
    used = n if rate == 1.0 else max(int(rate * n), batch)
    assert passes * batch * used <= count < passes * batch * used + 8 * batch
