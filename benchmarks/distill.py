#!/usr/bin/env python
"""Distillation's evidence (issue #29), side by side in one run, on a CPU.

Setting (not tuned on any student's result): drawn faces (scripts.make_drawn_faces).
- teacher: the demo network (configs/demo.py, tiny CNN, 128-D) trained by the demo's own recipe
  (`--teacher_epochs` epochs, one warm-up epoch, poly decay) on a large set (`--teacher_ids`
  identities x 20 images, seed 0). (The first run trained it 1500 steps without warm-up and it
  came out weaker than the students; this recipe was chosen for the teacher's strength alone,
  before any student of the second run was trained.)
- students: the same network on a small set (`--student_ids` identities x 10 images, seed 1:
  other identities), `--student_steps` steps each, no warm-up, the same seed and schedule:
  none (margin loss alone), cosine and relational (both from a teacher file of scripts.teach,
  distill_weight 1); unchanged from the first run, so "none" also checks that run's figure;
  each student once per seed of `--seeds` (default 2048, the seed of the runs before issue 40,
  and 1), so that training's variance stands beside the differences;
- verification: 10-fold accuracy (flip test) on the .bin of the large set's held-out
  identities (1000 pairs of 100), which neither the teacher nor any student trained on, and on
  a larger common set (6000 pairs of 600 identities of drawing seed 2, the same whatever the
  teacher's size; added after the first runs, whose differences were within the noise of 1000
  pairs). `--evaluate --work DIR` verifies the runs already in DIR again, training nothing.
Then the step-time overhead of an on-the-fly teacher: the student's samples/s without and with
`--teacher <teacher run>` (the median logged interval of a 40-step run; the median of 3
alternating runs each), as a ratio.

`python benchmarks/distill.py --tiny` checks the script in a minute (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from multiprocessing import Pool

import common  # noqa: F401,I001
import torch

from shardface.dataset.drawn_faces import identity_images
from shardface.eval.verification import load_bin, test, write_bin
from shardface.infer.model import load_module
from shardface.scripts.make_drawn_faces import verification_pairs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def make_set(out: str, ids: int, per_id: int, seed: int, val_ids: int, val_pairs: int) -> None:
    sh(
        "-m",
        "scripts.make_drawn_faces",
        "--output",
        out,
        "--num_ids",
        str(ids),
        "--per_id",
        str(per_id),
        "--seed",
        str(seed),
        "--val_ids",
        str(val_ids),
        "--val_per_id",
        "6",
        "--val_pairs",
        str(val_pairs),
        "--workers",
        "1",
    )


def train(data: str, ids: int, out: str, *extra: str) -> tuple[int, list[float]]:
    """Trains one process (configs/demo.py and `extra`); returns its steps and logged samples/s."""
    sh(
        "train.py",
        "configs/demo.py",
        "--rec",
        data,
        "--num_classes",
        str(ids),
        "--output",
        out,
        "--val_targets",
        "[]",
        "--num_workers",
        "1",
        "--frequent",
        "5",
        "--overwrite",
        "true",
        *extra,
    )
    log = open(os.path.join(out, "training.log")).read()
    steps = int(re.findall(r"step (\d+)/\d+", log)[-1])
    return steps, [float(v) for v in re.findall(r"([0-9.]+) samples/s", log)]


LOSSES = ("none", "cosine", "relational")
SEEDS = (2048, 1)  # 2048: the demo's (configs/schema.py), the seed of the runs before issue 40


def student_dir(loss: str, seed: int) -> str:
    return f"student_{loss}" if seed == SEEDS[0] else f"student_{loss}_seed{seed}"


def student(steps: int) -> list[str]:
    """The students' schedule: `steps` steps, no warm-up, poly decay to 0 at the last step."""
    return [
        "--max_steps",
        str(steps),
        "--num_epoch",
        "1000",
        "--warmup_epoch",
        "0",
        "--checkpoint_interval",
        str(steps),
    ]


def common_heldout(path: str, tiny: bool) -> None:
    """A second, larger verification set: identities of drawing seed 2, which neither the
    teacher (seed 0) nor any student (seed 1) trained on, the same for every teacher size."""
    if os.path.exists(path):
        return
    ids, per_id, pairs = (6, 4, 40) if tiny else (600, 6, 6000)
    with Pool(os.cpu_count() or 1) as pool:
        images = pool.starmap(identity_images, [(i, per_id, 2) for i in range(ids)])
    write_bin(path, *verification_pairs(images, pairs, 2))


