#!/usr/bin/env python
"""The whole training step, ShardFace's against arcface_torch's own, one after the other on one
device (issue 56): samples/s, ms/step, peak memory, their ratios, and the first steps' losses
of both from the same initial weights.

Both train arcface_torch's job config `configs/glint360k_<network>.py` (its margin, lr, weight
decay, fp16, schedule), batch 128, on the same batches, at world size 1:

- **ShardFace**: train.py's own step (train.Run's `forward_backward` and `optimizer_step`, built
  as train.py builds them), every other key at its default (configs/schema.py: channels-last,
  ZeRO-2, the tiled head); `--set KEY=VALUE` overrides one (`--set head_graph=true`). A plain
  `python train.py` at W=1 has no process group; neither does this half.
- **arcface_torch**, from a snapshot of insightface's `recognition/arcface_torch` passed as
  `--arcface_torch DIR`: its files are imported from DIR as they are, never copied (as the
  package `arcface_torch_snapshot`, so that its `backbones` and `losses` do not shadow ours):
  `backbones.get_model`, `PartialFC_V2`, `CombinedMarginLoss`, `PolynomialLRWarmup`. Its
  train_v2.py opens an NCCL process group when imported, so its loop body is restated around
  them: DDP (bucket_cap_mb 16, find_unused_parameters, fp16_compress_hook, static graph) over a
  W=1 group (NCCL; gloo on the CPU), one SGD over backbone and head (momentum 0.9), fp16 via
  GradScaler(growth_interval=100), the backbone clipped at norm 5, `lr_scheduler.step()` and the
  `loss.item()` its loop reads every step. Its logging callback (every 50 steps) is left out.

Same initial weights: our backbone's state dict is loaded into theirs (strict: the networks have
arcface_torch's names and shapes, tests/test_backbones.py; the line says so if they do not) and
our head's rows into PartialFC_V2's weight (at W=1 both hold every class in order). Same batches.

Classes (`--classes`): `shard` = 45,029, one rank's share of Glint360K's 360,232 classes on 8
GPUs (at W=1 its head sees this GPU's 128 rows, where an 8-GPU rank sees 1,024); `full` =
360,232, Glint360K trained on one GPU; or a number. Data: synthetic (uint8 noise, 4 batches
cycled; arcface_torch's synthetic loader also keeps its batch on the device), or `--rec DIR`, a
RecordIO set read by train.py's own loader: its first batches, decoded once before the steps
and cycled (the loader's rate is measured apart: issue 56 item 4). The timed steps exclude data.

Peak memory: torch.cuda.max_memory_allocated over each half's build and steps, less what was
allocated before it (the data batches are outside both; with --rec our half's count its decoded
uint8 batches, 4.8 MB each). Run from the repository root:
`.venv/bin/python benchmarks/whole_step.py --arcface_torch DIR [--network r50 mbf r100]`.
Without `--arcface_torch`, ours alone. `--smoke`: both at toy size (mbf, batch 2, 64 classes,
fp32, 1 timed step) on any device; `make test` runs it, so the script cannot rot. Its figures
mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass, field

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch
from common import MB, table

from shardface.parallel.user_errors import exits_on_user_error

GLINT360K = 360_232
CASES = {"shard": -(-GLINT360K // 8), "full": GLINT360K}
SNAPSHOT_FILES = ("backbones/__init__.py", "partial_fc_v2.py", "losses.py", "lr_scheduler.py")
PACKAGE = "arcface_torch_snapshot"


@dataclass
class Half:
    """One side's figures."""

    name: str
    losses: list[float] = field(default_factory=list)
    ms: float = 0.0
    peak: int | None = None
    note: str = ""


# ----- arcface_torch, read from its snapshot ------------------------------------------------------


def load_arcface_torch(root: str) -> types.SimpleNamespace:
    """arcface_torch's modules imported from the snapshot directory `root` (its
    recognition/arcface_torch), as the package `arcface_torch_snapshot`."""
    missing = [f for f in SNAPSHOT_FILES if not os.path.isfile(os.path.join(root, f))]
    if missing:
        raise SystemExit(
            f"--arcface_torch {root}: not a snapshot of insightface's recognition/arcface_torch "
            f"(no {', '.join(missing)})"
        )
    package = sys.modules.get(PACKAGE)
    if package is None or package.__path__ != [os.path.abspath(root)]:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [os.path.abspath(root)]
        sys.modules[PACKAGE] = package
    return types.SimpleNamespace(
        **{
            name: importlib.import_module(f"{PACKAGE}.{name}")
            for name in ("backbones", "partial_fc_v2", "losses", "lr_scheduler")
        }
    )


