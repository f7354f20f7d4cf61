"""ZeRO-2 on W ranks equals the plain torch optimizer on one process with the global batch."""
import pytest
import torch
from torch import nn

from backbones import get_model
from parallel import DynamicLossScaler, Zero2Optimizer
from parallel.scratch import ScratchPool
from parallel.zero import BucketState
from tests.distributed import run_distributed

GLOBAL_BATCH, STEPS = 12, 6
TINY_BUCKET_MB = 40 * 4 / 2**20  # ~40 fp32 elements: many buckets, shards straddle params
TINY_CHUNK_MB = 25 * 4 / 2**20   # the optimizer steps each shard in chunks of 25 elements


class TwoDtypeNet(nn.Module):
    """7*13+13+13+13*5+5 = 187 fp32 elements (not divisible by 2 or 3) plus an fp64 vector."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(7, 13)
        self.act = nn.PReLU(13)
        self.lin2 = nn.Linear(13, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x))) * self.scale.float()


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def _loss(model, x, y):
    return (model(x) - y).square().mean()


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


def _reference(opt_name, clip, steps=STEPS):
    model = TwoDtypeNet()
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(model.parameters(), **kw)
    norms = []
    for step in range(steps):
        x, y = _data(step)
        _loss(model, x, y).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _zero_train(rank, world_size, opt_name, clip, exchange="auto", steps=STEPS, model=None, opt=None, first=0):
    if model is None:
        model = TwoDtypeNet()
        cls, kw = OPTIMIZERS[opt_name]
        opt = Zero2Optimizer(model, cls, bucket_cap_mb=TINY_BUCKET_MB, step_chunk_mb=TINY_CHUNK_MB,
                             exchange=exchange, **kw)
        assert len(opt.groups[0].chunks) > 1
    b = GLOBAL_BATCH // world_size
    norms = []
    for step in range(first, first + steps):
        x, y = _data(step)
        _loss(model, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]).backward()
        if opt.exchange == "p2p":  # gradients were copied into buckets and freed
            assert all(p.grad is None for p in model.parameters())
        else:  # views of the bucket buffer, zeroed once reduced
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        if clip:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    # through state_dict(): it waits for the asynchronous parameter all-gather of the last step
    return {n: t.clone() for n, t in model.state_dict().items()}, norms


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero2_matches_plain_optimizer_on_global_batch(world_size):
    # "auto" is point-to-point under gloo; "collective" (NCCL's default: reduce to each
    # owner, in-place all-gather) is proven here on gloo too
    cases = [(o, c, "auto") for o in OPTIMIZERS for c in (0.0, 0.3)]
    cases += [("sgd", 0.3, "collective"), ("adamw", 0.0, "collective")]
    results = run_distributed(_zero_cases, world_size, cases)
    for case, per_rank in zip(cases, zip(*results)):
        ref_params, ref_norms = _reference(*case[:2])
        for params, norms in per_rank:
            assert norms == pytest.approx(ref_norms, rel=1e-5)
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5, msg=f"{case} {name}")
        if case[1]:
            assert min(ref_norms) > case[1], "clipping must be active in this test"


def _zero_cases(rank, world_size, cases):
    return [_zero_train(rank, world_size, *case) for case in cases]


def _accumulation_worker(rank, world_size):
    """Two micro-batches with loss/2 each, then one step, must equal the full batch."""
    model = TwoDtypeNet()
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, lr=0.05, momentum=0.9)
    b = GLOBAL_BATCH // world_size
    for step in range(3):
        x, y = _data(step)
        x, y = x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]
        for half in (slice(0, b // 2), slice(b // 2, b)):
            (_loss(model, x[half], y[half]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_over_micro_batches_equals_the_full_batch():
    ref_model = TwoDtypeNet()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = _data(step)
        _loss(ref_model, x, y).backward()
        opt.step(); opt.zero_grad()
    for params in run_distributed(_accumulation_worker, 2):
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_layout_straddles_shard_borders():
    from parallel import build_layouts
    layouts = build_layouts(TwoDtypeNet(), 3, 1)
    fp32 = next(l for l in layouts if l.dtype == torch.float32)
    assert fp32.numel % (3 * 16) == 0
    partial = [s for s in fp32.slots if 0 < sum(p.global_range.size for p in s.owned) < s.global_range.size]
    assert partial, "some parameter must be split between ranks"


def _resume_worker(rank, world_size, path, phase):
    model = TwoDtypeNet()
    # the state is chunk-independent: saved from 25-element chunks, loaded whole at W=1
    chunk_mb = 4.0 if world_size == 1 else TINY_CHUNK_MB
    opt = Zero2Optimizer(model, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKET_MB, step_chunk_mb=chunk_mb,
                         lr=1e-2, weight_decay=0.1)
    if phase == "save":
        _zero_train(rank, world_size, "adamw", 0.3, steps=3, model=model, opt=opt)
        state = opt.state_dict()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": state}, path)
        first = 3
    else:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])  # copies into the flat buffer views
        opt.load_state_dict(saved["opt"])
        first = 3
    params, _ = _zero_train(rank, world_size, "adamw", 0.3, steps=3, model=model, opt=opt, first=first)
    return params


def test_state_dict_saved_at_two_ranks_continues_identically_at_one_and_three(tmp_path):
    path = str(tmp_path / "zero.pt")
    continued = run_distributed(_resume_worker, 2, path, "save")[0]
    for world_size in (1, 3):
        resumed = run_distributed(_resume_worker, world_size, path, "load")
        for params in resumed:
            for name, ref in continued.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-6)


def _bf16_worker(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5)).to(torch.bfloat16)
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, lr=0.1)
    assert all(t.dtype == torch.float32 for m in opt.master_shards() for _, t in m.pieces)
    b = GLOBAL_BATCH // world_size
    losses = []
    for step in range(8):
        x, y = _data(0)
        loss = _loss(model, x[rank * b:(rank + 1) * b].bfloat16(), y[rank * b:(rank + 1) * b].bfloat16())
        loss.backward()
        opt.step(); opt.zero_grad()
        losses.append(float(loss))
    (master,) = opt.master_shards()
    (_, shard), = master.pieces
    weights = master.layout.shard_of(master.layout.flatten({n: p.detach() for n, p in model.named_parameters()}))
    # bf16 parameters are the rounded fp32 master: updates smaller than bf16 precision survive
    assert torch.equal(weights, shard.bfloat16())
    assert not torch.equal(shard, shard.bfloat16().float())
    return losses


def test_bf16_model_keeps_fp32_master_and_learns():
    for losses in run_distributed(_bf16_worker, 2):
        assert losses[-1] < losses[0] * 0.9


def _fp16_skip_worker(rank, world_size):
    model = TwoDtypeNet()
    model.lin1.half(); model.lin2.half(); model.act.half()
    net = lambda x: model.lin2(model.act(model.lin1(x.half()))).float() * model.scale.float()
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, lr=0.05)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1000)
    b = GLOBAL_BATCH // world_size
    record = []
    for step in range(3):
        x, y = _data(step)
        x = x[rank * b:(rank + 1) * b]
        if step == 1 and rank == 1:
            x = x.clone(); x[0, 0] = float("inf")  # an overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale((net(x) - y[rank * b:(rank + 1) * b]).square().mean()).backward()
        stepped = scaler.unscale_(opt)
        if stepped:
            opt.step()
        opt.zero_grad()
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
        record.append((stepped, changed, scaler.scale_value))
    return record


def test_fp16_inf_on_one_rank_skips_the_step_on_every_rank():
    for record in run_distributed(_fp16_skip_worker, 2):
        assert record == [(True, True, 1024.0), (False, False, 512.0), (True, True, 512.0)]


def _scratch_worker(rank, world_size, bucket_mb):
    torch.manual_seed(0)
    model = get_model("mbf")  # 2.06M parameters: 7.9 MB of fp32 gradients
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=bucket_mb, lr=0.01, momentum=0.9)
    held = []
    for _ in range(3):
        model(torch.randn(2, 3, 112, 112)).square().mean().backward()
        opt.step(); opt.zero_grad()
        held.append(opt.scratch.held_bytes)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return opt.peak_scratch_bytes, held, grad_bytes


@pytest.mark.parametrize("world_size", [2, 3])
def test_gradient_scratch_is_a_few_buckets_reused_every_step(world_size):
    bucket_mb = 0.25
    for peak, held, grad_bytes in run_distributed(_scratch_worker, world_size, bucket_mb):
        # (one bucket in flight + one filling) x (the bucket + up to W-1 received copies of
        # the part this rank owns): a few buckets, not a copy of the gradient
        assert peak <= 2 * world_size * bucket_mb * 2**20 < grad_bytes / 4
        assert held[0] == held[1] == held[2] == peak  # the pool settled in the first step


def test_scratch_pool_lends_the_smallest_fitting_buffer_and_drops_ones_too_small():
    pool = ScratchPool()
    a, b = pool.take(10, torch.float32, "cpu"), pool.take(30, torch.float32, "cpu")
    pool.give(a); pool.give(b)
    assert pool.held_bytes == 40 * 4
    c = pool.take(8, torch.float32, "cpu")  # fits both: the 10-element buffer is lent
    assert c.numel() == 8 and c.data_ptr() == a.data_ptr()
    d = pool.take(50, torch.float32, "cpu")  # fits none: the free 30-element one is dropped
    assert pool.free == [] and pool.held_bytes == (10 + 50) * 4 == pool.peak_held_bytes
    pool.give(c); pool.give(d)
    assert pool.take(40, torch.float64, "cpu").dtype == torch.float64  # kinds never mix
    assert len(pool.free) == 2


def test_a_parameter_without_gradient_is_named_instead_of_reducing_garbage():
    model = TwoDtypeNet()
    model.unused = nn.Linear(3, 3)
    opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1)
    x, y = _data(0)
    with pytest.raises(RuntimeError, match=r"parameter 'unused\.(weight|bias)' \(2 in all\) got no gradient"):
        _loss(model, x, y).backward()


@pytest.mark.parametrize("network", ["r18", "mbf", "vit_t"])
def test_every_backbone_delivers_every_gradient_to_its_bucket(network):
    model = get_model(network)
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=1.0, lr=0.1)
    model(torch.randn(2, 3, 112, 112)).square().mean().backward()
    assert all(b.state in (BucketState.LAUNCHED, BucketState.DONE) for g in opt.groups for b in g.buckets)
    assert all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in opt.grad_shards())
