"""Every config key of a ShardFace run, defined once: its default, its type and range (`kind`), its
help text, whether it may differ between the ranks of one job (and why), whether its value is
secret, and what ShardFace does instead where it serves an arcface_torch key its own way.

The defaults (configs/base.py), `train.py --help`, validation, the ranks' agreement check and the
config dump in training.log are all made from `SECTIONS` (`keys()`), read when they run: a key
added to a section gets all of them. Job files stay arcface_torch's
`config.x = ...` on an edict, loaded over the defaults. Key names follow arcface_torch where the
meaning is the same. A help text's lines are printed as written, under the key's line."""

from __future__ import annotations

import ast
import math
import numbers
from dataclasses import dataclass
from typing import Any

from shardface.errors import ConfigError

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False}
_BOOL_WORDS.update({"no": False, "off": False})


def parse_bool(text: str) -> bool:
    if text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    raise ConfigError(f"expected a boolean, got '{text}'")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite number: inf or nan would pass `> 0` (inf) or poison the first step (nan) unnoticed."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _literal_list(text: str) -> list:
    """`['a', 'b']`, `(1.0, 0.5, 0.0)`, or the comma-separated `a,b`."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = [v for v in text.split(",") if v]
    return list(value) if isinstance(value, (list, tuple)) else [value]


class Kind:
    """A key's type and range: `refuses(value)` says why a value is refused ("" where it is not), and
    `parse(text)` reads a command-line value (a ValueError or ConfigError where it cannot)."""

    def refuses(self, value) -> str:
        raise NotImplementedError

    def parse(self, text: str):
        return text


@dataclass(frozen=True)
class Boolean(Kind):
    def refuses(self, value) -> str:
        return "" if isinstance(value, bool) else "expected true or false"

    def parse(self, text: str) -> bool:
        return parse_bool(text)


@dataclass(frozen=True)
class Integer(Kind):
    low: int | None = None  # the smallest allowed; None: any integer
    why: str = ""  # said after the range

    def refuses(self, value) -> str:
        if _is_int(value) and (self.low is None or value >= self.low):
            return ""
        if self.low is None:
            return "expected an integer"
        return (
            "expected a positive integer" if self.low == 1 else f"expected an integer >= {self.low}"
        ) + self.why

    def parse(self, text: str) -> int:
        return int(text)


@dataclass(frozen=True)
class Number(Kind):
    """A finite number in [low, high] (each end open where not `*_in`)."""

    low: float = -math.inf
    high: float = math.inf
    low_in: bool = True
    high_in: bool = True

    def refuses(self, value) -> str:
        above = _is_real(value) and (self.low <= value if self.low_in else self.low < value)
        if above and (value <= self.high if self.high_in else value < self.high):
            return ""
        if self.high == math.inf:
            return f"expected a finite number {'>=' if self.low_in else '>'} {self.low:g}"
        left, right = "[" if self.low_in else "(", "]" if self.high_in else ")"
        return f"expected a number in {left}{self.low}, {self.high}{right}"

    def parse(self, text: str) -> float:
        return float(text)


@dataclass(frozen=True)
class Choice(Kind):
    allowed: tuple

    def refuses(self, value) -> str:
        if any(type(value) is type(a) and value == a for a in self.allowed):
            return ""
        return f"expected one of {', '.join(map(repr, self.allowed))}"

    def parse(self, text: str):
        """A string choice as given (validation names a wrong one with its key); where the choices
        mix true and false with names (`resume`), a bool word or a name, else a ValueError."""
        if not any(isinstance(a, bool) for a in self.allowed):
            return text
        if text.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[text.lower()]
        if text in self.allowed:
            return text
        raise ValueError(self.refuses(text))


@dataclass(frozen=True)
class Text(Kind):
    empty: bool = True  # "" allowed
    none: bool = False  # None allowed (`--key None` gives it)
    expected: str = ""  # the refusal, where not the plain one

    def refuses(self, value) -> str:
        if (value is None and self.none) or (isinstance(value, str) and (self.empty or value)):
            return ""
        if self.expected:
            return self.expected
        return "expected a string or None" if self.none else "expected a non-empty string"

    def parse(self, text: str):
        return None if self.none and text == "None" else text


@dataclass(frozen=True)
class Names(Kind):
    """A list of strings: `['lfw', 'cfp_fp']` or `lfw,cfp_fp`."""

    def refuses(self, value) -> str:
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return ""
        return "expected a list of .bin names"

    def parse(self, text: str) -> list:
        return _literal_list(text)


@dataclass(frozen=True)
class Margins(Kind):
    """Combined margin's (m1, m2, m3) of s*(cos(m1*theta+m2)-m3), m1 > 0."""

    def refuses(self, value) -> str:
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(_is_real(m) for m in value):
            return "expected three finite numbers (m1, m2, m3) of s*(cos(m1*theta+m2)-m3)"
        return "" if value[0] > 0 else "m1 must be > 0"

    def parse(self, text: str) -> tuple:
        return tuple(_literal_list(text))