@contextlib.contextmanager
def cuda_calls_stay_on_the_cpu(device: torch.device):
    """arcface_torch's PartialFC_V2 calls `.cuda()` on what it makes; on the CPU (the smoke run)
    those calls leave tensors where they are, so its code runs unchanged."""
    if device.type == "cuda":
        yield
        return
    real = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = real


# ----- the steps ----------------------------------------------------------------------------------


def _start_peak(device: torch.device) -> int:
    """Start a half's peak: what is allocated now (the batches, a previous half's leftovers)."""
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def measure(half: Half, step, batches, device, args, base: int) -> Half:
    """`args.loss_steps` steps with their losses read, then gpu.py's timing (`args.warmup` steps,
    `args.iters` timed: CUDA events, the wall clock on the CPU). `step(images, labels)` returns
    the loss; the peak is counted above `base`."""
    from gpu import _timed

    for i in range(args.loss_steps):
        half.losses.append(float(step(*batches[i % len(batches)]).detach()))
    turn = itertools.count()
    times, peak = _timed(lambda: step(*batches[next(turn) % len(batches)]), device, args.warmup, args.iters)
    half.ms = sum(times) / len(times)
    half.peak = None if peak is None else peak - base
    return half


def ours_config(args, classes: int) -> tuple[str, list[str]]:
    """The job config and the overrides this half trains with."""
    overrides = {
        "batch_size": args.batch,
        "num_classes": classes,
        "rec": args.rec or "synthetic",
        "fp16": args.fp16,
        "num_workers": 0 if not args.rec else 2,
        "val_targets": "[]",
        "frequent": 10**9,
        "checkpoint_interval": 10**9,
        "output": args.output,
    }
    if args.smoke:
        overrides["num_image"] = 10_000
    argv = [
        item
        for key, value in overrides.items()
        for item in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))
    ]
    for pair in args.set:
        key, _, value = pair.partition("=")
        argv += [f"--{key}", value]
    return os.path.join("configs", f"glint360k_{args.network}.py"), argv


def run_ours(args, classes: int, device: torch.device):
    """train.py's step; returns (figures, the initial backbone and head weights, the batches,
    the resolved config, what the run logged about head_graph)."""
    from shardface import train
    from shardface.checkpoint.run_lock import RunLock
    from shardface.configs import get_config
    from shardface.parallel.stop import StopSignal

    config_path, argv = ours_config(args, classes)
    cfg = get_config(config_path, argv)
    batches = None if args.rec else synthetic_batches(args, classes, device)
    base = _start_peak(device)
    stop, lock, said = StopSignal(), RunLock(), io.StringIO()
    try:
        with contextlib.redirect_stdout(said):  # its log (the config, progress) goes to training.log
            run = train.Run(cfg, config_path, stop, lock)
        initial = (
            {k: v.detach().cpu().clone() for k, v in run.parts.backbone.state_dict().items()},
            run.parts.head.weight.detach().cpu().clone(),
        )
        if batches is None:
            batches = rec_batches(args, run, device)

        def step(images, labels):
            with contextlib.redirect_stdout(said):
                _, _, loss, _ = run.forward_backward(images, labels, [], True)
                run.optimizer_step()
            return loss

        half = measure(Half("ShardFace"), step, batches, device, args, base)
        run.close()
    finally:
        lock.release()
        stop.restore()
    notes = [
        line.split("] ", 1)[-1]
        for line in said.getvalue().splitlines()
        if "head_graph" in line and ": the head" in line
    ]
    return half, initial, batches, cfg, notes


def synthetic_batches(args, classes: int, device: torch.device) -> list:
    """4 batches of (uint8 noise on the device, labels on the host): what train.py's loop hands
    its step."""
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, 256, (args.batch, 3, 112, 112), dtype=torch.uint8, generator=gen).to(device),
            torch.randint(0, classes, (args.batch,), generator=gen),
        )
        for _ in range(4)
    ]


def rec_batches(args, run, device: torch.device) -> list:
    """The first `args.rec_batches` batches of train.py's loader over the RecordIO set."""
    batches = []
    for images, labels, *_ in run.loader:
        batches.append((images.to(device), labels))
        if len(batches) == args.rec_batches:
            break
    return batches


