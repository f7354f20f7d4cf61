"""train.py end to end on a tiny generated set: learning, exact resume, resharded resume,
DDP = ZeRO-2, stop signals, divergence and corrupt checkpoints."""

import math
import os
import re
import shutil

import pytest
import torch

from shardface import train
from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.folders import resolve_checkpoint
from tests.distributed import run_distributed
from tests.log_capture import shardface_messages
from tests.train_runs import TRAIN_STEPS as STEPS
from tests.train_runs import checkpoint_tensors
from tests.train_runs import train_argv as argv


def _run(rank, world_size, args):
    return train.main(args)


def losses_in_log(output):
    text = open(os.path.join(output, "training.log")).read()
    return [float(v) for v in re.findall(r"loss ([0-9.]+|nan|inf)", text)]


@pytest.fixture(scope="module")
def runs(drawn_faces, tmp_path_factory):
    """Uninterrupted ZeRO-2 run, the same run killed at step 5 and resumed, and DDP."""
    base = tmp_path_factory.mktemp("runs")
    full, cut, ddp = str(base / "full"), str(base / "cut"), str(base / "ddp")
    assert run_distributed(_run, 2, argv(drawn_faces, full)) == [0, 0]
    assert run_distributed(_run, 2, argv(drawn_faces, cut, "--stop_after_steps", "5")) == [0, 0]
    shutil.copytree(cut, str(base / "cut_at_5"))
    assert run_distributed(_run, 2, argv(drawn_faces, cut, "--resume", "true")) == [0, 0]
    assert run_distributed(_run, 2, argv(drawn_faces, ddp, "--zero", "false")) == [0, 0]
    return {"full": full, "cut": cut, "ddp": ddp, "cut_at_5": str(base / "cut_at_5")}


def test_two_ranks_zero2_ema_chunked_head_loss_falls(runs):
    losses = losses_in_log(runs["full"])
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3


def test_killed_and_resumed_run_matches_uninterrupted_run(runs):
    a, b = checkpoint_tensors(runs["full"]), checkpoint_tensors(runs["cut"])
    assert resolve_checkpoint(runs["cut"]).endswith(f"checkpoint-{STEPS:08d}")
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_ddp_and_zero2_train_the_same_model(runs):
    # compared at step 4: the norms for clipping are summed in another order, and this batch-8
    # BatchNorm network amplifies those last bits (measured: up to 4e-5 on weights of 0.2, the
    # same every run; 1e-5 held on some code versions and not on others). A wrong averaging or
    # a lost bucket moves weights by orders of magnitude more; the per-step equality with
    # plain torch to 1e-5 is proven in tests/test_zero.py.
    a = checkpoint_tensors(os.path.join(runs["full"], "checkpoint-00000004"))
    b = checkpoint_tensors(os.path.join(runs["ddp"], "checkpoint-00000004"))
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-3, atol=2e-4, msg=key)


def _run_recording_conv_layouts(rank, world_size, args):
    """train.main, returning whether each convolution's input was channels-last (the first step's)."""
    layouts = {}

    def record(module, inputs):
        if isinstance(module, torch.nn.Conv2d) and module not in layouts:
            layouts[module] = inputs[0].is_contiguous(memory_format=torch.channels_last)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    try:
        assert train.main(args) == 0
    finally:
        handle.remove()
    return sorted(set(layouts.values()))


