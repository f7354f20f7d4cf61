"""The options the tools share, declared once: MODEL and its weights (`add_model_options`, every
tool that uses a trained model), the face-finding options (scripts.align, and `--align` in
pack_rec, make_bin, embed, compare, identify, identify_eval), how many processes find faces
(--workers): one spelling,
one help text, one Model and one Detection built from them."""

from __future__ import annotations

import math

import torch

from shardface.dataset.shares import Ranks
from shardface.errors import ConfigError
from shardface.eval.cfp import is_cfp
from shardface.eval.pairs import PairList
from shardface.faces.detect import DETECTORS, LANDMARKS, MAX_SIDE, Detection, check_available
from shardface.faces.workers import check_workers, default_workers
from shardface.infer.model import MODEL_HELP, PRECISIONS, Model, load_model
from shardface.infer.pair_photos import FacesCache, PairFaces, Retries, cache_paths, pair_faces


def add_model_options(p, batch_size: int | None = 64, what: str = "MODEL") -> None:
    """MODEL (positional; `what` names it in the usage line), --network, --no_ema and, for a tool
    that embeds (batch_size not None), --batch_size."""
    p.add_argument("model", metavar=what, help=MODEL_HELP)
    p.add_argument(
        "--network",
        default=None,
        help="backbone name for a model.pt without a training config beside "
        "it (arcface_torch's; default: from the training config)",
    )
    p.add_argument("--no_ema", action="store_true", help="the raw weights, not the EMA")
    if batch_size is not None:
        p.add_argument(
            "--batch_size",
            type=int,
            default=batch_size,
            help=f"face crops per forward pass (default {batch_size})",
        )
        p.add_argument(
            "--device",
            default=None,
            help="where the model runs: cpu, cuda or cuda:N (default: the current GPU, else the CPU; "
            "an .onnx runs where onnxruntime places it)",
        )
        p.add_argument(
            "--precision",
            default="fp32",
            choices=PRECISIONS,
            help="on a GPU, fp16 or bf16 embeds under autocast (fp32, the default, everywhere)",
        )


def device_from(args) -> torch.device | None:
    """The --device asked for, checked at start (None: the tools' default, infer.model.tool_device)."""
    if getattr(args, "device", None) is None:
        return None
    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {args.device}: cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {args.device}: cpu, cuda or cuda:N")
    if device.type == "cuda" and (
        not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()
    ):
        raise ConfigError(
            f"--device {args.device}: {torch.cuda.device_count()} CUDA devices here; --device cpu "
            "runs on the CPU"
        )
    return device


def model_from(args, detection: Detection | None = None, device=None) -> Model:
    """The Model the MODEL options name, on `device` (default: --device, else the current GPU,
    else the CPU), embedding at --precision, finding faces with `detection` (the face options')."""
    if getattr(args, "batch_size", 1) < 1:
        raise ConfigError(f"--batch_size {args.batch_size}: at least 1")
    device = device if device is not None else device_from(args)
    precision = getattr(args, "precision", "fp32")
    model = load_model(
        args.model,
        args.network,
        ema=not args.no_ema,
        device=device,
        detection=detection or Detection(),
        precision=precision,
    )
    if precision != "fp32" and model.device.type != "cuda":
        raise ConfigError(
            f"--precision {precision}: for a model on a GPU; {args.model} runs on the "
            f"{model.device.type.upper()}, in fp32"
        )
    return model


def add_detection_options(p) -> None:
    p.add_argument(
        "--detector",
        choices=DETECTORS,
        default="hog",
        help="dlib's HOG detector (fast on a CPU, frontal faces) or its CNN MMOD detector (slower "
        "on a CPU, finds turned and small faces better)",
    )
    p.add_argument(
        "--upsample",
        type=int,
        default=1,
        help="double the photo's size this many times before searching: finds faces smaller than "
        "80 pixels (HOG) at 4x the time per doubling",
    )
    p.add_argument(
        "--landmarks",
        choices=sorted(LANDMARKS),
        default="5",
        help="dlib's 5-point model (public domain; the default) or its 68-point model (trained "
        "on iBUG 300-W, whose licence excludes commercial use); docs/photos.md",
    )
    p.add_argument("--min_score", type=float, default=0.0, help="drop detections scoring below this")
    p.add_argument(
        "--max_side",
        type=int,
        default=MAX_SIDE,
        help="search photos larger than this (longer side, pixels) at this size; landmarks "
        "are still found at full resolution",
    )


