"""ZeRO-2 on W ranks equals the plain torch optimizer on one process with the global batch."""

import pytest
import torch
from torch import nn

from shardface.backbones import get_model
from shardface.parallel import DynamicLossScaler, ShardedEMA, Zero2Optimizer
from shardface.parallel.scratch import ScratchPool
from shardface.parallel.zero import BucketState
from tests.distributed import run_distributed
from tests.tiny_net import GLOBAL_BATCH, TINY_BUCKET_MB, TwoDtypeNet, mse_loss, step_batch

STEPS = 6
TINY_CHUNK_MB = 25 * 4 / 2**20  # the optimizer steps each shard in chunks of 25 elements


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
        x, y = step_batch(step)
        mse_loss(model, x, y).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _zero_train(
    rank, world_size, opt_name, clip, exchange="auto", steps=STEPS, model=None, opt=None, first=0
):
    if model is None:
        model = TwoDtypeNet()
        cls, kw = OPTIMIZERS[opt_name]
        opt = Zero2Optimizer(
            model, cls, bucket_cap_mb=TINY_BUCKET_MB, step_chunk_mb=TINY_CHUNK_MB, exchange=exchange, **kw
        )
        assert len(opt.groups[0].chunks) > 1
    b = GLOBAL_BATCH // world_size
    norms = []
    for step in range(first, first + steps):
        x, y = step_batch(step)
        mse_loss(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
        if opt.exchange != "collective":  # gradients were copied into buckets and freed
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
        x, y = step_batch(step)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        for half in (slice(0, b // 2), slice(b // 2, b)):
            (mse_loss(model, x[half], y[half]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_gradient_accumulation_over_micro_batches_equals_the_full_batch():
    ref_model = TwoDtypeNet()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = step_batch(step)
        mse_loss(ref_model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for params in run_distributed(_accumulation_worker, 2):
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def test_layout_straddles_shard_borders():
    from shardface.parallel import build_layouts

    layouts = build_layouts(TwoDtypeNet(), 3, 1)
    fp32 = next(layout for layout in layouts if layout.dtype == torch.float32)
    assert fp32.numel % (3 * 16) == 0
    partial = [s for s in fp32.slots if 0 < sum(p.global_range.size for p in s.owned) < s.global_range.size]
    assert partial, "some parameter must be split between ranks"


def _resume_worker(rank, world_size, path, phase):
    model = TwoDtypeNet()
    # the state is chunk-independent: saved from 25-element chunks, loaded whole at W=1
    # and exchange-independent: saved by the collective exchange, loaded by point-to-point
    chunk_mb = 4.0 if world_size == 1 else TINY_CHUNK_MB
    opt = Zero2Optimizer(
        model,
        torch.optim.AdamW,
        bucket_cap_mb=TINY_BUCKET_MB,
        step_chunk_mb=chunk_mb,
        exchange="collective" if phase == "save" else "auto",
        lr=1e-2,
        weight_decay=0.1,
    )
    if phase == "save":
        _zero_train(rank, world_size, "adamw", 0.3, steps=3, model=model, opt=opt)
        state = opt.state_dict(to_rank=0)  # gathered to the rank that writes
        assert (state is None) == (rank != 0)
        weights = model.state_dict()
        if rank == 0:
            torch.save({"model": weights, "opt": state}, path)
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
        x, y = step_batch(0)
        loss = mse_loss(
            model, x[rank * b : (rank + 1) * b].bfloat16(), y[rank * b : (rank + 1) * b].bfloat16()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    (master,) = opt.master_shards()
    ((_, shard),) = master.pieces
    weights = master.layout.shard_of(
        master.layout.flatten({n: p.detach() for n, p in model.named_parameters()})
    )
    # bf16 parameters are the rounded fp32 master: updates smaller than bf16 precision survive
    assert torch.equal(weights, shard.bfloat16())
    assert not torch.equal(shard, shard.bfloat16().float())
    # the EMA's evaluation copy of the module carries the optimizer's hooks: loading it must
    # leave the live fp32 master alone (not refresh it from the bf16 weights)
    before = shard.clone()
    ShardedEMA(model, 0.9, 1.0, optimizer=opt).ema_module()
    assert torch.equal(shard, before)
    return losses


def test_bf16_model_keeps_fp32_master_and_learns():
    for losses in run_distributed(_bf16_worker, 2):
        assert losses[-1] < losses[0] * 0.9


def _fp16_skip_worker(rank, world_size):
    model = TwoDtypeNet()
    model.lin1.half()
    model.lin2.half()
    model.act.half()

    def net(x):
        return model.lin2(model.act(model.lin1(x.half()))).float() * model.scale.float()

    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, lr=0.05)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=1000)
    b = GLOBAL_BATCH // world_size
    record = []
    for step in range(3):
        x, y = step_batch(step)
        x = x[rank * b : (rank + 1) * b]
        if step == 1 and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")  # an overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale((net(x) - y[rank * b : (rank + 1) * b]).square().mean()).backward()
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
        opt.step()
        opt.zero_grad()
        held.append(opt.scratch.held_bytes)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    return opt.peak_scratch_bytes, held, grad_bytes


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
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
    pool.give(a)
    pool.give(b)
    assert pool.held_bytes == 40 * 4
    c = pool.take(8, torch.float32, "cpu")  # fits both: the 10-element buffer is lent
    assert c.numel() == 8 and c.data_ptr() == a.data_ptr()
    d = pool.take(50, torch.float32, "cpu")  # fits none: the free 30-element one is dropped
    assert pool.free == [] and pool.held_bytes == (10 + 50) * 4 == pool.peak_held_bytes
    pool.give(c)
    pool.give(d)
    assert pool.take(40, torch.float64, "cpu").dtype == torch.float64  # kinds never mix
    assert len(pool.free) == 2


def test_a_parameter_without_gradient_is_named_instead_of_reducing_garbage():
    model = TwoDtypeNet()
    model.unused = nn.Linear(3, 3)
    _opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1)  # kept alive: its hooks reduce the gradients
    x, y = step_batch(0)
    with pytest.raises(RuntimeError, match=r"parameter 'unused\.(weight|bias)' \(2 in all\) got no gradient"):
        mse_loss(model, x, y).backward()


@pytest.mark.parametrize("network", ["r18", "mbf", "vit_t"])
def test_every_backbone_delivers_every_gradient_to_its_bucket(network):
    model = get_model(network)
    opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=1.0, lr=0.1)
    model(torch.randn(2, 3, 112, 112)).square().mean().backward()
    assert all(b.state in (BucketState.LAUNCHED, BucketState.DONE) for g in opt.groups for b in g.buckets)
    assert all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in opt.grad_shards())


# ----- the collective exchange (NCCL's), proven on gloo ---------------------------------------
class _CallLog:
    """Wraps torch.distributed functions in a spawned worker: the real collective still runs;
    each call is recorded, and so is how many reduce-scatters were launched but not waited."""

    def __init__(self):
        import torch.distributed as dist

        import shardface.parallel.collectives as collectives

        self.calls, self.open, self.most_open = [], 0, 0
        for module, name in [
            (dist, "reduce"),
            (dist, "isend"),
            (dist, "broadcast"),
            (dist, "all_reduce"),
            (collectives, "_reduce_scatter"),
            (collectives, "_all_gather"),
        ]:
            setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls.append(name)
            work = fn(*args, **kwargs)
            if name != "_reduce_scatter" or work is None:
                return work
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            return _CountedWork(work, self)

        return wrapper


class _CountedWork:
    def __init__(self, work, log):
        self.work, self.log, self.waited = work, log, False

    def wait(self):
        if not self.waited:
            self.waited = True
            self.log.open -= 1
        return self.work.wait()


def _collective_worker(rank, world_size, opt_name, clip):
    log = _CallLog()
    model = TwoDtypeNet()
    cls, kw = OPTIMIZERS[opt_name]
    opt = Zero2Optimizer(
        model,
        cls,
        bucket_cap_mb=TINY_BUCKET_MB,
        step_chunk_mb=TINY_CHUNK_MB,
        exchange="collective",
        max_inflight_buckets=3,
        **kw,
    )
    buckets = sum(len(g.buckets) for g in opt.groups)
    params, norms = _zero_train(rank, world_size, opt_name, clip, model=model, opt=opt)
    x, _ = step_batch(STEPS)
    out = model(x)  # the forward pre-hook waits for the last step's all-gather
    return params, norms, out.detach(), log.calls, log.most_open, buckets


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_collective_exchange_matches_plain_torch_with_buckets_in_flight_and_no_reduce(world_size):
    for opt_name, clip in (("sgd", 0.3), ("adamw", 0.3)):
        ref_params, ref_norms = _reference(opt_name, clip)
        ref_model = TwoDtypeNet()
        ref_model.load_state_dict(ref_params)
        ref_out = ref_model(step_batch(STEPS)[0]).detach()
        for params, norms, out, calls, most_open, buckets in run_distributed(
            _collective_worker, world_size, opt_name, clip
        ):
            assert norms == pytest.approx(ref_norms, rel=1e-5) and min(ref_norms) > clip
            for name, ref in ref_params.items():
                torch.testing.assert_close(params[name], ref, rtol=1e-5, atol=1e-5, msg=f"{opt_name} {name}")
            torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
            assert buckets >= 5 and most_open >= 3  # several reductions overlapped
            # per step: one reduce-scatter and one all-gather per bucket, one all-reduce of the
            # norm; never a reduce, a point-to-point send or a broadcast
            assert calls.count("_reduce_scatter") == calls.count("_all_gather") == STEPS * buckets
            assert set(calls) == {"_reduce_scatter", "_all_gather", "all_reduce"}
            assert calls.count("all_reduce") == STEPS


def test_segmented_layout_gives_every_rank_its_share_of_every_segment():
    from shardface.parallel.flat import FlatLayout

    params = [
        ("a", nn.Parameter(torch.randn(50))),
        ("b", nn.Parameter(torch.randn(7, 11))),
        ("c", nn.Parameter(torch.randn(3))),
    ]
    for world_size in (1, 2, 3):
        for segment in (None, 40, 100):
            layouts = [FlatLayout(params, world_size, r, segment) for r in range(world_size)]
            full = torch.arange(layouts[0].numel, dtype=torch.float32)
            shards = [layout.shard_of(full) for layout in layouts]
            assert all(s.numel() == layouts[0].numel // world_size for s in shards)
            assert torch.equal(layouts[0].assemble(torch.cat(shards)), full)
            covered = torch.zeros(layouts[0].numel)
            for layout, shard in zip(layouts, shards):
                for seg, piece in zip(layout.segments, layout.pieces):  # the r-th 1/W of each
                    assert piece.global_range.start == seg.start + layout.rank * seg.size // world_size
                for slot in layout.slots:
                    for part in slot.owned:
                        whole = slot.global_range.of(full)
                        assert torch.equal(part.shard_range.of(shard), part.global_range.of(full))
                        assert torch.equal(part.param_range.of(whole), part.global_range.of(full))
                        covered[part.global_range.start : part.global_range.end] += 1
            assert covered.sum() == sum(p.numel() for _, p in params) and covered.max() == 1
            if segment:
                assert len(layouts[0].segments) > 1


def test_p2p_exchange_is_refused_under_nccl():
    from shardface.parallel.zero import resolve_exchange

    with pytest.raises(ValueError, match="exchange='p2p' is for gloo"):
        resolve_exchange("p2p", "nccl")
    assert resolve_exchange("auto", "nccl") == "collective"
    assert resolve_exchange("auto", "gloo") == "p2p"
    assert resolve_exchange("collective", "gloo") == "collective"
    with pytest.raises(ValueError, match="'ring'"):
        resolve_exchange("ring", "gloo")


# ----- norms, no_sync, schedulers, state to one rank -------------------------------------------
def _wide_net() -> nn.Module:
    """~77k weights: enough for fp32 sums of squares to depend on where the gradient is cut."""
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(7, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 5))


def _norm_worker(rank, world_size, batches=20):
    """The clipping norms of `batches` gradients from every optimizer variant, as Python floats
    (in fp32 about one batch in ten gives a norm that depends on the variant)."""
    from shardface.parallel.ddp import DDPOptimizer

    b = GLOBAL_BATCH // world_size
    norms = {}
    for variant in ("p2p", "collective", "ddp"):
        model = _wide_net()
        if variant == "ddp":
            opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1)
            net = opt.ddp
        else:
            opt = Zero2Optimizer(model, torch.optim.SGD, bucket_cap_mb=0.05, exchange=variant, lr=0.1)
            net = model
        norms[variant] = []
        for i in range(batches):
            x, y = step_batch(i)
            mse_loss(net, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
            norms[variant].append(opt.clip_grad_norm_(0.3).item())
            opt.zero_grad()
    return norms


def test_clip_norm_is_bitwise_the_same_for_ddp_and_zero2():
    # Sums of squares in fp64: how the gradient is cut between ranks no longer shows in the
    # fp32 norm (summed in fp32, 4-7 of these 20 norms differed), so DDP and ZeRO-2 clip alike
    # and train the same model (tests/test_train.py). W=2 because there the averaged gradients
    # agree bit for bit (a sum of two is order-free, halving exact); at W=3 DDP's ring sums
    # three terms in another order than ZeRO-2, which the norm then reflects.
    norms = [n for per_rank in run_distributed(_norm_worker, 2) for n in per_rank.values()]
    assert all(n == norms[0] for n in norms), norms


def _no_sync_worker(rank, world_size, exchange):
    log = _CallLog()
    model = TwoDtypeNet()
    opt = Zero2Optimizer(
        model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, exchange=exchange, lr=0.05, momentum=0.9
    )
    b = GLOBAL_BATCH // world_size
    silent = []
    for step in range(3):
        x, y = step_batch(step)
        x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
        with opt.no_sync():
            before = len(log.calls)
            (mse_loss(model, x[: b // 2], y[: b // 2]) / 2).backward()
            silent.append(len(log.calls) == before)
        (mse_loss(model, x[b // 2 :], y[b // 2 :]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return {n: t.clone() for n, t in model.state_dict().items()}, silent


@pytest.mark.parametrize("exchange", ["p2p", "collective"])
def test_no_sync_micro_batches_equal_the_full_batch_and_communicate_nothing(exchange):
    ref_model = TwoDtypeNet()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        mse_loss(ref_model, *step_batch(step)).backward()
        opt.step()
        opt.zero_grad()
    for params, silent in run_distributed(_no_sync_worker, 2, exchange):
        assert silent == [True] * 3
        for name, p in ref_model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    ],
    ids=["StepLR", "LambdaLR", "CosineAnnealingLR"],
)
def test_torch_lr_schedulers_drive_both_optimizers(make_scheduler):
    from shardface.parallel.ddp import DDPOptimizer

    plain = torch.optim.SGD(TwoDtypeNet().parameters(), lr=0.1, momentum=0.9)
    ours = [
        Zero2Optimizer(TwoDtypeNet(), torch.optim.SGD, lr=0.1, momentum=0.9),
        DDPOptimizer(TwoDtypeNet(), torch.optim.SGD, lr=0.1, momentum=0.9),
    ]
    schedulers = [make_scheduler(o) for o in [plain] + ours]
    seen = []
    for _ in range(5):
        for opt, scheduler in zip([plain] + ours, schedulers):
            opt.step()
            scheduler.step()
        seen.append(plain.param_groups[0]["lr"])
        for opt in ours:  # the lr the inner torch optimizer steps with
            assert opt.optimizer.param_groups[0]["lr"] == seen[-1]
    assert len(set(seen)) >= 3


def _to_rank_worker(rank, world_size):
    from shardface.parallel import ShardedEMA

    model = TwoDtypeNet()
    opt = Zero2Optimizer(
        model, torch.optim.AdamW, bucket_cap_mb=TINY_BUCKET_MB, exchange="collective", lr=1e-2
    )
    ema = ShardedEMA(model, decay=0.5, tau=1.0, optimizer=opt)
    _zero_train(rank, world_size, "adamw", 0.0, steps=2, model=model, opt=opt)
    ema.update()
    return opt.state_dict(), opt.state_dict(to_rank=1), ema.state_dict(), ema.state_dict(to_rank=1)


def test_state_dicts_gathered_to_one_rank_equal_the_all_gathered_ones_on_the_cpu():
    results = run_distributed(_to_rank_worker, 3)
    assert all(r[1] is None and r[3] is None for i, r in enumerate(results) if i != 1)
    everywhere, to_one, ema_everywhere, ema_to_one = results[1]
    assert to_one["param_groups"] == everywhere["param_groups"]
    for name, state in everywhere["state"].items():
        for key, value in state.items():
            assert to_one["state"][name][key].device.type == "cpu"
            torch.testing.assert_close(to_one["state"][name][key], value, rtol=0, atol=0)
    assert set(to_one["master"]) == {"scale"}  # the fp64 vector; fp32 weights are their own master
    for name, value in ema_everywhere.items():
        assert ema_to_one[name].device.type == "cpu"
        torch.testing.assert_close(ema_to_one[name], value, rtol=0, atol=0)


# ----- no host synchronisation in the optimizers ------------------------------------------------
def _host_sync_worker(rank, world_size):
    from shardface.parallel.ddp import DDPOptimizer
    from tests.host_sync import HostSyncCounter

    x, y = step_batch(0)
    b = GLOBAL_BATCH // world_size
    x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
    syncs = {}
    for variant in ("p2p", "collective", "ddp"):
        model = TwoDtypeNet()
        if variant == "ddp":
            opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=1e-2)
            net = opt.ddp
        else:
            opt = Zero2Optimizer(
                model,
                torch.optim.SGD,
                bucket_cap_mb=TINY_BUCKET_MB,
                exchange=variant,
                lr=0.1,
                momentum=0.9,
                weight_decay=1e-2,
            )
            net = model
        # (SGD: torch's AdamW reads its step count, a CPU tensor, on the host; no device wait)
        for step in range(2):  # the second step: momentum exists, an all-gather is pending
            loss = mse_loss(net, x, y)
            if variant == "ddp":  # DDP's reducer is torch's, not ours
                loss.backward()
            with HostSyncCounter() as counter:
                if variant != "ddp":
                    loss.backward()
                found_inf = opt.unscale_and_check_(1.0)
                opt.clip_grad_norm_(0.3)
                opt.step()
                opt.zero_grad()
            syncs[variant] = counter.calls
        assert found_inf.item() == 0
        scaler = DynamicLossScaler(init_scale=1.0)
        mse_loss(net, x, y).backward()
        with HostSyncCounter() as counter:
            scaler.unscale_(opt)
        syncs[variant + " scaler"] = counter.calls
    return syncs


def test_optimizers_never_make_the_host_wait_and_the_loss_scaler_once():
    for syncs in run_distributed(_host_sync_worker, 2):
        for variant in ("p2p", "collective", "ddp"):
            assert syncs[variant] == [], variant
            assert syncs[variant + " scaler"] == ["aten::_local_scalar_dense"], variant