@dataclass(frozen=True)
class FlagOrText(Kind):
    """True, False or a mode named by a string (wandb.init's resume)."""

    def refuses(self, value) -> str:
        return "" if isinstance(value, (bool, str)) else "expected true, false or a wandb resume mode"

    def parse(self, text: str):
        return _BOOL_WORDS.get(text.lower(), text)


BOOLEAN, POSITIVE, NON_NEGATIVE = Boolean(), Number(0.0, low_in=False), Number(0.0)
UNIT = Number(0.0, 1.0, True, False)  # [0, 1)


@dataclass(frozen=True)
class Key:
    """One config key."""

    default: Any
    kind: Kind
    help: str
    per_rank: str = ""  # why it may differ between the ranks of one job; "": it may not
    secret: bool = False  # compared between ranks, never printed
    served: str = ""  # an arcface_torch key ShardFace serves its own way: said once when it is set


DALI = (
    "config dali/dali_aug asks for NVIDIA DALI: ShardFace runs its own loader (workers decode in parallel, "
    "images mirrored at random); set dali False to silence this"
)

SECTIONS: dict[str, dict[str, Key]] = {
    "model": {
        "network": Key("r50", Text(empty=False), "backbones.get_model name"),
        "embedding_size": Key(512, Integer(1), "the embedding's width"),
        "dropout": Key(0.0, UNIT, "dropout before the embedding layer"),
        "grad_checkpoint": Key(False, BOOLEAN, "recompute backbone activations in backward"),
        "fp16": Key(False, BOOLEAN, "fp16 autocast + dynamic loss scaling"),
        "bf16": Key(False, BOOLEAN, "bf16 autocast, no loss scaling"),
        "channels_last": Key(
            True,
            BOOLEAN,
            "the batch in channels-last (NHWC) memory: the same math, faster convolutions\n"
            "(docs/gpus.md); false: arcface_torch's NCHW",
        ),
        "init_backbone": Key(
            "",
            Text(),
            "new run from these backbone weights, fresh head (fine-tuning):\n"
            "a model.pt, arcface_torch checkpoint_gpu_<r>.pt, checkpoint or run\n"
            "dir (its EMA weights if any); ignored (logged) when resuming",
        ),
    },
    "margin head (heads.PartialFC); losses.build_margin reads these": {
        "margin": Key(
            "combined",
            Choice(
                (
                    "combined",
                    "arcface",
                    "cosface",
                    "adaface",
                    "magface",
                    "curricularface",
                    "subcenter_arcface",
                )
            ),
            "combined | arcface | cosface | adaface | magface |\ncurricularface | subcenter_arcface",
        ),
        "margin_list": Key((1.0, 0.5, 0.0), Margins(), "combined: (m1, m2, m3): s*(cos(m1*theta+m2)-m3)"),
        "scale": Key(64.0, POSITIVE, "s, every margin"),
        "straight_through": Key(
            True,
            BOOLEAN,
            "combined/arcface: margin's derivative taken as 1, arcface_torch's\n"
            "gradient; False: the true derivative of the loss",
        ),
        "arcface_m": Key(0.5, NON_NEGATIVE, "arcface, subcenter_arcface: additive angular margin"),
        "cosface_m": Key(0.4, NON_NEGATIVE, "cosface: additive cosine margin"),
        "adaface_m": Key(0.4, NON_NEGATIVE, "adaface (Kim et al. 2022): margin"),
        "adaface_h": Key(0.333, NON_NEGATIVE, "adaface: how far the norm moves the margin"),
        "adaface_t_alpha": Key(
            0.01, Number(0.0, 1.0, False, True), "adaface: EMA rate of the batch norm mean/std"
        ),
        "magface_l_a": Key(10.0, POSITIVE, "magface (Meng et al. 2021): norm range [l_a, u_a], its low end"),
        "magface_u_a": Key(110.0, POSITIVE, "magface: the norm range's high end"),
        "magface_l_m": Key(0.45, NON_NEGATIVE, "magface: margin range [l_m, u_m], linear in the norm"),
        "magface_u_m": Key(0.8, NON_NEGATIVE, "magface: the margin range's high end"),
        "magface_lambda_g": Key(20.0, NON_NEGATIVE, "magface: weight of the norm regulariser"),
        "magface_easy_margin": Key(True, BOOLEAN, "magface: the authors' default"),
        "curricularface_m": Key(0.5, NON_NEGATIVE, "curricularface (Huang et al. 2020): angular margin"),
        "subcenter_k": Key(3, Integer(1), "subcenter_arcface (Deng et al. 2020): centres per class"),
        "interclass_filtering_threshold": Key(
            0.0,
            UNIT,
            "non-target cosines above it become 0, with no gradient\n(arcface_torch's option); 0 = off",
        ),
        "sample_rate": Key(
            1.0, Number(0.0, 1.0), "Partial FC: fraction of each shard's classes per step"
        ),  # 0 keeps only the batch's classes (arcface_torch's wf42m_pfc0008_32gpu_r100 sets it)
        "chunk_size": Key(32768, Integer(0), "classes per GEMM tile of the head; 0 = whole shard at once"),
        "row_block": Key(
            512,
            Integer(1),
            "rows per block beyond the first embedding_size rows (kept\n"
            "free in the weight gradient): row_block x shard floats; the\n"
            "defaults suit GPUs, where each block x tile costs kernel launches (docs/heads.md)",
        ),
        "head_precision": Key(
            "fp32",
            Choice(("fp32", "tf32", "bf16")),
            "logits GEMM: fp32 | tf32 (GPU) | bf16; statistics stay fp32",
        ),
        "head_fused_optimizer": Key(
            False,
            BOOLEAN,
            "step the head's rows inside backward: no weight gradient held\n"
            "(needs gradient_acc 1, no fp16, clip_head False)",
        ),
        "head_graph": Key(
            False,
            BOOLEAN,
            "the head's forward and backward replayed from CUDA graphs (fewer\n"
            "launches; static batch shape): eagerly, with one log line, on a CPU,\n"
            "with head_fused_optimizer or a teacher. False until proven on a GPU",
        ),
        "clip_head": Key(
            False,
            BOOLEAN,
            "False: the backbone alone is clipped (arcface_torch); True: the\nhead joins the global norm",
        ),
    },
    "distillation (docs/distillation.md)": {
        "teacher": Key(
            "",
            Text(expected="expected a MODEL or teacher file path, or '' for none"),
            "MODEL run beside the student (run dir, checkpoint, model.pt, .onnx,\n"
            'dlib) or a teacher file of scripts.teach; "" = no distillation',
        ),
        "teacher_network": Key(None, Text(none=True), "backbone name of an arcface_torch model.pt teacher"),
        "distill_loss": Key(
            "cosine",
            Choice(("cosine", "relational")),
            "cosine: each embedding to the teacher's (a learned projection when\n"
            "the sizes differ) | relational: the batch's cosine-similarity matrices",
        ),
        "distill_weight": Key(1.0, NON_NEGATIVE, "the distillation loss's weight beside the margin loss"),
        "distill_center": Key(
            True,
            BOOLEAN,
            "subtract the teacher's mean embedding over the training data from\n"
            "its targets (re-normalised): targets sharing one direction (most\n"
            "teachers) reward a constant student",
        ),
        "distill_center_samples": Key(
            4096,
            Integer(2, " (the records the teacher's mean target is measured on; one record is its own mean)"),
            "records an on-the-fly teacher's mean is measured on (a teacher file:\n"
            "all its rows); checkpointed, so a resume keeps it",
        ),
    },
    "optimisation": {
        "optimizer": Key("sgd", Choice(("sgd", "adamw")), "sgd | adamw"),
        "lr": Key(0.1, POSITIVE, "for the global batch below; not rescaled automatically"),
        "momentum": Key(0.9, UNIT, "SGD's momentum (adamw: its beta1)"),
        "weight_decay": Key(5e-4, NON_NEGATIVE, "the optimizer's weight decay"),
        "max_grad_norm": Key(5.0, NON_NEGATIVE, "global gradient-norm clip (see clip_head); 0 disables"),
        "lr_scheduler": Key(
            "poly_warmup",
            Choice(("poly", "cosine", "poly_warmup")),
            "poly_warmup (arcface_torch's PolynomialLRWarmup: steps counted\n"
            "as images // global batch, first step at full lr) | poly | cosine",
        ),
        "lr_power": Key(1.0, NON_NEGATIVE, "exponent of the polynomial decay"),
        "warmup_epoch": Key(
            0,
            Integer(),
            "epochs of linear warmup (arcface_torch's 3millions sets -1, which its schedule takes)",
        ),
        "gradient_acc": Key(1, Integer(1), "micro-batches per optimizer step"),
        "zero": Key(True, BOOLEAN, "ZeRO-2 for the backbone; False = DDP"),
        "ema": Key(False, BOOLEAN, "sharded EMA of the backbone"),
        "ema_decay": Key(
            0.9999,
            Number(0.0, 1.0, False, False),
            "the EMA's decay, reached as updates grow: decay * (1 - exp(-updates / tau))",
        ),
        "ema_tau": Key(2000.0, POSITIVE, "tau of that ramp, in updates"),
    },
    "data": {
        "rec": Key(
            "synthetic",
            Text(empty=False),
            'dir with train.rec/train.idx, an image folder, or "synthetic"\n'
            "(arcface_torch's throughput test: one fixed random image)",
        ),
        "num_classes": Key(
            93431, Integer(0), "0 with a teacher: label-free, the distillation loss alone (no head)"
        ),
        "num_image": Key(
            5179510,
            Integer(0),
            "arcface_torch's warmup and total steps come from it; ShardFace\n"
            "counts the data set's images instead (a differing value is named)",
        ),
        "num_epoch": Key(20, Integer(1), "epochs of the schedule"),
        "batch_size": Key(128, Integer(1), "per rank"),
        "num_workers": Key(
            2,
            Integer(0),
            "loader processes per rank",
            per_rank="loader processes are a node's CPU resource; a sample's pixels and mirroring depend only "
            "on (seed, epoch, index), never on which worker read it",
        ),
        "skip_bad_images": Key(False, BOOLEAN, "count and skip undecodable images instead of failing"),
        "resize": Key(
            False,
            BOOLEAN,
            "resize images that are not 112x112 (bilinear) instead of refusing\n"
            "them; models expect aligned crops, and resizing is not alignment",
        ),
        "align": Key(
            False,
            BOOLEAN,
            "rec is a folder of raw photos: find each photo's largest face at\n"
            "start and train on it aligned to 112x112 (docs/photos.md)",
        ),
        "align_detector": Key(
            "hog", Choice(("hog", "mmod")), 'with align: dlib\'s "hog" or "mmod" face detector'
        ),
        "align_strict": Key(
            False, BOOLEAN, "with align: refuse photos without a face instead of leaving them out"
        ),
        "seed": Key(2048, Integer(0), "seeds the weights, the sampler's order and the mirroring"),
    },
    "evaluation and logging": {
        "val_targets": Key([], Names(), "names of <name>.bin files inside config.val_dir"),
        "val_dir": Key("", Text(), "default: the directory of config.rec"),
        "verbose": Key(2000, Integer(0), "evaluate every N steps"),
        "frequent": Key(10, Integer(1), "log every N steps"),
        "output": Key(
            "work_dirs/default",
            Text(empty=False),
            "the run's folder: checkpoints, model.pt, training.log",
            per_rank="one shared directory may be mounted at another path on each node; that every rank sees "
            "the same directory is checked on the directory itself (checkpoint/run_lock.py)",
        ),
        "checkpoint_interval": Key(2000, Integer(1), "steps between checkpoints (and one at the end)"),
        "keep_checkpoints": Key(2, Integer(0), "newest checkpoints of this run kept; 0 keeps every one"),
        "resume": Key(
            False,
            Choice((False, True, "auto")),
            'True: continue from output/latest; "auto": continue if the\n'
            "output holds a checkpoint, else start (elastic restarts, requeues)",
        ),
        "overwrite": Key(
            False,
            BOOLEAN,
            "start over in an output holding checkpoints (deletes them);\n"
            "without it, or resume, such an output is refused",
        ),
        "reset_ema": Key(
            False,
            BOOLEAN,
            "resume without the checkpoint's ema.pt: restart the EMA from\n"
            "the loaded weights (otherwise a missing ema.pt is an error)",
        ),
        "reset_margin": Key(
            False,
            BOOLEAN,
            "resume with another margin type whose running statistics\n"
            "cannot carry over: they start afresh (otherwise refused)",
        ),
        "dist_timeout_min": Key(10, POSITIVE, "a dead rank makes the others fail after this long"),
        "max_steps": Key(0, Integer(0), "shorten the schedule to N steps (0 = num_epoch epochs)"),
        "stop_after_steps": Key(
            0,
            Integer(0),
            "save and exit after N steps of this job, schedule unchanged\n"
            "(time-limited cluster jobs; resume continues exactly)",
        ),
    },
    "arcface_torch keys, accepted with their meaning there (its job configs load unchanged)": {
        "dali": Key(
            False, BOOLEAN, "NVIDIA DALI loader there; here ShardFace's own loader runs (warned)", served=DALI
        ),
        "dali_aug": Key(
            False,
            BOOLEAN,
            "DALI's augmentation there; ShardFace's loader mirrors images (warned)",
            served=DALI,
        ),
        "save_all_states": Key(True, BOOLEAN, "ShardFace always saves every state (optimizers, head, RNG)"),
        "using_wandb": Key(False, BOOLEAN, "log to Weights & Biases (pip install wandb)"),
        "wandb_key": Key(
            "",
            Text(none=True),
            "API key for wandb.login; empty: the key wandb already knows",
            secret=True,
        ),
        "wandb_entity": Key(None, Text(none=True), "wandb team or user; None: wandb's default"),
        "wandb_project": Key("shardface", Text(none=True), "the wandb project of the run"),
        "wandb_log_all": Key(False, BOOLEAN, "every rank logs its own run; False: rank 0 only"),
        "wandb_resume": Key(False, FlagOrText(), "resume the wandb run (as wandb.init's resume)"),
        "suffix_run_name": Key(None, Text(none=True), "appended to the run name <yymmdd_HHMM>_GPU<rank>"),
        "save_artifacts": Key(False, BOOLEAN, "log model.pt as a wandb artifact at the end"),
    },
}