def add_align_options(p, what: str, strict: bool = True) -> None:
    """--align, --strict and the detection options, for a tool taking photos of `what`; a tool
    that refuses every photo without a face takes no --strict (strict=False)."""
    p.add_argument(
        "--align",
        action="store_true",
        help=f"take {what} as photos: find the faces and align each photo's largest one to the "
        "model's template (a photo without a face is "
        + ("left out and named)" if strict else "refused, naming it)"),
    )
    if strict:
        p.add_argument("--strict", action="store_true", help="with --align, refuse photos without a face")
    add_detection_options(p)
    add_workers_option(p)


def detection_from(args) -> Detection:
    if getattr(args, "resize", False):
        raise ConfigError("--align and --resize: choose one (alignment makes crops of the model's size)")
    if args.upsample < 0:
        raise ConfigError(f"--upsample {args.upsample}: 0 or more")
    if not math.isfinite(args.min_score):
        raise ConfigError(
            f"--min_score {args.min_score}: a finite number (NaN or an infinity would turn the "
            "filter off or drop every face)"
        )
    if args.max_side < 64:
        raise ConfigError(f"--max_side {args.max_side}: at least 64")
    return Detection(args.detector, args.upsample, args.landmarks, args.min_score, args.max_side)


def face_detection(args) -> Detection:
    """The Detection the face options ask for (their values checked, and with --align the dlib
    models loaded, so a missing model file is one line at start), before any work."""
    if not getattr(args, "align", True):
        return Detection()  # no face is searched
    detection = detection_from(args)
    check_available(detection.detector, detection.landmarks)
    return detection


def add_workers_option(p) -> None:
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes finding faces (default: the cores this process may use, divided among "
        "torchrun's ranks on this machine; 1 runs in this process); the output is the same "
        "whatever their number",
    )


def workers_from(args) -> int:
    return default_workers() if args.workers is None else check_workers(args.workers)


def add_pair_list_options(p) -> None:
    """The options of a pair list's photos that scripts.make_bin and scripts.verify share: the
    retries for photos without a face and where the caches go."""
    p.add_argument(
        "--retry_upsample",
        type=int,
        default=None,
        metavar="N",
        help="search photos where no face was found again with N doublings (more than --upsample): "
        "finds smaller faces, at 4x the time per doubling",
    )
    p.add_argument(
        "--retry_mmod",
        nargs="?",
        const="true",
        default=None,
        choices=("true", "false"),
        help="then search the photos still without a face with dlib's CNN (MMOD) detector (slower on "
        "a CPU, finds turned faces); a photo still without one gets a fallback face (default: true "
        "for a CFP root, whose profiles HOG mostly misses; false for other lists)",
    )
    p.add_argument(
        "--protocol",
        default=None,
        choices=("FP", "FF"),
        help="with a CFP root as --pairs_list: its frontal-profile (FP) or frontal-frontal (FF) "
        "protocol, 7,000 pairs on its own 10 folds",
    )
    p.add_argument(
        "--cache_dir",
        default=None,
        help="folder for the list's caches of detected faces (and verify's embeddings) (default: "
        "beside the list)",
    )


def retries_from(args, detection: Detection) -> Retries:
    """The retries the options ask for (dlib's CNN detector by default on a CFP root), checked
    (and that detector loaded) before any work."""
    if args.retry_upsample is not None and args.retry_upsample <= detection.upsample:
        raise ConfigError(
            f"--retry_upsample {args.retry_upsample}: more than --upsample {detection.upsample}, "
            "the first search's"
        )
    if args.retry_mmod == "true" and detection.detector == "mmod":
        raise ConfigError(
            "--retry_mmod with --detector mmod: the first search used dlib's CNN detector already"
        )
    mmod = args.retry_mmod == "true" or (
        args.retry_mmod is None and detection.detector != "mmod" and is_cfp(args.pairs_list)
    )
    if mmod:
        check_available("mmod", detection.landmarks)
    return Retries(args.retry_upsample, mmod)


def list_faces(
    args, pair_list: PairList, detection: Detection, strict: bool, ranks: Ranks = Ranks()
) -> PairFaces:
    """The face of each photo of the list (detected, recovered by a retry, or the fallback), with
    the faces cache of the options (rank 0's: the others search their shares of what it leaves to
    do), and the report printed (by rank 0)."""
    path = cache_paths(args.pairs_list, None, args.cache_dir)[0]
    faces = pair_faces(
        pair_list.photos,
        detection,
        retries_from(args, detection),
        FacesCache(path if ranks.rank == 0 else None),
        strict,
        workers=workers_from(args),
        ranks=ranks,
    )
    for line in faces.report(pair_list.pairs) if ranks.rank == 0 else ():
        print(line)
    return faces
