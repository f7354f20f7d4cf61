#!/usr/bin/env python
"""Models trained here on real people, verified on LFW's own protocol (issue #36 item 4, #40).

    .venv/bin/python benchmarks/real_faces.py --celeb CELEB_ID_FOLDER --lfw LFW_FOLDER \\
        --pairs_list pairs.txt [--cfp CFP_ROOT] [--arms ...] [--seeds 1 2] [--work work_dirs/real_faces]

The setting, fixed before the first run (configs/real_faces.py; nothing tuned on a result):
- **data**: the CelebA photos (one sub-folder per person) and the photos of the LFW people who
  appear in no pair of pairs.txt, aligned once with `scripts.align` (`--workers`: every core) into 112 crops,
  then packed with `scripts.pack_rec`: `rec_celeb` (CelebA's people, labelled) and `rec_all`
  (every face, for label-free training). LFW people who appear in the pairs are never trained on.
- **teacher**: MODEL `dlib`, through `scripts.teach` teacher files of each packed set.
- **arms** (ARMS below): the demo network and `mbf`, margin alone, margin + distillation and
  label-free, with centred targets and without; the demo network's margin and label-free arms
  again for 40 epochs instead of 10 (does a patient teacher help?); `r18` from scratch;
  `dlib_resnet` fine-tuned from `dlib` (`init_backbone dlib`) with a new head. Each arm with each
  seed is one 2-rank run of train.py; a finished run is kept and not trained again, so the lot
  spans sessions.
- **verification**: LFW view 2, all 6,000 pairs from the photos, each model's own crop, faces
  found as `benchmarks/lfw_anchor.py` finds them (HOG, then --retry_upsample 2, --retry_mmod, then
  the fallback face; cached beside the list): 10-fold accuracy and its std over the folds, single
  view and flip test. CelebA's people are numbers: an overlap with LFW's cannot be ruled out.
  `--cfp CFP_ROOT` adds CFP's FP and FF protocols (issue #55), all 7,000 pairs each on CFP's own
  folds, faces found as `scripts.verify --pairs_list CFP_ROOT --protocol FP|FF --retry_upsample 2
  --retry_mmod` finds them (the same caches, in the root).
- `--speed`: each network's embedding speed (112 crops, or dlib's 150 chips, batches of 64) on
  one thread and on all, against MODEL dlib's, in torch and exported to onnxruntime, training
  nothing. Time it on a quiet machine.

Every run made is reported, with its wall time; `--evaluate` prints the table of the finished
runs without training. Research data: nothing of LFW or CelebA is written into the repository
(the work folder is under the ignored work_dirs/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import common  # noqa: F401,I001
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/real_faces.py"
SEEDS = (1, 2)
# arm: (network, the packed set, extra train.py options; TEACHER: the set's teacher file)
ARMS = {
    "demo margin": ("tiny", "celeb", ["--embedding_size", "128"]),
    "demo margin + cosine (centred)": ("tiny", "celeb", ["--embedding_size", "128", "--teacher", "TEACHER"]),
    "demo label-free, raw": (
        "tiny",
        "all",
        ["--embedding_size", "128", "--teacher", "TEACHER", "--distill_center", "false"],
    ),
    "demo label-free, centred": ("tiny", "all", ["--embedding_size", "128", "--teacher", "TEACHER"]),
    # a patient teacher (Beyer et al. 2022: distillation gains from long schedules): the same arm for
    # 4x the epochs, with the margin head's twin as the control; 40 fixed before either ran, by the
    # CPU time two seeds of both were expected to take here (~100 min; they took 53)
    "demo label-free, centred, 40 epochs": (
        "tiny",
        "all",
        ["--embedding_size", "128", "--teacher", "TEACHER", "--num_epoch", "40"],
    ),
    "demo margin, 40 epochs": ("tiny", "celeb", ["--embedding_size", "128", "--num_epoch", "40"]),
    "mbf margin": ("mbf", "celeb", []),
    "mbf margin + cosine": ("mbf", "celeb", ["--teacher", "TEACHER"]),
    "mbf margin + relational": ("mbf", "celeb", ["--teacher", "TEACHER", "--distill_loss", "relational"]),
    "mbf label-free, raw": ("mbf", "all", ["--teacher", "TEACHER", "--distill_center", "false"]),
    "mbf label-free, centred": ("mbf", "all", ["--teacher", "TEACHER"]),
    "r18 margin": ("r18", "celeb", []),
    "dlib_resnet fine-tuned": (
        "dlib_resnet",
        "celeb",
        ["--init_backbone", "dlib", "--embedding_size", "128"],
    ),
    # the recipe's lr 0.1 destroyed dlib's network (no BatchNorm: embeddings grew to ~1e7, LFW at
    # chance); a tenth of it, fixed before this arm's first run, the usual fine-tuning rate
    "dlib_resnet fine-tuned, lr 0.01": (
        "dlib_resnet",
        "celeb",
        ["--init_backbone", "dlib", "--embedding_size", "128", "--lr", "0.01"],
    ),
}


def sh(*args: str, log: str | None = None) -> None:
    """Runs a command from the repository root; its output into `log` (or shown)."""
    out = open(log, "w") if log else None
    try:
        done = subprocess.run(list(args), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if out else None)
    finally:
        if out:
            out.close()
    if done.returncode != 0:
        tail = open(log).read()[-2000:] if log else ""
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}){': ' + log if log else ''}\n{tail}")


def pair_people(pairs_list: str) -> list[set[str]]:
    """The LFW people of each pair of pairs.txt, in order (one for a same-person pair, two else)."""
    with open(pairs_list) as f:
        rows = [line.split() for line in f.read().splitlines()[1:]]
    return [set(fields[0::2][:2] if len(fields) == 4 else fields[:1]) for fields in rows]


def paired_people(pairs_list: str) -> set[str]:
    """The LFW people named in pairs.txt (never trained on)."""
    return set().union(*pair_people(pairs_list))


def prepare(args, work: str) -> dict[str, str]:
    """The packed sets and their teacher files (made once, where an arm asked for needs it):
    {"celeb"|"all": rec, "<set>.teacher": file}."""
    photos, crops = os.path.join(work, "photos"), os.path.join(work, "crops")
    if not os.path.isdir(crops):
        os.makedirs(photos, exist_ok=True)
        paired = paired_people(args.pairs_list)
        unpaired = [p for p in sorted(os.listdir(args.lfw)) if p not in paired]
        links = [(os.path.join(args.celeb, p), f"celeb_{p}") for p in sorted(os.listdir(args.celeb))]
        links += [(os.path.join(args.lfw, p), f"lfw_{p}") for p in unpaired]
        for target, name in links:  # (kept from an align that did not finish)
            if not os.path.lexists(os.path.join(photos, name)):
                os.symlink(os.path.abspath(target), os.path.join(photos, name))
        print(
            f"aligning {len(os.listdir(args.celeb))} CelebA people and {len(unpaired)} LFW people in no pair",
            flush=True,
        )
        t = time.perf_counter()
        sh(sys.executable, "-m", "scripts.align", photos, crops, "--largest", "--workers", str(args.workers))
        print(f"aligned in {time.perf_counter() - t:.0f} s", flush=True)
    sets = {}
    for name, keep in (("celeb", "celeb_"), ("all", "")):
        rec = os.path.join(work, f"rec_{name}")
        if not os.path.isfile(os.path.join(rec, "property")):
            src = crops
            if keep:
                src = os.path.join(work, f"crops_{name}")
                os.makedirs(src, exist_ok=True)
                for person in sorted(os.listdir(crops)):
                    if person.startswith(keep) and not os.path.exists(os.path.join(src, person)):
                        os.symlink(os.path.abspath(os.path.join(crops, person)), os.path.join(src, person))
            sh(sys.executable, "-m", "scripts.pack_rec", src, rec)
        teacher = os.path.join(work, f"{name}.teacher")
        taught = any(data == name and "TEACHER" in extra for _, data, extra in (ARMS[a] for a in args.arms))
        if taught and not os.path.isfile(teacher):  # made for the arms asked for that need it
            sh(sys.executable, "-m", "scripts.teach", "dlib", rec, teacher, "--num_workers", "1")
        sets[name], sets[f"{name}.teacher"] = rec, teacher
    return sets


def classes_of(rec: str) -> int:
    with open(os.path.join(rec, "property")) as f:
        return int(f.read().split(",")[0])


def run_dir(work: str, arm: str, seed: int) -> str:
    return os.path.join(
        work,
        "runs",
        arm.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") + f"_seed{seed}",
    )


def train(work: str, sets: dict[str, str], arm: str, seed: int, nproc: int) -> None:
    out = run_dir(work, arm, seed)
    if os.path.isfile(os.path.join(out, "wall_s.txt")):
        return
    network, data, extra = ARMS[arm]
    extra = [sets[f"{data}.teacher"] if e == "TEACHER" else e for e in extra]
    classes = "0" if data == "all" else str(classes_of(sets[data]))
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone"]
    os.makedirs(out, exist_ok=True)
    print(f"training {arm}, seed {seed} -> {out}", flush=True)
    # a run stopped before its end (Ctrl-C, which reaches the ranks too, or a rank's stop request)
    # continues from its last checkpoint when the benchmark runs again; its wall time is the sum of
    # its attempts' (an attempt ended by killing this process is not counted)
    attempts = os.path.join(out, "attempts_s.txt")
    t = time.perf_counter()
    try:
        sh(
            *launch,
            "train.py",
            CONFIG,
            "--network",
            network,
            "--rec",
            sets[data],
            "--num_classes",
            classes,
            "--seed",
            str(seed),
            "--output",
            out,
            "--resume",
            "auto",
            *extra,
            log=os.path.join(out, f"console{len(_attempts(attempts))}.log"),
        )
    finally:
        with open(attempts, "a") as f:
            f.write(f"{time.perf_counter() - t:.0f}\n")
    with open(os.path.join(out, "training.log")) as f:
        if "done: " not in f.read():  # train.py exits 0 too when a stop request ends it early
            raise SystemExit(f"{out}: stopped before its last step; run the benchmark again to continue it")
    with open(os.path.join(out, "wall_s.txt"), "w") as f:
        f.write(f"{sum(_attempts(attempts)):.0f}\n")


def _attempts(path: str) -> list[float]:
    return [float(v) for v in open(path).read().split()] if os.path.isfile(path) else []


def cache_dir(args, path: str) -> str | None:
    """Where a list's caches go: `--cache_dir` for LFW's list; CFP's in its root, as scripts.verify's."""
    return args.cache_dir if path == args.pairs_list else None


def list_faces(args, path: str, images: str | None, protocol: str | None = None):
    """(the pair list, every photo's face): found once (faces cached beside the list, as the
    anchor's and `scripts.verify --pairs_list`'s), the same for every model."""
    from shardface.eval.cfp import read_list
    from shardface.faces.detect import Detection
    from shardface.infer.pair_photos import FacesCache, Retries, cache_paths, pair_faces

    pair_list = read_list(path, images, protocol)
    faces_cache = cache_paths(path, None, cache_dir(args, path))[0]
    faces = pair_faces(
        pair_list.photos,
        Detection(),
        Retries(upsample=2, mmod=True),
        FacesCache(faces_cache),
        workers=args.workers,
    )
    return pair_list, faces


def list_scores(args, path: str, pair_list, faces, run: str) -> tuple[float, float, float, float]:
    """(acc, std, acc-flip, std-flip) of a run's model on all the list's pairs, from the photos."""
    from shardface.eval.pairs import score_pairs
    from shardface.infer.model import load_model
    from shardface.infer.pair_photos import EmbeddingCache, cache_paths, pair_embeddings

    model = load_model(run)
    emb_cache = cache_paths(path, model.fingerprint, cache_dir(args, path))[1]
    emb = pair_embeddings(
        model, pair_list.photos, faces, EmbeddingCache(emb_cache, model), show_progress=False
    )
    r = score_pairs(pair_list, emb.emb, emb.emb_flip)
    return r.accuracy, r.std, r.accuracy_flip, r.std_flip


def speed(module: torch.nn.Module, size: int, threads: int, images: int = 256, batch: int = 64) -> float:
    """Images per second of `module` on size x size crops (infer.embed.embed: uint8 crops in,
    embeddings out, as every tool embeds) on `threads` threads, the median of 3 passes after a warm-up."""
    from shardface.infer.embed import embed

    torch.set_num_threads(threads)
    crops = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8)
    embed(crops[:batch], module, batch)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        embed(crops, module, batch)
        times.append(time.perf_counter() - t)
    return images / statistics.median(times)


def onnx_twin(module: torch.nn.Module, size: int, folder: str, name: str) -> str:
    """`module` exported as scripts.export_onnx writes it (its crop's template in the metadata), into `folder`."""
    from shardface.faces.align import ARCFACE_112
    from shardface.faces.dlib_chip import DLIB_150
    from shardface.scripts.export_onnx import export

    path = os.path.join(folder, f"{name}.onnx")
    export(module, path, template=DLIB_150 if size == DLIB_150.size[0] else ARCFACE_112)
    return path


def speeds() -> None:
    """Each arm's network (untrained: speed is the architecture's) beside MODEL dlib, 1 thread and
    all, in torch (as `.pt` MODELs run) and in onnxruntime (as the `.onnx` scripts.export_onnx
    writes runs)."""
    import tempfile

    from shardface import backbones
    from shardface.infer.model import load_model
    from shardface.infer.onnx import OnnxBackbone

    cores = os.cpu_count() or 1
    nets = {"dlib (MODEL dlib, 150 chips)": (load_model("dlib").module, 150)}
    for network, _, extra in ARMS.values():
        name = (
            network
            if "--embedding_size" not in extra
            else f"{network} ({extra[extra.index('--embedding_size') + 1]}-D)"
        )
        if name not in nets:
            dim = int(extra[extra.index("--embedding_size") + 1]) if "--embedding_size" in extra else 512
            nets[name] = (backbones.get_model(network, num_features=dim).eval(), 112)
    print(
        f"\nembedding speed on this CPU, images/s (batches of 64, no flip): 1 thread / {cores} threads, x MODEL "
        "dlib's on 1 thread in the same runtime; torch, then onnxruntime"
    )
    base: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, (module, size)) in enumerate(nets.items()):
            path = onnx_twin(module, size, folder, f"net{i}")
            said = []
            for runtime in ("torch", "onnxruntime"):
                one_every = []
                for threads in (1, cores):
                    torch.set_num_threads(threads)  # onnxruntime's session takes torch's count when made
                    one_every.append(
                        speed(module if runtime == "torch" else OnnxBackbone(path), size, threads)
                    )
                base.setdefault(runtime, one_every[0])
                said.append(
                    f"{runtime} {one_every[0]:.0f} / {one_every[1]:.0f} (x{one_every[0] / base[runtime]:.1f})"
                )
            print(f"- {name}: " + ", ".join(said), flush=True)


