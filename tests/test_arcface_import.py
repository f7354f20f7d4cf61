"""Coming from arcface_torch: a config of its keys alone trains as its train_v2 does (learning
rate, clip, margin gradient), its runs import and continue exactly, and its weights start a
fine-tuning run.

The arcface_torch run files here are written from the format as documented (per rank a
torch.save dict of epoch, global_step, state_dict_backbone, state_dict_softmax_fc,
state_optimizer, state_lr_scheduler), out of a ShardFace run's checkpoint, so that an
uninterrupted run exists to compare the continued one with."""

import os
import re
import shutil

import pytest
import torch

from shardface import builders, train
from shardface.backbones import get_model
from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.configs import get_config
from shardface.infer.weights import load_backbone_state
from shardface.losses import build_margin
from shardface.parallel.zero import Zero2Optimizer
from shardface.scripts import import_arcface_torch
from shardface.utils.schedule import lr_factor
from tests.distributed import run_distributed

BASE_LR, IMAGES, CLASSES, DIM = 0.05, 128, 16, 128
# the schedule spans 2 epochs of 8 global batches of 16; the arcface_torch run saved after epoch 1
# (step 8), and the runs compared stop after step 10 (stop_after_steps: the schedule unchanged)
SCHEDULE, CUT, STEPS = 16, 8, 10


def arcface_config(path, drawn_faces, batch_size):
    """A job config that sets arcface_torch keys only (as its configs/*.py do)."""
    with open(path, "w") as f:
        f.write(f"""from easydict import EasyDict as edict
config = edict()
config.margin_list = (1.0, 0.5, 0.0)
config.network = "tiny"
config.embedding_size = {DIM}
config.sample_rate = 1.0
config.fp16 = False
config.batch_size = {batch_size}
config.optimizer = "sgd"
config.lr = {BASE_LR}
config.momentum = 0.9
config.weight_decay = 5e-4
config.frequent = 1
config.num_workers = 0
config.seed = 2048
config.rec = {drawn_faces!r}
config.num_classes = {CLASSES}
config.num_image = {IMAGES}
config.num_epoch = 2
config.warmup_epoch = 1
config.val_targets = []
""")
    return str(path)


def losses_in_log(output):
    return re.findall(r"loss ([0-9.]+|nan|inf)", open(os.path.join(output, "training.log")).read())


def run_argv(config, output, *extra):
    return [config, "--output", output, "--checkpoint_interval", "4", "--keep_checkpoints", "0", *extra]


def polynomial_lr_warmup(n, warmup, total, base=BASE_LR, power=1.0):
    """arcface_torch's PolynomialLRWarmup as train_v2 steps it, written from its formula: the
    optimizer step that follows n scheduler steps uses base at n = 0, base * n / warmup up to
    the warmup, then base * (1 - (n - warmup) / (total - warmup)) ** power."""
    if n == 0:
        return base
    if n <= warmup:
        return base * n / warmup
    return base * (1 - (n - warmup) / (total - warmup)) ** power


def adamw_moments(weight):
    """Stand-in AdamW moments of a parameter (distinct per element, so misplaced rows show)."""
    return {"step": torch.tensor(float(CUT)), "exp_avg": weight * 0.01, "exp_avg_sq": weight**2 * 1e-3}


