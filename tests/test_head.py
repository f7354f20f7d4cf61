"""The sharded head equals single-process cross-entropy over the concatenated logits."""
import pytest
import torch
import torch.nn.functional as F

from heads import PartialFC, SampledRowsOptimizer, class_shard
from losses import ArcFace, CombinedMarginLoss, CosFace
from tests.distributed import run_distributed

C, D, B_LOCAL = 13, 8, 4
MARGINS = {
    "cosface": lambda: CosFace(s=16.0, m=0.35),
    "arcface": lambda: ArcFace(s=16.0, margin=0.5),
    "combined": lambda: CombinedMarginLoss(16.0, 1.1, 0.3, 0.1),
    "arcface_filtered": lambda: CombinedMarginLoss(16.0, 1.0, 0.5, 0.0, interclass_filtering_threshold=0.2),
}
CHUNKS = [None, 3]


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
            head = PartialFC(make(), D, C, chunk_size=chunk)
            assert (head.class_start, head.num_local) == (shard.start, shard.size)
            with torch.no_grad():
                head.weight.copy_(weight[shard.start:shard.end])
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
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 16), torch.nn.PReLU(16),
                               torch.nn.Linear(16, D))


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
        head.weight.copy_(full_w[shard.start:shard.end])
    opt = torch.optim.SGD(backbone.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
    hopt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.2, momentum=0.9, weight_decay=1e-3)
    x, y = _train_data(STEPS, global_batch)
    b = global_batch // world_size
    losses = []
    for step in range(STEPS):
        loss = head(backbone(x[step, rank * b:(rank + 1) * b]), y[step, rank * b:(rank + 1) * b])
        loss.backward()
        if world_size > 1:
            for p in backbone.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step(); hopt.step(); opt.zero_grad(); hopt.zero_grad()
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


@pytest.mark.parametrize("kind,message", [("label", "outside"), ("batch", "batch sizes differ"),
                                          ("width", "embeddings of shape")])
def test_bad_input_raises_on_every_rank_without_hanging(kind, message):
    errors = run_distributed(_bad_input_worker, 2, kind, timeout=60)
    assert all(e != "no error" for e in errors)
    assert any(message in e for e in errors)
