#!/usr/bin/env python
"""Parity on real faces (issue #64): one network and one recipe trained twice at W=2, by
arcface_torch's own code and by train.py, on the same packed faces; then both verified on LFW
(and CFP) from the photos.

    .venv/bin/python benchmarks/parity.py --rec REC --arcface_torch DIR --lfw LFW --pairs_list pairs.txt \\
        [--cfp CFP_ROOT] [--arms ...] [--seeds 1 2] [--work work_dirs/parity]

- **recipe**: `configs/parity.py`, read by both halves (train.py as its job config; the
  arcface_torch half through `configs.get_config`, so an override reaches both alike).
- **arcface_torch**: its pieces imported from a snapshot of insightface's
  `recognition/arcface_torch` (`--arcface_torch DIR`, as benchmarks/whole_step.py imports them,
  never copied): `backbones.get_model`, `CombinedMarginLoss`, `PartialFC_V2`,
  `PolynomialLRWarmup`. Its train_v2.py loop body is restated around them under torchrun: DDP
  with its options and fp16 compression hook, one SGD over backbone and head, the backbone
  clipped at norm 5, `lr_scheduler.step()` each step. Two things are not its own: the batches
  come from ShardFace's loader (its loader needs mxnet; both halves read the same records, with
  the same mirroring), and PolynomialLRWarmup is built without the `verbose` argument that
  torch >= 2.7 no longer takes (its schedule is its own `get_lr`). Its fp16 compression hook
  casts the gradients before the all-reduce, also in fp32 training: gradients past fp16's range
  (65504) become inf and the weights NaN. The smoke run's noise does that in its first step
  (random weights, gradients near 1e11), so the smoke accepts it for this half, saying so; a
  real run that diverges is reported, not hidden.
- **ShardFace**: `train.py configs/parity.py` under torchrun, every other key at its default
  (channels-last, ZeRO-2); the arm `shardface exact` adds `--straight_through false`, the
  margin's exact derivative.
- **time**: each run's wall time, the torchrun launch included, and samples/s. Time the runs on
  a quiet machine, one after another. Each half keeps its weights at every epoch's end, as
  train_v2.py saves model.pt then (arcface_torch: `epoch-K.pt`; ShardFace: a checkpoint per
  epoch), and the report finds the epoch from which ShardFace's weights reach arcface_torch's
  final LFW accuracy (flip test, the same seed) and stay there (walked back from the last): the
  time to reach it is that file's time since the launch.
- **verification**: as benchmarks/real_faces.py's (its faces and caches): LFW view 2, all 6,000
  pairs from the photos, and with `--cfp` CFP's FP and FF, single view and flip test.

A finished run is kept and not trained again (`--evaluate`: the table of finished runs). `--smoke`
trains each half a few steps on synthetic data at toy size and loads each model (nothing else),
so that the script cannot rot; `make test` runs it. Research data: nothing of the faces is
written into the repository (the work folder is under the ignored work_dirs/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401,I001
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/parity.py"
ARMS = {"arcface_torch": None, "shardface": [], "shardface exact": ["--straight_through", "false"]}
SMOKE = ["--network", "mbf", "--batch_size", "2", "--embedding_size", "64", "--max_steps", "2"]


def launch(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def run_dir(work: str, arm: str, seed: int) -> str:
    return os.path.join(work, "runs", f"{arm.replace(' ', '_')}_seed{seed}")


def model_of(run: str, arm: str) -> str:
    """What load_model takes for a run: arcface_torch's model.pt, or ShardFace's run folder."""
    return os.path.join(run, "model.pt") if arm == "arcface_torch" else run


def train(args, arm: str, seed: int, recipe: list[str]) -> None:
    """One arm's run at W=`--nproc`; its wall time and samples/s go into `timing.txt`."""
    out = run_dir(args.work, arm, seed)
    if os.path.isfile(os.path.join(out, "timing.txt")):
        return
    os.makedirs(out, exist_ok=True)
    keys = [*recipe, "--seed", str(seed), "--output", out]
    if arm == "arcface_torch":
        command = [*launch(args.nproc), __file__, "--worker", "--arcface_torch", args.arcface_torch, *keys]
    else:
        every = ["--checkpoint_interval", str(steps_per_epoch(recipe, args.nproc)), "--keep_checkpoints", "0"]
        command = [*launch(args.nproc), "train.py", CONFIG, *keys, *every, *ARMS[arm]]
    print(f"training {arm}, seed {seed} -> {out}", flush=True)
    with open(os.path.join(out, "started.txt"), "w") as f:
        f.write(f"{time.time():.3f}\n")
    t = time.perf_counter()
    with open(os.path.join(out, "console.log"), "w") as log:
        done = subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{arm}, seed {seed}: exit {done.returncode}; see {out}/console.log")
    if arm == "arcface_torch":
        samples = int(open(os.path.join(out, "samples.txt")).read())
    else:
        samples = _trained_samples(out)
    with open(os.path.join(out, "timing.txt"), "w") as f:
        f.write(f"{wall:.1f} {samples}\n")


