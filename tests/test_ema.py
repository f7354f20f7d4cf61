"""The sharded EMA equals a plain full EMA with d = decay * (1 - exp(-updates / tau))."""

import math

import pytest
import torch
import torch.distributed as dist

from shardface.parallel import ShardedEMA, Zero2Optimizer
from tests.distributed import run_distributed
from tests.tiny_net import GLOBAL_BATCH, TINY_BUCKET_MB, TwoDtypeNet, mse_loss, step_batch

DECAY, TAU, STEPS = 0.9, 3.0, 5


def _plain_ema_run():
    """One process, plain SGD on the global batch, a textbook per-tensor EMA."""
    model = TwoDtypeNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    for step in range(STEPS):
        x, y = step_batch(step)
        mse_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        d = DECAY * (1 - math.exp(-(step + 1) / TAU))
        for n, p in model.named_parameters():
            ema[n] = d * ema[n] + (1 - d) * p.detach().double()
    return ema


def _sharded_ema_worker(rank, world_size, with_zero, exchange="auto"):
    model = TwoDtypeNet()
    if with_zero:
        opt = Zero2Optimizer(
            model, torch.optim.SGD, bucket_cap_mb=TINY_BUCKET_MB, exchange=exchange, lr=0.1, momentum=0.9
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = ShardedEMA(model, decay=DECAY, tau=TAU, optimizer=opt if with_zero else None)
    b = GLOBAL_BATCH // world_size
    for step in range(STEPS):
        x, y = step_batch(step)
        mse_loss(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
        if not with_zero and world_size > 1:  # what DDP does
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
        opt.zero_grad()
        ema.update()
    shard_sizes = [s.numel() for s in ema.shards]
    return ema.state_dict(), shard_sizes, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "with_zero,exchange",
    [pytest.param(True, "p2p", marks=pytest.mark.slow), (True, "collective"), (False, "auto")],
)
def test_sharded_ema_matches_full_ema(with_zero, exchange):
    # collective: the master shard is a piece of every bucket, the fp32 one views of the weights
    ref = _plain_ema_run()
    for state, shard_sizes, total in run_distributed(_sharded_ema_worker, 3, with_zero, exchange):
        for name, value in ref.items():
            torch.testing.assert_close(state[name].double(), value, rtol=1e-6, atol=1e-6)
        assert sum(shard_sizes) * 3 < total + 3 * 2 * 16 * 3  # each rank holds ~1/W (plus padding)


def _roundtrip_worker(rank, world_size, path, phase):
    model = TwoDtypeNet()
    ema = ShardedEMA(model, decay=DECAY, tau=TAU)
    if phase == "save":
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        for _ in range(3):
            ema.update()
        state = ema.state_dict()
        if rank == 0:
            torch.save({"ema": state, "updates": ema.updates}, path)
        return state
    saved = torch.load(path, weights_only=True)
    ema.load_state_dict(saved["ema"], updates=saved["updates"])
    assert ema.updates == 3
    return ema.state_dict()


def test_ema_state_dict_round_trips_across_world_sizes(tmp_path):
    path = str(tmp_path / "ema.pt")
    saved = run_distributed(_roundtrip_worker, 2, path, "save")[0]
    for world_size in (1, 3):
        for state in run_distributed(_roundtrip_worker, world_size, path, "load"):
            for name, value in saved.items():
                torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_ema_module_holds_ema_weights_and_live_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    ema = ShardedEMA(model, decay=0.5, tau=1e-9)
    start = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.add_(2.0)
    model.train()(torch.randn(8, 4))  # moves BatchNorm running statistics
    ema.update()
    copy = ema.ema_module()
    torch.testing.assert_close(copy[0].weight, start + 1.0)
    torch.testing.assert_close(copy[1].running_mean, model[1].running_mean)