def write_arcface_run(ckpt, run_dir, world_size, step=CUT, epoch=1, optimizer="sgd"):
    """The arcface_torch files of a run on `world_size` ranks holding ShardFace checkpoint `ckpt`
    (with `optimizer` "adamw", its weights and `adamw_moments` of them)."""
    os.makedirs(run_dir, exist_ok=True)
    backbone = torch.load(os.path.join(ckpt, "backbone.pt"))
    saved_opt = torch.load(os.path.join(ckpt, "optimizer.pt"))["state"]
    heads = [torch.load(os.path.join(ckpt, f)) for f in sorted(os.listdir(ckpt)) if f.startswith("head-")]
    rows = torch.cat([h["weight"] for h in heads])
    momentum = torch.cat([h["state"]["momentum_buffer"] for h in heads])
    model = get_model("tiny", num_features=DIM)
    model.load_state_dict(backbone)
    base, extra = divmod(CLASSES, world_size)
    for rank in range(world_size):
        start, n = base * rank + min(rank, extra), base + int(rank < extra)
        shard = torch.nn.Parameter(rows[start : start + n].clone())
        # torch's own SGD state_dict over [backbone params, head shard], as train_v2 builds it
        groups = [{"params": list(model.parameters())}, {"params": [shard]}]
        if optimizer == "sgd":
            opt = torch.optim.SGD(groups, lr=BASE_LR, momentum=0.9, weight_decay=5e-4)
            for name, p in model.named_parameters():
                opt.state[p] = {"momentum_buffer": saved_opt[name]["momentum_buffer"].clone()}
            opt.state[shard] = {"momentum_buffer": momentum[start : start + n].clone()}
        else:
            opt = torch.optim.AdamW(groups, lr=BASE_LR, weight_decay=5e-4)
            for p in [*model.parameters(), shard]:
                opt.state[p] = adamw_moments(p.detach())
        for group in opt.param_groups:
            group["initial_lr"] = BASE_LR  # a torch scheduler adds it
        torch.save(
            {
                "epoch": epoch,
                "global_step": step,
                "state_dict_backbone": model.state_dict(),
                "state_dict_softmax_fc": {"weight": shard.detach().clone()},
                "state_optimizer": opt.state_dict(),
                "state_lr_scheduler": {
                    "last_epoch": step,
                    "base_lrs": [BASE_LR, BASE_LR],
                    "_step_count": step + 1,
                    "warmup_iters": CUT,
                    "total_iters": SCHEDULE,
                    "power": 1.0,
                    "_last_lr": [BASE_LR, BASE_LR],
                },
            },
            os.path.join(run_dir, f"checkpoint_gpu_{rank}.pt"),
        )
    torch.save(model.state_dict(), os.path.join(run_dir, "model.pt"))
    return run_dir


def checkpoint_state(path):
    ckpt = resolve_checkpoint(path)
    out = {f"backbone.{k}": v for k, v in torch.load(os.path.join(ckpt, "backbone.pt")).items()}
    for name, s in torch.load(os.path.join(ckpt, "optimizer.pt"))["state"].items():
        out[f"momentum.{name}"] = s["momentum_buffer"]
    heads = [torch.load(os.path.join(ckpt, f)) for f in sorted(os.listdir(ckpt)) if f.startswith("head-")]
    out["head"] = torch.cat([h["weight"] for h in heads])
    out["head_momentum"] = torch.cat([h["state"]["momentum_buffer"] for h in heads])
    return out


def assert_same_continuation(continued, uninterrupted):
    assert resolve_checkpoint(continued).endswith(f"checkpoint-{STEPS:08d}")
    assert losses_in_log(continued) == losses_in_log(uninterrupted)[CUT:]
    a, b = checkpoint_state(uninterrupted), checkpoint_state(continued)
    assert a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.fixture(scope="module")
def one_rank(drawn_faces, tmp_path_factory):
    """An uninterrupted run of 10 steps on one rank of an arcface_torch-keys config, with the learning
    rate of every step and the clip's parameters recorded."""
    base = tmp_path_factory.mktemp("arcface")
    config = arcface_config(base / "af_tiny.py", drawn_faces, 16)
    out = str(base / "full")
    lrs, clipped = [], []
    real_set_lr, real_clip = train.set_lr, Zero2Optimizer.clip_grad_norm_
    mp = pytest.MonkeyPatch()
    mp.setattr(train, "set_lr", lambda opts, lr: (lrs.append(lr), real_set_lr(opts, lr)))
    mp.setattr(
        Zero2Optimizer,
        "clip_grad_norm_",
        lambda self, norm, extra_params=(): (
            clipped.append((norm, len(list(extra_params)))),
            real_clip(self, norm, extra_params),
        )[1],
    )
    try:
        assert train.main(run_argv(config, out, "--stop_after_steps", str(STEPS))) == 0
    finally:
        mp.undo()
    return {"config": config, "full": out, "lrs": lrs, "clipped": clipped, "base": base}