def steps_per_epoch(recipe: list[str], nproc: int) -> int:
    """Each rank's batches per epoch, as training's sampler counts them."""
    from shardface.configs import get_config
    from shardface.dataset.loader import ResumableDistributedSampler

    cfg = get_config(CONFIG, recipe)
    return ResumableDistributedSampler(cfg.num_image, nproc, 0, cfg.batch_size).batches_per_epoch


def epoch_models(run: str, arm: str) -> list[tuple[str, float]]:
    """(the weights kept at an epoch's end, seconds from the launch to their writing), in order."""
    from shardface.checkpoint.folders import list_checkpoints

    if arm == "arcface_torch":
        paths = sorted(os.path.join(run, f) for f in os.listdir(run) if f.startswith("epoch-"))
    else:
        paths = [folder for _, folder in list_checkpoints(run)]
    started = float(open(os.path.join(run, "started.txt")).read())
    return [(p, _written(p) - started) for p in paths]


def _written(path: str) -> float:
    """When a file, or the last file of a folder, was written."""
    if os.path.isfile(path):
        return os.path.getmtime(path)
    return max(os.path.getmtime(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def timing(run: str) -> tuple[float, int]:
    """(wall seconds, samples trained) of a finished run, as `train` wrote them."""
    wall, samples = open(os.path.join(run, "timing.txt")).read().split()
    return float(wall), int(samples)


def _trained_samples(run: str) -> int:
    """The samples train.py's run trained: its steps times the global batch (from its checkpoint)."""
    from shardface.checkpoint.folders import find_checkpoint

    meta = torch.load(os.path.join(find_checkpoint(run), "meta.pt"), map_location="cpu", weights_only=True)
    return int(meta["step"]) * int(meta["batch_size"]) * int(meta["world_size"])


def worker(argv: list[str]) -> None:
    """arcface_torch's half, one rank of it (started by torchrun): see the module docstring."""
    import torch.distributed as dist
    from whole_step import cuda_calls_stay_on_the_cpu, load_arcface_torch, wrapped_as_train_v2

    from shardface.configs import get_config
    from shardface.dataset import build_dataset, normalize_images
    from shardface.dataset.loader import ResumableDistributedSampler, get_dataloader

    snapshot = argv[argv.index("--arcface_torch") + 1]
    rest = [
        a for i, a in enumerate(argv) if a != "--arcface_torch" and argv[i - 1 : i] != ["--arcface_torch"]
    ]
    cfg = get_config(CONFIG, rest)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    aft = load_arcface_torch(snapshot)
    torch.manual_seed(cfg.seed)
    backbone = aft.backbones.get_model(
        cfg.network, dropout=0.0, fp16=cfg.fp16, num_features=cfg.embedding_size
    ).to(device)
    backbone, pfc = wrapped_as_train_v2(aft, cfg, backbone, cfg.num_classes, device)
    opt = torch.optim.SGD(
        params=[{"params": backbone.parameters()}, {"params": pfc.parameters()}],
        lr=cfg.lr,
        momentum=cfg.momentum,
        weight_decay=cfg.weight_decay,
    )
    dataset = build_dataset(cfg.rec, cfg.num_classes, normalize=False)
    sampler = ResumableDistributedSampler(len(dataset), world, rank, cfg.batch_size, cfg.seed, source=cfg.rec)
    loader = get_dataloader(dataset, sampler, cfg.num_workers, device, cfg.seed)
    per_epoch = sampler.batches_per_epoch
    total = min(per_epoch * cfg.num_epoch, cfg.max_steps or per_epoch * cfg.num_epoch)
    scheduler = _polynomial(aft, opt, per_epoch * cfg.warmup_epoch, per_epoch * cfg.num_epoch)
    step = 0
    for epoch in range(cfg.num_epoch):
        sampler.set_epoch(epoch)
        dataset.set_epoch(epoch, cfg.seed)
        for images, labels in loader:
            images = normalize_images(images.to(device, non_blocking=True))
            with cuda_calls_stay_on_the_cpu(device):
                loss = pfc(backbone(images), labels.to(device).clone())  # it squeezes its labels in place
            loss.backward()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            opt.step()
            opt.zero_grad()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.frequent == 0:
                print(f"step {step}/{total} epoch {epoch} loss {loss.item():.4f}", flush=True)
            if step == total:
                break
        if rank == 0:  # as train_v2.py saves model.pt at each epoch's end; kept for the time to reach
            torch.save(backbone.module.state_dict(), os.path.join(cfg.output, f"epoch-{epoch + 1:03d}.pt"))
        if step == total:
            break
    if rank == 0:
        torch.save(backbone.module.state_dict(), os.path.join(cfg.output, "model.pt"))
        with open(os.path.join(cfg.output, "config.json"), "w") as f:  # names the network for load_model
            json.dump(dict(cfg), f, indent=1)
        with open(os.path.join(cfg.output, "samples.txt"), "w") as f:
            f.write(f"{step * cfg.batch_size * world}\n")
    dist.barrier()
    dist.destroy_process_group()


def _polynomial(aft, opt, warmup: int, total: int):
    """arcface_torch's PolynomialLRWarmup (its `get_lr`), built as its __init__ builds it, less the
    `verbose` argument torch >= 2.7's LRScheduler refuses."""

    class Schedule(aft.lr_scheduler.PolynomialLRWarmup):
        def __init__(self):
            torch.optim.lr_scheduler.LRScheduler.__init__(self, opt)
            self.total_iters, self.power, self.warmup_iters = total, 1.0, warmup

    return Schedule()


def report(args, recipe_note: str) -> None:
    """The table of the finished runs on each pair list, with each arm's means and deviations."""
    from real_faces import list_faces, list_scores

    runs = [(arm, seed, run_dir(args.work, arm, seed)) for arm in args.arms for seed in args.seeds]
    runs = [r for r in runs if os.path.isfile(os.path.join(r[2], "timing.txt"))]
    lists = [("LFW view 2", args.pairs_list, args.lfw, None)]
    lists += [(f"CFP-{p}", args.cfp, None, p) for p in ("FP", "FF") if args.cfp]
    scores, lfw = {}, None
    for title, path, images, protocol in lists:
        pair_list, faces = list_faces(args, path, images, protocol)
        lfw = lfw or (pair_list, faces)  # the first list's, for the time to reach
        for arm, seed, run in runs:
            scores[arm, seed, title] = list_scores(args, path, pair_list, faces, model_of(run, arm))
    print(f"\n{recipe_note}\n")
    head = " | ".join(f"{t} acc | {t} flip" for t, *_ in lists)
    print(f"| code / arm | seed | {head} | wall min | samples/s |")
    print("|---|---" + "|---" * (2 * len(lists) + 2) + "|")
    for arm in args.arms:
        mine = [(seed, run) for a, seed, run in runs if a == arm]
        for seed, run in mine:
            wall, samples = timing(run)
            cells = " | ".join(
                f"{scores[arm, seed, t][0]:.4f} | {scores[arm, seed, t][2]:.4f}" for t, *_ in lists
            )
            print(f"| {arm} | {seed} | {cells} | {wall / 60:.1f} | {samples / wall:.1f} |")
        if len(mine) > 1:
            cells = []
            for t, *_ in lists:
                for i in (0, 2):
                    values = [scores[arm, seed, t][i] for seed, _ in mine]
                    cells.append(f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}")
            walls = [timing(r)[0] for _, r in mine]
            print(f"| {arm}: mean ± sd | - | {' | '.join(cells)} | {statistics.mean(walls) / 60:.1f} | |")
    time_to_reach(args, runs, {k: v[2] for k, v in scores.items() if k[2] == lists[0][0]}, *lfw)


def time_to_reach(args, runs, final: dict, pair_list, faces) -> None:
    """For each ShardFace run beside arcface_torch's of its seed: the epoch from which its weights
    reach arcface_torch's final LFW accuracy (flip test) and stay at or above it to the end, and
    when those weights were written. Walked back from the last epoch, each epoch verified once (the
    last epoch's are the final model's, whose embeddings the table cached)."""
    from real_faces import list_scores

    theirs = {seed: run for arm, seed, run in runs if arm == "arcface_torch"}
    print(
        "\n| arm | seed | arcface_torch's final LFW flip | reached from | LFW flip there | time "
        "| arcface_torch's wall | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for arm, seed, run in runs:
        if arm == "arcface_torch" or seed not in theirs:
            continue
        target, wall = final["arcface_torch", seed, "LFW view 2"], timing(theirs[seed])[0]
        epochs = epoch_models(run, arm)
        reached = None  # (epoch, accuracy, seconds) of the earliest epoch of the last run that reaches
        for k in range(len(epochs), 0, -1):
            path, seconds = epochs[k - 1]
            acc = list_scores(args, args.pairs_list, pair_list, faces, path)[2]
            if acc < target:
                break
            reached = (k, acc, seconds)
        if reached is None:
            print(
                f"| {arm} | {seed} | {target:.4f} | not reached in {len(epochs)} epochs | {acc:.4f} | - "
                f"| {wall / 60:.1f} min | - |"
            )
            continue
        k, acc, seconds = reached
        print(
            f"| {arm} | {seed} | {target:.4f} | epoch {k} of {len(epochs)} | {acc:.4f} | "
            f"{seconds / 60:.1f} min | {wall / 60:.1f} min | {seconds / wall:.2f}x |"
        )


def smoke(args) -> None:
    """Each half a few steps at toy size on synthetic data; each model loads and embeds."""
    from shardface.errors import ModelError
    from shardface.infer.model import load_model

    recipe = ["--rec", "synthetic", "--num_classes", "64", "--num_epoch", "1", "--num_workers", "0", *SMOKE]
    arms = ["shardface"] + (["arcface_torch"] if args.arcface_torch else [])
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        for arm in arms:
            train(args, arm, 1, recipe)
            wall, samples = timing(run_dir(work, arm, 1))
            try:
                model = load_model(model_of(run_dir(work, arm, 1), arm))
            except ModelError as exc:  # see the module docstring: noise overflows its fp16 hook
                if arm != "arcface_torch" or "non-finite" not in str(exc):
                    raise
                print(f"smoke {arm}: {samples} samples in {wall:.1f} s, weights non-finite")
                continue
            emb = model.embed_crops(torch.zeros(2, 3, 112, 112, dtype=torch.uint8))
            print(f"smoke {arm}: {samples} samples in {wall:.1f} s, embeddings {tuple(emb.shape)}")
    if not args.arcface_torch:
        print("arcface_torch: not run (no --arcface_torch DIR)")


def main() -> None:
    if "--worker" in sys.argv:
        worker([a for a in sys.argv[1:] if a != "--worker"])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rec", help="the packed training set (pack_rec's folder)")
    p.add_argument("--arcface_torch", help="a snapshot of insightface's recognition/arcface_torch")
    p.add_argument("--lfw", help="LFW's folder: FOLDER/name/name_000n.jpg")
    p.add_argument("--pairs_list", help="LFW's pairs.txt (view 2)")
    p.add_argument("--cfp", default=None, help="a CFP root: its FP and FF protocols too")
    p.add_argument("--work", default=os.path.join(ROOT, "work_dirs", "parity"))
    p.add_argument("--cache_dir", default=None, help="the LFW faces' and embeddings' cache")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num_epoch", type=int, default=None, help="overrides the recipe's, for both halves")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="face-finding processes")
    p.add_argument("--evaluate", action="store_true", help="only the table of the finished runs")
    p.add_argument("--smoke", action="store_true", help="both halves at toy size (figures mean nothing)")
    args = p.parse_args()
    if args.smoke:
        smoke(args)
        return
    if not (args.rec and args.lfw and args.pairs_list):
        p.error("--rec, --lfw and --pairs_list are needed (or --smoke)")
    args.work = os.path.abspath(args.work)
    from shardface.dataset import build_dataset

    with open(os.path.join(args.rec, "property")) as f:
        classes = int(f.read().split(",")[0])
    recipe = ["--rec", os.path.abspath(args.rec), "--num_classes", str(classes)]
    recipe += ["--num_image", str(len(build_dataset(args.rec, classes)))]
    recipe += ["--num_epoch", str(args.num_epoch)] if args.num_epoch else []
    if not args.evaluate:
        if "arcface_torch" in args.arms and not args.arcface_torch:
            p.error("the arm arcface_torch needs --arcface_torch DIR")
        for seed in args.seeds:  # every arm's first seed before any second
            for arm in args.arms:
                train(args, arm, seed, recipe)
    report(args, f"recipe: {CONFIG} {' '.join(recipe)}, W={args.nproc}")


if __name__ == "__main__":
    main()