def keys() -> dict[str, Key]:
    """Every key, in the sections' order: the one place a key is added (a section of `SECTIONS`)."""
    return {name: key for section in SECTIONS.values() for name, key in section.items()}


def secret_keys() -> tuple[str, ...]:
    return tuple(name for name, key in keys().items() if key.secret)


def defaults() -> dict:
    """Every key's default (a fresh list where it is a list)."""
    return {
        name: list(key.default) if isinstance(key.default, list) else key.default
        for name, key in keys().items()
    }


def rank_independent(cfg: dict) -> dict:
    """`cfg` without the keys that may differ per rank (train.py refuses a job whose ranks disagree on
    any other: parallel/agreement.py)."""
    every = keys()
    return {name: value for name, value in cfg.items() if not every[name].per_rank}


def served_notes(cfg: dict) -> list[str]:
    """One line for each arcface_torch key that is set and that ShardFace serves its own way."""
    return list(dict.fromkeys(key.served for name, key in keys().items() if key.served and cfg.get(name)))


def describe_keys() -> str:
    """`train.py --help`: a heading per section, then `  --key default    help` per key, the help's
    further lines indented below it."""
    out = []
    for section, keys in SECTIONS.items():
        out.append(f"\n{section}:")
        for name, key in keys.items():
            first, *rest = key.help.split("\n")
            out.append(f"  --{name} {key.default!r}    {first}")
            out += [" " * 8 + line for line in rest]
    return "\n".join(out)


def dump(cfg: dict) -> str:
    """The resolved config (training.log), one `key : value` line each, sorted, secret values hidden."""
    width = max(len(k) for k in cfg)
    hidden = {k for k in secret_keys() if cfg.get(k)}
    return "\n".join(f"{k.ljust(width)} : {'<hidden>' if k in hidden else repr(cfg[k])}" for k in sorted(cfg))