def test_arcface_keys_alone_get_polynomial_lr_warmup_power_1_from_num_image_over_global_batch(one_rank):
    warmup, total = IMAGES // 16 * 1, IMAGES // 16 * 2
    assert (warmup, total) == (CUT, SCHEDULE)
    assert len(one_rank["lrs"]) == STEPS
    for n, lr in enumerate(one_rank["lrs"]):
        assert lr == pytest.approx(polynomial_lr_warmup(n, warmup, total), rel=1e-12, abs=1e-15), n


@pytest.mark.parametrize("warmup,power", [(0, 1.0), (3, 1.0), (3, 2.0)])
def test_poly_warmup_schedule_is_polynomial_lr_warmup_at_every_step(warmup, power):
    for n in range(13):  # past the end (10) the rate stays 0
        expected = polynomial_lr_warmup(min(n, 10), warmup, 10, base=1.0, power=power)
        assert lr_factor(n, 10, warmup, "poly_warmup", power) == pytest.approx(expected, abs=1e-15), n


def chained_polynomial_lr_warmup(n, warmup, total, power):
    """PolynomialLRWarmup stepped n times as torch schedulers step: the rate is multiplied by one
    factor per step after the warmup (and kept past the total), so any warmup < 1 never warms up."""
    lr = 1.0
    for step in range(1, n + 1):
        if step > total:
            continue
        if step <= warmup:
            lr = step / warmup
        else:
            lr *= (
                (1 - (step - warmup) / (total - warmup)) / (1 - (step - 1 - warmup) / (total - warmup))
            ) ** power
    return lr


@pytest.mark.parametrize("warmup,power", [(-4, 1.0), (-1, 2.0)])
def test_negative_warmup_as_in_3millions_is_polynomial_lr_warmup_stepped(warmup, power):
    for n in range(10):
        expected = chained_polynomial_lr_warmup(n, warmup, 10, power)
        assert lr_factor(n, 10, warmup, "poly_warmup", power) == pytest.approx(expected, abs=1e-12), n


def test_logged_lr_of_step_n_is_the_rate_it_used_and_readme_says_arcface_torch_logs_the_next(one_rank):
    logged = {
        int(n): float(lr)
        for n, lr in re.findall(
            r"step (\d+)/\d+ .*? lr ([0-9.]+)", open(os.path.join(one_rank["full"], "training.log")).read()
        )
    }
    assert sorted(logged) == list(range(1, STEPS + 1))
    for n, lr in logged.items():
        # step n trained with rate n - 1 (0-based)
        assert lr == pytest.approx(one_rank["lrs"][n - 1], abs=6e-6), n
        # arcface_torch's line for global_step n: after scheduler.step(), the rate of step n + 1
        if n < STEPS:
            assert polynomial_lr_warmup(n, CUT, SCHEDULE) == pytest.approx(one_rank["lrs"][n], abs=1e-12), n
    assert logged[4] != pytest.approx(polynomial_lr_warmup(4, CUT, SCHEDULE), abs=1e-4)  # so they differ
    readme = " ".join(
        open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "arcface_torch.md"))
        .read()
        .split()
    )
    assert (
        "the `lr` logged at step n is the rate step n trained with, where arcface_torch logs it after "
        "`scheduler.step()`, so its line for step n shows the rate of step n + 1"
    ) in readme