def wrapped_as_train_v2(aft, cfg, backbone, classes: int, device: torch.device):
    """(DDP backbone, PartialFC_V2 head) as arcface_torch's train_v2.py builds them: DDP with its
    options, fp16 compression hook and static graph, and the head over its CombinedMarginLoss."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    from torch.nn.parallel import DistributedDataParallel

    backbone = DistributedDataParallel(
        module=backbone,
        broadcast_buffers=False,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=16,
        find_unused_parameters=True,
    )
    backbone.register_comm_hook(None, fp16_compress_hook)
    backbone.train()
    backbone._set_static_graph()
    margin = aft.losses.CombinedMarginLoss(64, *cfg.margin_list, cfg.interclass_filtering_threshold)
    with cuda_calls_stay_on_the_cpu(device):
        pfc = aft.partial_fc_v2.PartialFC_V2(margin, cfg.embedding_size, classes, cfg.sample_rate, False)
        pfc.train().to(device)
    return backbone, pfc


def run_theirs(args, aft, cfg, classes: int, device: torch.device, initial, batches) -> Half:
    """arcface_torch's step (its train_v2.py loop body) from the snapshot's modules."""

    from shardface.dataset import normalize_images

    normalized = [(normalize_images(images), labels.to(device)) for images, labels in batches]
    by_id = {id(images): i for i, (images, _) in enumerate(batches)}
    base = _start_peak(device)  # its loader's float batches are data, as our uint8 ones are: outside the peak
    half = Half("arcface_torch")
    torch.manual_seed(cfg.seed)
    backbone = aft.backbones.get_model(
        cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size
    ).to(device)
    try:
        backbone.load_state_dict(initial[0], strict=True)
        half.note = "initial weights: ours (backbone and head)"
    except RuntimeError as e:
        half.note = f"initial weights: the head's only; the backbones differ ({str(e).splitlines()[0][:120]})"
    backbone, pfc = wrapped_as_train_v2(aft, cfg, backbone, classes, device)
    with torch.no_grad():
        pfc.weight.copy_(initial[1])
    opt = torch.optim.SGD(
        params=[{"params": backbone.parameters()}, {"params": pfc.parameters()}],
        lr=cfg.lr,
        momentum=0.9,
        weight_decay=cfg.weight_decay,
    )
    per_epoch = cfg.num_image // cfg.batch_size
    try:
        scheduler = aft.lr_scheduler.PolynomialLRWarmup(
            optimizer=opt, warmup_iters=per_epoch * cfg.warmup_epoch, total_iters=per_epoch * cfg.num_epoch
        )
    except TypeError as e:  # it passes `verbose`, which torch >= 2.7's LRScheduler no longer takes
        scheduler = None
        half.note += (
            f"; its PolynomialLRWarmup does not build on torch {torch.__version__} ({e}): its lr stays "
            f"{cfg.lr} (the schedule would move it by {1 / (per_epoch * cfg.num_epoch):.0e} per step)"
        )
    amp = torch.amp.GradScaler("cuda", growth_interval=100) if cfg.fp16 else None

    def step(images, labels):
        img, local_labels = normalized[by_id[id(images)]]
        with cuda_calls_stay_on_the_cpu(device):
            loss = pfc(backbone(img), local_labels.clone())  # it squeezes its labels in place
        if amp is not None:
            amp.scale(loss).backward()
            amp.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            amp.step(opt)
            amp.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()
        loss.item()  # its loop's AverageMeter reads the loss every step
        return loss

    return measure(half, step, batches, device, args, base)


# ----- the report ---------------------------------------------------------------------------------


def device_line(device: torch.device) -> str:
    if device.type != "cuda":
        return f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", str(device.index)],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        driver = ""
    return (
        f"{torch.cuda.get_device_name(device)}, driver {driver or 'unknown'}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    )


def report(args, classes: int, ours: Half, theirs: Half | None, notes: list[str]) -> None:
    def row(h: Half) -> dict:
        return {
            "step": h.name,
            "network": args.network,
            "classes": f"{classes:,}",
            "batch": args.batch,
            "precision": "fp16" if args.fp16 else "fp32",
            "samples/s": f"{args.batch * 1e3 / h.ms:.0f}",
            "ms/step": f"{h.ms:.2f}",
            "peak MB": "n/a" if h.peak is None else f"{h.peak / MB:.0f}",
        }

    rows = [row(ours)] + ([row(theirs)] if theirs else [])
    print(
        f"\n{args.network}, {classes:,} classes, batch {args.batch}, "
        f"{'RecordIO ' + args.rec if args.rec else 'synthetic data'}: {args.iters} steps timed after "
        f"{args.loss_steps + args.warmup} untimed"
    )
    print(table(rows, list(rows[0])))
    for note in notes:
        print(f"ours: {note}")
    if theirs is None:
        print("arcface_torch: not run (no --arcface_torch DIR)")
        return
    peak = "n/a" if ours.peak is None or not theirs.peak else f"{ours.peak / theirs.peak:.2f}x"
    print(f"ours / arcface_torch: samples/s {theirs.ms / ours.ms:.2f}x, peak memory {peak}; {theirs.note}")
    losses = [
        {"step": i + 1, "ours": f"{a:.4f}", "arcface_torch": f"{b:.4f}", "|diff|": f"{abs(a - b):.2e}"}
        for i, (a, b) in enumerate(zip(ours.losses, theirs.losses))
    ]
    print("first steps' losses (the same batches):")
    print(table(losses, list(losses[0])))


@exits_on_user_error  # a bad --set, --rec or class count: train.py's one-line errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arcface_torch", metavar="DIR", help="a snapshot of insightface's recognition/arcface_torch"
    )
    p.add_argument("--network", choices=["r50", "r100", "mbf"], nargs="+", default=["r50", "mbf"])
    p.add_argument(
        "--classes",
        nargs="+",
        default=["shard", "full"],
        help="shard (45,029: Glint360K over 8 GPUs), full (360,232: one GPU) or a number",
    )
    p.add_argument("--batch", type=int, default=128)
    p.add_argument(
        "--rec",
        help="a RecordIO set (train.rec, train.idx, property) instead of synthetic data; "
        "--classes then its number of classes",
    )
    p.add_argument("--rec_batches", type=int, default=8, help="with --rec: batches read once, then cycled")
    p.add_argument("--loss_steps", type=int, default=5, help="first steps whose losses are printed")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key of ours (e.g. head_graph=true); repeatable",
    )
    p.add_argument(
        "--smoke", action="store_true", help="toy sizes, fp32, on any device (figures mean nothing)"
    )
    args = p.parse_args(argv)
    # arcface_torch's calls torch deprecates (torch.cuda.amp.autocast, DDP's broadcast_buffers) warn every time
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=true.*_set_static_graph.*")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    args.fp16 = cuda and not args.smoke
    if args.smoke:
        args.network, args.batch = ["mbf"], 2
        args.classes = args.classes if args.rec else ["64"]
        args.loss_steps, args.warmup, args.iters = 2, 0, 1
    elif not cuda:
        print(
            "benchmarks/whole_step.py: no CUDA device on this machine; nothing measured (--smoke runs "
            "both at toy size on the CPU)"
        )
        return 0
    cases = [CASES[c] if c in CASES else int(c) for c in args.classes]
    if args.rec and any(c in CASES for c in args.classes):
        p.error("with --rec, --classes is the set's number of classes")
    aft = load_arcface_torch(args.arcface_torch) if args.arcface_torch else None
    if cuda:
        torch.cuda.set_device(device)
    print(device_line(device) + ("  (--smoke: toy sizes, the figures mean nothing)" if args.smoke else ""))
    # ours first, every case (a W=1 train.py has no process group; arcface_torch's half needs one)
    runs = []
    for network, classes in [(n, c) for n in args.network for c in cases]:
        case = argparse.Namespace(**{**vars(args), "network": network})
        case.output = tempfile.mkdtemp(prefix="whole_step_")
        try:
            runs.append((case, classes, *run_ours(case, classes, device)))
        finally:
            shutil.rmtree(case.output, ignore_errors=True)
        if cuda:
            torch.cuda.empty_cache()
    if aft is not None:
        _group()
    for case, classes, ours, initial, batches, cfg, notes in runs:
        theirs = run_theirs(case, aft, cfg, classes, device, initial, batches) if aft is not None else None
        if cuda:
            torch.cuda.empty_cache()
        report(case, classes, ours, theirs, notes)
    return 0


def _group() -> None:
    """A world-size-1 process group (NCCL on a GPU, gloo on the CPU), made once."""
    import torch.distributed as dist
    from gpu import _process_group

    if not dist.is_initialized():
        _process_group()


if __name__ == "__main__":
    sys.exit(main())