def report(args, work: str) -> None:
    """The table of the finished runs on LFW view 2 and, with `--cfp`, on CFP's FP and FF."""
    runs = [(arm, seed, run_dir(work, arm, seed)) for seed in args.seeds for arm in ARMS]
    runs = [(arm, seed, run) for arm, seed, run in runs if os.path.isfile(os.path.join(run, "wall_s.txt"))]
    lists = [] if args.cfp_only else [("LFW view 2", args.pairs_list, args.lfw, None)]
    lists += [(f"CFP {p}", args.cfp, None, p) for p in ("FP", "FF") if args.cfp]
    for title, path, images, protocol in lists:
        pair_list, faces = list_faces(args, path, images, protocol)
        print(
            f"\n{title}, all {len(pair_list.pairs)} pairs from the photos (10-fold mean and std over the folds; "
            "CelebA's people may overlap LFW's):"
        )
        print("| arm | seed | train min | acc | std | acc-flip | std |\n|---|---|---|---|---|---|---|")
        if not args.cfp_only:  # MODEL dlib on CFP: `scripts.verify dlib --pairs_list CFP --protocol FP|FF`
            anchor = list_scores(args, path, pair_list, faces, "dlib")
            print(
                f"| MODEL dlib (the teacher) | - | - | {anchor[0]:.4f} | {anchor[1]:.4f} | {anchor[2]:.4f} | "
                f"{anchor[3]:.4f} |",
                flush=True,
            )
        for arm, seed, run in runs:
            wall = int(open(os.path.join(run, "wall_s.txt")).read())
            acc, std, acc_f, std_f = list_scores(args, path, pair_list, faces, run)
            print(
                f"| {arm} | {seed} | {wall / 60:.0f} | {acc:.4f} | {std:.4f} | {acc_f:.4f} | {std_f:.4f} |",
                flush=True,
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--celeb", required=True, help="CelebA photos, one sub-folder per person")
    p.add_argument("--lfw", required=True, help="LFW's folder: FOLDER/name/name_000n.jpg")
    p.add_argument("--pairs_list", required=True, help="LFW's pairs.txt (view 2)")
    p.add_argument(
        "--cfp_only", action="store_true", help="with --cfp: CFP's tables of the trained runs only"
    )
    p.add_argument(
        "--cfp",
        default=None,
        help="a CFP root: the table on its FP and FF protocols too (its caches "
        "in the root, shared with scripts.verify's)",
    )
    p.add_argument("--work", default=os.path.join(ROOT, "work_dirs", "real_faces"))
    p.add_argument(
        "--cache_dir", default=None, help="the LFW faces' and embeddings' cache (default: beside the list)"
    )
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), metavar="ARM")
    p.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks per run")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="face-finding processes")
    p.add_argument("--evaluate", action="store_true", help="only the table of the finished runs")
    p.add_argument(
        "--speed", action="store_true", help="only each network's embedding speed (time it quietly)"
    )
    args = p.parse_args()
    work = os.path.abspath(args.work)
    if args.speed:
        speeds()
        return
    if not args.evaluate:
        sets = prepare(args, work)
        print(
            json.dumps({k: classes_of(v) for k, v in sets.items() if not k.endswith(".teacher")}),
            "classes",
            flush=True,
        )
        for seed in args.seeds:  # every arm's first seed before any second
            for arm in args.arms:
                train(work, sets, arm, seed, args.nproc)
    report(args, work)


if __name__ == "__main__":
    main()