def test_arcface_keys_alone_clip_the_backbone_alone_at_norm_5(one_rank):
    assert one_rank["clipped"] == [(5.0, 0)] * STEPS


def test_defaults_are_arcface_torchs_scale_and_straight_through_margin_gradient():
    cfg = get_config(None)
    margin = build_margin(cfg)
    assert margin.s == 64.0
    # arcface_torch applies the angular margin under no_grad: d logit / d cos is s, not the
    # derivative of s * cos(acos(cos) + m)
    cos = torch.tensor([0.3, -0.2, 0.9], requires_grad=True)
    margin.target_logit(cos).sum().backward()
    torch.testing.assert_close(cos.grad, torch.full((3,), 64.0))


def test_imported_run_continues_as_the_uninterrupted_run_on_one_rank(one_rank, tmp_path):
    ckpt = os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}")
    run = write_arcface_run(ckpt, str(tmp_path / "af_run"), world_size=3)  # uneven: 6, 5, 5 classes
    out = str(tmp_path / "imported")
    assert import_arcface_torch.main([one_rank["config"], run, out]) == 0
    assert resolve_checkpoint(out).endswith(f"checkpoint-{CUT:08d}")
    lrs = []
    real_set_lr = train.set_lr
    mp = pytest.MonkeyPatch()
    mp.setattr(train, "set_lr", lambda opts, lr: (lrs.append(lr), real_set_lr(opts, lr)))
    try:
        assert (
            train.main(
                run_argv(one_rank["config"], out, "--resume", "true", "--stop_after_steps", str(STEPS - CUT))
            )
            == 0
        )
    finally:
        mp.undo()
    assert lrs == one_rank["lrs"][CUT:]
    assert_same_continuation(out, one_rank["full"])


def _train(rank, world_size, argv):
    return train.main(argv)


@pytest.mark.slow
def test_imported_run_continues_as_the_uninterrupted_run_on_two_ranks(drawn_faces, tmp_path):
    config = arcface_config(tmp_path / "af_tiny_w2.py", drawn_faces, 8)
    full, out = str(tmp_path / "full"), str(tmp_path / "imported")
    assert run_distributed(_train, 2, run_argv(config, full, "--stop_after_steps", str(STEPS))) == [0, 0]
    run = write_arcface_run(
        os.path.join(full, f"checkpoint-{CUT:08d}"), str(tmp_path / "af_run"), world_size=2
    )
    assert import_arcface_torch.main([config, run, out]) == 0
    resume = run_argv(config, out, "--resume", "true", "--stop_after_steps", str(STEPS - CUT))
    assert run_distributed(_train, 2, resume) == [0, 0]
    assert_same_continuation(out, full)