def accuracy(run: str, val: str) -> float:
    return test(load_bin(val), load_module(run), 64).accuracy_flip


def train_all(args, work: str) -> None:
    big, small = os.path.join(work, "big"), os.path.join(work, "small")
    val_ids, val_pairs = (6, 40) if args.tiny else (100, 1000)
    make_set(big, args.teacher_ids, 20 if not args.tiny else 4, 0, val_ids, val_pairs)
    make_set(small, args.student_ids, 10 if not args.tiny else 4, 1, 2, 4)
    batch = ["--batch_size", "8"] if args.tiny else []

    teacher = os.path.join(work, "teacher")
    steps, _ = train(big, args.teacher_ids, teacher, "--num_epoch", str(args.teacher_epochs), *batch)
    teacher_file = os.path.join(work, "small.teacher")
    sh("-m", "scripts.teach", teacher, small, teacher_file, "--num_workers", "1", "--overwrite")
    val = os.path.join(big, "drawn_faces_val.bin")
    print(f"teacher: {accuracy(teacher, val):.4f} after {steps} steps", flush=True)  # seen before any student
    for seed in args.seeds:
        for loss in LOSSES:
            out = os.path.join(work, student_dir(loss, seed))
            extra = [] if loss == "none" else ["--teacher", teacher_file, "--distill_loss", loss]
            train(
                small,
                args.student_ids,
                out,
                *student(args.student_steps),
                *batch,
                *extra,
                "--seed",
                str(seed),
            )

    speed = {"without": [], "online teacher": []}
    for _ in range(3):  # alternating, so a slow spell of the machine touches both
        for name, extra in (("without", []), ("online teacher", ["--teacher", teacher])):
            out = os.path.join(work, f"speed_{name.replace(' ', '_')}")
            _, rates = train(
                small, args.student_ids, out, *student(40 if not args.tiny else 10), *batch, *extra
            )
            speed[name].append(statistics.median(rates[1:] or rates))  # the first interval holds the start
    speed = {name: statistics.median(rates) for name, rates in speed.items()}
    print(
        f"step time with an on-the-fly teacher / without: {speed['without'] / speed['online teacher']:.2f} "
        f"({speed['without']:.1f} vs {speed['online teacher']:.1f} samples/s)"
    )


def report(work: str, tiny: bool, seeds=SEEDS) -> None:
    """Every run of `work` on both verification sets."""
    sets = {
        "its own": os.path.join(work, "big", "drawn_faces_val.bin"),
        "common": os.path.join(work, "common_heldout.bin"),
    }
    common_heldout(sets["common"], tiny)
    print(f"\nverification (flip test) of the runs in {work}:")
    for name, path in sets.items():
        (_, issame) = load_bin(path)
        print(f"- {name}: {path}, {len(issame)} pairs")
    print("| model | seed | steps | train identities | its own set | common set |\n|---|---|---|---|---|---|")
    runs = [("teacher", "-")] + [(student_dir(loss, seed), seed) for seed in seeds for loss in LOSSES]
    for run, seed in runs:
        out = os.path.join(work, run)
        if not os.path.isfile(os.path.join(out, "training.log")):
            continue  # a seed not trained in this work folder
        steps = re.findall(r"step (\d+)/\d+", open(os.path.join(out, "training.log")).read())[-1]
        ids = json.load(open(os.path.join(out, "config.json")))["num_classes"]
        name = run.replace(f"_seed{seed}", "").replace("_", " ")
        print(
            f"| {name} | {seed} | {steps} | {ids} | "
            + " | ".join(f"{accuracy(out, path):.4f}" for path in sets.values())
            + " |"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="a one-minute check of the script")
    p.add_argument("--teacher_ids", type=int, default=400, help="identities of the teacher's set")
    p.add_argument("--teacher_epochs", type=int, default=8, help="teacher epochs (the demo's)")
    p.add_argument("--student_ids", type=int, default=40, help="identities of the students' set")
    p.add_argument("--student_steps", type=int, default=300, help="steps of every student")
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=list(SEEDS),
        help="the students' seeds (every student trained once per seed; the teacher once)",
    )
    p.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--evaluate", action="store_true", help="only verify the runs already in --work")
    args = p.parse_args()
    if args.tiny:
        args.teacher_ids, args.teacher_epochs, args.student_ids, args.student_steps = 8, 1, 4, 6
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.evaluate and not args.work:
        raise SystemExit("--evaluate needs --work")
    work = args.work or tempfile.mkdtemp(prefix="distill_bench_")
    if not args.evaluate:
        train_all(args, work)
    report(work, args.tiny, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