@pytest.mark.parametrize(
    "flag,nhwc", [((), True), (("--channels_last", "false"), False)], ids=["default", "nchw"]
)
def test_the_batch_layout_reaches_every_convolution_and_trains_the_same_losses(
    runs, drawn_faces, tmp_path, flag, nhwc
):
    # channels-last by default; the same math in either memory order (gradients equal:
    # tests/test_backbones.py); over steps, this batch-8 BatchNorm network amplifies the last
    # bits (the DDP comparison's note): the first step's loss, before any update, is held to the
    # log's four decimals, the next two to the DDP comparison's 1e-3 (an AVX-512 CPU's NCHW kernels
    # put step 3 1.8e-4 from channels-last's)
    out = str(tmp_path / "run")
    args = argv(drawn_faces, out, *flag, "--stop_after_steps", "3")
    assert run_distributed(_run_recording_conv_layouts, 2, args) == [[nhwc], [nhwc]]
    got, full = torch.tensor(losses_in_log(out)), torch.tensor(losses_in_log(runs["full"])[:3])
    torch.testing.assert_close(got[0], full[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(got, full, rtol=1e-3, atol=0)


@pytest.mark.parametrize("world_size", [1, 3])
def test_checkpoint_resumes_on_another_number_of_ranks(runs, drawn_faces, tmp_path, world_size):
    out = str(tmp_path / "resharded")
    shutil.copytree(runs["cut_at_5"], out)
    args = argv(drawn_faces, out, "--resume", "true", "--stop_after_steps", "3")
    assert run_distributed(_run, world_size, args) == [0] * world_size
    assert resolve_checkpoint(out).endswith("checkpoint-00000008")
    before, after = checkpoint_tensors(runs["cut_at_5"]), checkpoint_tensors(out)
    assert after["head"].shape == before["head"].shape == (16, 128)
    assert not torch.equal(after["head"], before["head"])
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    log = open(os.path.join(out, "training.log")).read()
    assert "resumed at step 5" in log


def test_diverging_run_never_saves_poisoned_weights_and_its_last_checkpoint_resumes(drawn_faces, tmp_path):
    """With lr 1e30 an update makes the weights huge before the loss (of the step before)
    turns non-finite: those weights must not become a checkpoint, so resuming from the last
    one with a sane lr trains on."""
    out = str(tmp_path / "nan")
    sane = ("--ema", "false", "--checkpoint_interval", "1", "--stop_after_steps", "2")
    assert train.main(argv(drawn_faces, out, *sane)) == 0
    code = train.main(
        argv(
            drawn_faces,
            out,
            "--resume",
            "true",
            "--lr",
            "1e30",
            "--max_grad_norm",
            "0",
            "--checkpoint_interval",
            "1",
            "--ema",
            "false",
        )
    )
    assert code == 3
    log = open(os.path.join(out, "training.log")).read()
    assert "training diverged" in log
    assert resolve_checkpoint(out).endswith("checkpoint-00000002")
    last = checkpoint_tensors_plain(out)
    assert all(torch.isfinite(v).all() for v in last.values() if v.is_floating_point())
    resumed = train.main(argv(drawn_faces, out, "--resume", "true", *sane))
    assert resumed == 0
    after = losses_in_log(out)[-2:]
    assert all(math.isfinite(v) for v in after), after


def test_exploding_weights_are_never_saved_though_finite(drawn_faces, tmp_path):
    """lr 1e6 multiplies the backbone's weights by ~1e5 per step: still finite, and the
    normalised head still gives a finite loss, but no checkpoint may keep them (the rule in
    utils/divergence.py); every checkpoint left has the weights' scale of the start."""
    from shardface.checkpoint.folders import list_checkpoints

    out = str(tmp_path / "exploded")
    sane = ("--max_steps", "2", "--checkpoint_interval", "2", "--ema", "false")
    assert train.main(argv(drawn_faces, out, *sane)) == 0  # a checkpoint of the start's scale, at step 2
    assert (
        train.main(
            argv(
                drawn_faces,
                out,
                "--resume",
                "true",
                "--lr",
                "1e6",
                "--checkpoint_interval",
                "1",
                "--ema",
                "false",
            )
        )
        == 3
    )
    saved = list_checkpoints(out)
    assert [step for step, _ in saved] == [2], saved  # every later step exploded: none of them was kept
    for _, ckpt in saved:
        norm = (
            sum(
                float(v.double().norm()) ** 2
                for k, v in checkpoint_tensors_plain(ckpt).items()
                if v.is_floating_point() and "running" not in k
            )
            ** 0.5
        )
        assert norm < 100, (ckpt, norm)  # 31 at start
    assert "exploded: the backbone's weight norm is" in open(os.path.join(out, "training.log")).read()


def test_embedding_norm_is_logged_and_its_growth_warned_of_once():
    """EmbeddingNormWatch: the mean norm of the added batches per report; one warning when it
    passes NORM_GROWTH_WARN times the first report's, naming the step and the factor."""
    from shardface.utils.divergence import NORM_GROWTH_WARN, EmbeddingNormWatch

    watch, calls = EmbeddingNormWatch(), []

    def report(step, scale):
        for _ in range(2):
            watch.add(torch.full((4, 8), scale / 8**0.5))  # rows of norm `scale`
        calls.append(watch(step))

    steady = shardface_messages(lambda: [report(step, 3.0 * (1 + step / 10)) for step in (1, 2, 3)])
    assert steady == [] and calls == pytest.approx([3.3, 3.6, 3.9])  # a healthy drift: no warning
    grown = shardface_messages(
        lambda: [report(step, 3.3 * NORM_GROWTH_WARN * f) for step, f in ((4, 0.9), (5, 2), (6, 50))]
    )
    assert len(grown) == 1 and "mean norm is 660 at step 5, 200 times its 3.3 at step 1" in grown[0], grown
    assert "lower lr" in grown[0]
    assert watch(7) is None  # nothing added since the last report


def test_a_batchnorm_ended_network_keeps_its_embedding_norm(runs):
    """train.py writes rank 0's embedding norm each logged step; the demo network ends in
    BatchNorm1d over 128 features, so its norm stays near sqrt(128) x the BN scale, no warning."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(runs["full"], "tensorboard"))
    events.Reload()
    norms = [e.value for e in events.Scalars("train/embedding_norm")]
    assert len(norms) == STEPS and all(0.5 < v / 128**0.5 < 2 for v in norms), norms
    assert "mean norm" not in open(os.path.join(runs["full"], "training.log")).read()


def checkpoint_tensors_plain(path):
    ckpt = resolve_checkpoint(path)
    return torch.load(os.path.join(ckpt, "backbone.pt"))


def test_corrupt_checkpoint_is_a_clear_error(drawn_faces, tmp_path, runs):
    out = str(tmp_path / "corrupt")
    shutil.copytree(runs["cut_at_5"], out)
    target = os.path.join(resolve_checkpoint(out), "optimizer.pt")
    data = open(target, "rb").read()
    open(target, "wb").write(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: corrupt or unreadable"):
        train.main(argv(drawn_faces, out, "--resume", "true", "--zero", "false"))


def test_images_skipped_on_every_rank_are_reported(tmp_path):
    from shardface.dataset.pack import write_insightface_rec
    from tests.tool_files import jpeg

    data = str(tmp_path / "with_bad")
    ids = [[jpeg((16 * c, 100, 200 - 8 * c)) for _ in range(8)] for c in range(16)]
    for c in (2, 7, 11):  # one undecodable image in three identities, never neighbours
        ids[c][3] = b"not a jpeg"
    write_insightface_rec(data, ids, 128, 16)
    out = str(tmp_path / "skips")
    # 8 steps at W=2, b=8: one epoch, every image read once
    args = argv(data, out, "--skip_bad_images", "true", "--max_steps", "8", "--frequent", "4")
    assert run_distributed(_run, 2, args) == [0, 0]
    log = open(os.path.join(out, "training.log")).read()
    assert "skipped 3 undecodable images in this job (all ranks)" in log


def test_one_loader_and_its_workers_serve_every_epoch(drawn_faces, tmp_path, monkeypatch):
    built, real = [], train.get_dataloader

    def counting(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(train, "get_dataloader", counting)
    out = str(tmp_path / "run")
    # one rank, batch 32 of 128 images: 4 steps an epoch, so 12 steps cross two epoch boundaries
    assert train.main(argv(drawn_faces, out, "--batch_size", "32", "--num_workers", "1")) == 0
    assert len(losses_in_log(out)) == STEPS  # every epoch's batches came through
    assert len(built) == 1 and built[0].persistent_workers