def test_adamw_run_imports_its_moments_per_parameter_and_head_rows_in_class_order(one_rank, tmp_path):
    ckpt = os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}")
    run = write_arcface_run(ckpt, str(tmp_path / "af"), world_size=3, optimizer="adamw")
    out = str(tmp_path / "imported")
    assert import_arcface_torch.main([one_rank["config"], run, out, "--optimizer", "adamw"]) == 0
    imported = resolve_checkpoint(out)
    backbone = torch.load(os.path.join(imported, "backbone.pt"))
    state = torch.load(os.path.join(imported, "optimizer.pt"))["state"]
    for name, p in get_model("tiny", num_features=DIM).named_parameters():
        expected = adamw_moments(backbone[name])
        assert state[name].keys() == expected.keys(), name
        for key, value in expected.items():
            torch.testing.assert_close(state[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
    heads = [
        torch.load(os.path.join(imported, f)) for f in sorted(os.listdir(imported)) if f.startswith("head-")
    ]
    assert len(heads) == 1
    rows = torch.cat(
        [
            h["weight"]
            for h in (
                torch.load(os.path.join(ckpt, f)) for f in sorted(os.listdir(ckpt)) if f.startswith("head-")
            )
        ]
    )
    torch.testing.assert_close(heads[0]["weight"], rows, rtol=0, atol=0)
    for key, value in adamw_moments(rows).items():
        torch.testing.assert_close(heads[0]["state"][key], value, rtol=0, atol=0, msg=key)
    # and it continues: AdamW resumes on this state
    assert (
        train.main(
            run_argv(
                one_rank["config"], out, "--optimizer", "adamw", "--resume", "true", "--stop_after_steps", "1"
            )
        )
        == 0
    )
    assert resolve_checkpoint(out).endswith(f"checkpoint-{CUT + 1:08d}")


def _import_error(one_rank, tmp_path, capsys, change, *overrides):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 3)
    change(run)
    assert import_arcface_torch.main([one_rank["config"], run, str(tmp_path / "out"), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert not os.path.exists(os.path.join(tmp_path, "out", "latest"))
    return err


def _drop_key(path, key):
    ckpt = torch.load(path)
    del ckpt[key]
    torch.save(ckpt, path)


@pytest.mark.parametrize(
    "change,overrides,message",
    [
        (
            lambda run: os.remove(os.path.join(run, "checkpoint_gpu_1.pt")),
            (),
            r"checkpoint_gpu_1\.pt: missing",
        ),
        (
            lambda run: os.remove(os.path.join(run, "checkpoint_gpu_2.pt")),
            (),
            r"checkpoint_gpu_0\.pt: state_dict_softmax_fc\.weight has shape \(6, 128\), rank 0 of 2 .* holds \(8, 128\)",
        ),
        (
            lambda run: _drop_key(os.path.join(run, "checkpoint_gpu_2.pt"), "state_optimizer"),
            (),
            r"checkpoint_gpu_2\.pt: key 'state_optimizer' missing",
        ),
        (
            lambda run: None,
            ("--embedding_size", "64"),
            r"checkpoint_gpu_0\.pt: state_dict_backbone does not fit network 'tiny': 'fc\.weight' has shape",
        ),
        (
            lambda run: None,
            ("--num_classes", "20"),
            r"checkpoint_gpu_0\.pt: state_dict_softmax_fc\.weight has shape",
        ),
        (
            lambda run: None,
            ("--optimizer", "adamw"),
            r"checkpoint_gpu_0\.pt: state_optimizer holds \['momentum_buffer'\]",
        ),
        (lambda run: None, ("--lr", "0.1"), r"checkpoint_gpu_0\.pt: state_lr_scheduler\.base_lrs is 0\.05"),
    ],
)
def test_bad_arcface_run_is_one_line_naming_file_and_key(
    one_rank, tmp_path, capsys, change, overrides, message
):
    assert re.search(message, _import_error(one_rank, tmp_path, capsys, change, *overrides))


class _Seen(Exception):
    pass


def first_forward_of(argv):
    """(input, output) of the backbone's first forward in a run of `argv` (which ends there)."""
    seen = []
    real = builders.build_backbone

    def record(module, args, out):
        seen.append((args[0].detach().clone(), out.detach().clone()))
        raise _Seen

    def spied(cfg):
        model = real(cfg)
        model.register_forward_hook(record)
        return model

    mp = pytest.MonkeyPatch()
    mp.setattr(builders, "build_backbone", spied)
    try:
        with pytest.raises(_Seen):
            train.main(argv)
    finally:
        mp.undo()
    return seen[0]


@pytest.mark.parametrize("form", ["arcface model.pt", "arcface checkpoint_gpu_0.pt", "shardface run"])
def test_fine_tune_run_starts_from_the_pretrained_backbone(one_rank, tmp_path, form):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 2)
    path = {
        "arcface model.pt": os.path.join(run, "model.pt"),
        "arcface checkpoint_gpu_0.pt": os.path.join(run, "checkpoint_gpu_0.pt"),
        "shardface run": one_rank["full"],
    }[form]
    images, out = first_forward_of(
        run_argv(one_rank["config"], str(tmp_path / "ft"), "--init_backbone", path)
    )
    pretrained = get_model("tiny", num_features=DIM)
    pretrained.load_state_dict(load_backbone_state(path)[0])
    exact = images.device.type == "cpu"  # GPU kernels may be chosen differently per call
    with torch.no_grad():
        expected = pretrained.to(images.device).train()(images)
        fresh = get_model("tiny", num_features=DIM).to(images.device).train()(images)
    torch.testing.assert_close(out, expected, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-5)
    assert not torch.allclose(out, fresh, atol=1e-2)


def test_fine_tune_weights_that_do_not_fit_the_network_are_refused_naming_the_key(one_rank, tmp_path):
    with pytest.raises(
        CheckpointError, match=r"init_backbone .*model\.pt: .*network 'tiny': 'fc\.weight' has shape"
    ):
        train.main(
            run_argv(
                one_rank["config"],
                str(tmp_path / "ft"),
                "--init_backbone",
                os.path.join(one_rank["full"], "model.pt"),
                "--embedding_size",
                "64",
            )
        )


def test_resume_ignores_init_backbone_with_a_log_line(one_rank, tmp_path):
    out = str(tmp_path / "again")
    shutil.copytree(one_rank["full"], out)
    assert (
        train.main(
            run_argv(
                one_rank["config"],
                out,
                "--resume",
                "true",
                "--init_backbone",
                "/no/such.pt",
                "--max_steps",
                str(STEPS),
            )
        )
        == 0
    )
    assert "init_backbone /no/such.pt ignored" in open(os.path.join(out, "training.log")).read()


def _folder_bytes(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("with_model", [True, False], ids=["model.pt", "no model.pt"])
def test_arcface_torch_run_folder_is_never_written_whatever_resume_and_overwrite_say(
    one_rank, tmp_path, capsys, with_model
):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 2)
    with open(os.path.join(run, "training.log"), "w") as f:
        f.write("arcface_torch's own log\n")
    if not with_model:
        os.remove(os.path.join(run, "model.pt"))
    before = _folder_bytes(run)
    for flags in (["--resume", "true"], ["--resume", "auto"], ["--overwrite", "true"], ["--resume", "false"]):
        argv = run_argv(one_rank["config"], run, "--num_epoch", "3", *flags)
        with pytest.raises(SystemExit) as stopped:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("sys.argv", ["train.py", *argv])
                train.cli()
        assert stopped.value.code == 2, flags
        err = capsys.readouterr().err.strip()
        assert "\n" not in err
        assert f"{run} is an arcface_torch run (checkpoint_gpu_0.pt, checkpoint_gpu_1.pt)" in err, flags
        # the import command, with the folder and this command's config overrides filled in
        command = err.split(": ")[-1]
        assert command == (
            f"python -m scripts.import_arcface_torch {one_rank['config']} {run} {run}_shardface "
            f"--checkpoint_interval 4 --keep_checkpoints 0 --num_epoch 3"
        ), flags
        assert _folder_bytes(run) == before, flags  # byte-identical, and nothing added (no run.lock, no log)


def _continue_command(printed):
    """train.py's argv in the import's 'continue with: python train.py ...' line."""
    line = printed.strip().splitlines()[-1]
    words = line.split("continue with: ", 1)[1].split()
    assert words[:2] == ["python", "train.py"]
    return words[2:]


def test_import_prints_the_resume_command_with_every_override_and_following_it_changes_nothing(
    one_rank, tmp_path, capsys
):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 3)
    out = str(tmp_path / "imported")
    overrides = ["--num_epoch", "3", "--max_grad_norm", "4.0", "--frequent", "2"]
    assert import_arcface_torch.main([one_rank["config"], run, out, *overrides]) == 0
    argv = _continue_command(capsys.readouterr().out)
    assert argv == [one_rank["config"], *overrides, "--output", out, "--resume", "true"]
    assert train.main([*argv, "--stop_after_steps", "1", "--num_workers", "0"]) == 0
    log = open(os.path.join(out, "training.log")).read()
    assert "resumed at step 8" in log and not re.search(r"config \w+ .* \(checkpoint\) ->", log)


def test_resume_with_another_config_than_the_checkpoints_names_each_changed_key(one_rank, tmp_path):
    out = str(tmp_path / "again")
    shutil.copytree(one_rank["full"], out)
    assert (
        train.main(
            run_argv(
                one_rank["config"],
                out,
                "--resume",
                "true",
                "--num_epoch",
                "3",
                "--fp16",
                "true",
                "--max_grad_norm",
                "4.0",
                "--stop_after_steps",
                "1",
            )
        )
        == 0
    )
    log = open(os.path.join(out, "training.log")).read()
    # this run's values are used: the schedule now spans 3 epochs of 8 steps
    assert (
        "config num_epoch 2 (checkpoint) -> 3 (this run): the LR schedule now spans 24 steps (arcface_torch "
        "keeps its saved total: pass --num_epoch 2 to keep it)"
    ) in log
    assert "config fp16 False (checkpoint) -> True (this run)" in log
    assert "config max_grad_norm 5.0 (checkpoint) -> 4.0 (this run)" in log
    assert "config frequent" not in log  # not a change to what is trained


@pytest.mark.parametrize(
    "ranks,batch,said",
    [
        (
            (2, 8),
            (1, 16),
            "2 ranks x 8 (checkpoint) -> 1 x 16 (this run): the same global batch of 16, so steps per "
            "epoch (8) and the LR schedule are unchanged",
        ),
        (
            (2, 8),
            (2, 4),
            "global batch 16 (checkpoint) -> 8 (this run): 16 steps per epoch now, so the LR schedule is "
            "re-spread over 32 steps; lr 0.05 is not rescaled (2 ranks x 8 (checkpoint) -> 2 x 4 (this run))",
        ),
    ],
)
def test_resume_on_another_world_size_or_batch_says_what_changes(ranks, batch, said):
    from shardface.checkpoint.changes import log_resume_changes
    from tests.log_capture import shardface_messages

    cfg = get_config(None, ["--batch_size", str(batch[1]), "--lr", "0.05"])
    meta = {"world_size": ranks[0], "batch_size": ranks[1], "config": {**cfg, "batch_size": ranks[1]}}
    assert shardface_messages(
        lambda: log_resume_changes(
            meta, cfg, batch[0], 128 // (batch[0] * batch[1]), 2 * 128 // (batch[0] * batch[1])
        )
    ) == [said]


def test_import_into_an_arcface_torch_run_folder_is_refused_and_leaves_it_as_it_was(
    one_rank, tmp_path, capsys
):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 2)
    before = _folder_bytes(run)
    assert import_arcface_torch.main([one_rank["config"], run, run]) == 2
    assert (
        f"{run} is an arcface_torch run (checkpoint_gpu_<rank>.pt): import into a new directory"
        in capsys.readouterr().err
    )
    assert _folder_bytes(run) == before


def test_import_into_a_folder_holding_an_earlier_runs_model_pt_is_refused_and_keeps_it(
    one_rank, tmp_path, capsys
):
    run = write_arcface_run(os.path.join(one_rank["full"], f"checkpoint-{CUT:08d}"), str(tmp_path / "af"), 2)
    out = tmp_path / "finished"
    out.mkdir()
    (out / "model.pt").write_bytes(b"an earlier run's weights")
    assert import_arcface_torch.main([one_rank["config"], run, str(out)]) == 2
    assert f"{out} holds model.pt of an earlier run: import into a new directory" in capsys.readouterr().err
    assert (
        sorted(os.listdir(out)) == ["model.pt"]
        and (out / "model.pt").read_bytes() == b"an earlier run's weights"
    )
