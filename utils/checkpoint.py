"""Training checkpoints in one format that any world size can load.

A checkpoint is a directory `checkpoint-<step>` under the run's output:

    meta.pt        step, epoch, data position, world size, loss-scaler state, config
    backbone.pt    the backbone's full state dict
    optimizer.pt   the backbone optimizer's state per parameter name (ZeRO-2 or DDP alike)
    ema.pt         the EMA's full state dict and its update count (when EMA is on)
    head-<a>-<b>.pt  weight rows and optimizer state of classes [a, b), one file per rank
                   (none for a label-free run: num_classes 0, no head)
    rng-rank<r>.pt RNG states of rank r (restored when resuming at the same world size)

It is written into `checkpoint-<step>.tmp`, each file via temp file, fsync and
`os.replace`, then renamed into place and named in `latest`, so an interrupted save never
replaces the last good checkpoint. Loading uses `torch.load(weights_only=True)` and
reshards the head (by class index), the optimizer state and the EMA to the current ranks.
The output directory must be shared by all ranks (one machine, or a shared file system).
"""
from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import torch

from configs.errors import UserError
from parallel.dist import from_every_rank, get_rank
from utils.atomic import fsync_dir, publishing

logger = logging.getLogger("shardface")
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# submodules of the training backbone that only training uses (distillation's projection,
# distill/head.py): checkpointed with it, left out of model.pt and of every weights reader
DISTILL_PROJECTION = "distill_projection"  # distill.head registers it on the backbone
TRAINING_ONLY = (DISTILL_PROJECTION,)


def exported(weights: dict | None) -> dict | None:
    """A backbone state dict without its TRAINING_ONLY parts."""
    if weights is None:
        return None
    return {k: v for k, v in weights.items() if k.split(".", 1)[0] not in TRAINING_ONLY}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, unreadable or does not fit this run (the message names it)."""


class NoSpaceError(CheckpointError):
    """A write failed for want of disk space."""


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class TrainState:
    step: int = 0            # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank consumed in `epoch`
    run_id: str = ""         # names the run across resumes; pruning only deletes its checkpoints
    data_size: int = 0       # the data set `batch_in_epoch` counts in (utils/data_position.py); 0: not recorded
    data_fingerprint: str = ""


def _write_atomically(path: str, mode: str, write) -> None:
    try:
        with publishing(path) as tmp, open(tmp, mode) as f:  # a partial file is removed: it would keep the disk full
            write(f)
    except (OSError, RuntimeError) as exc:
        # torch.save reports a failed write as RuntimeError("[enforce fail at inline_container.cc ...")
        if isinstance(exc, RuntimeError) and "inline_container" not in str(exc):
            raise
        cause = exc if isinstance(exc, OSError) else exc.__context__ if isinstance(exc.__context__, OSError) else None
        code = cause.errno if cause is not None else None
        folder = os.path.dirname(os.path.abspath(path))
        if code is None and _free_bytes(folder) < 1 << 20:  # torch's own writer fails without an errno
            code = errno.ENOSPC
        reason = os.strerror(code) if code else str(exc).splitlines()[0]
        if code == errno.ENOSPC:
            raise NoSpaceError(f"{path}: cannot write ({reason}); free space on {folder} or point output "
                               f"elsewhere") from exc
        raise CheckpointError(f"{path}: cannot write ({reason})") from exc


def _free_bytes(folder: str) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62


def atomic_save(obj, path: str) -> None:
    _write_atomically(path, "wb", lambda f: torch.save(obj, f))


def atomic_write_text(path: str, text: str) -> None:
    _write_atomically(path, "w", lambda f: f.write(text))


def safe_load(path: str):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: checkpoint file missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"{path}: corrupt or unreadable checkpoint file ({type(exc).__name__}: {exc})") from None


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:])}
    if torch.cuda.is_available():  # this rank's own device only: GPUs per node may differ on resume
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def cuda_state_to_restore(state: dict) -> torch.Tensor | None:
    """This rank's saved CUDA generator state, or None: absent (a CPU run), or a per-node list
    from older checkpoints whose positions need not match this node's devices."""
    saved = state.get("cuda")
    return saved if torch.is_tensor(saved) else None


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    cuda = cuda_state_to_restore(state)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def plain(value):
    """A config value as JSON holds it: mappings as dicts, tuples as lists."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _head_payload(head, head_opt) -> dict:
    state = head_opt.state.get(head.weight, {}) if head_opt is not None else {}
    return {"class_start": head.class_start, "num_local": head.num_local, "num_classes": head.num_classes,
            "subcenters": head.subcenters, "weight": head.weight.detach().cpu(),
            "state": {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()}}


def cpu_tensors(state: dict) -> dict:
    """A state dict whose tensors are compact CPU copies: a CPU-only host opens the file
    without `map_location`, and each tensor holds its own bytes, not the whole flat buffer a
    ZeRO-2 parameter is a view of."""
    return {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in state.items()}


def save_checkpoint(output: str, state: TrainState, *, backbone, backbone_opt, head, head_opt,
                    ema=None, scaler=None, config=None, rank: int = 0, world_size: int = 1,
                    keep: int = 2, export_to: str | None = None, extra_meta: dict | None = None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. The sharded states
    (optimizer, EMA) are gathered to rank 0 alone, which writes them; with `export_to`, rank 0
    also writes the weights for export there (the EMA's when EMA is on), from the same gather.
    `extra_meta` joins meta.pt (`imported_from`: a checkpoint without RNG states to restore)."""
    final = os.path.join(output, f"checkpoint-{state.step:08d}")
    tmp = f"{final}.tmp"
    problem = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        problem = _attempt(lambda: os.makedirs(tmp), output, 0)
    _agree(problem, tmp)
    opt_state = backbone_opt.state_dict(to_rank=0)   # collectives: every rank takes part
    ema_state = ema.state_dict(to_rank=0) if ema is not None else None
    head_payload = _head_payload(head, head_opt) if head is not None else None
    # a label-free run (no head): 0 classes, no margin statistics (else identical on every rank)
    num_classes = head.num_classes if head is not None else 0
    margin = {k: v.cpu() for k, v in head.margin_loss.state_dict().items()} if head is not None else {}
    weights = cpu_tensors(backbone.state_dict()) if rank == 0 else None

    def write_parts():
        if head is not None:
            atomic_save(head_payload, os.path.join(tmp, f"head-{head.class_start:010d}-"
                                                        f"{head.class_start + head.num_local:010d}.pt"))
        atomic_save(rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
        if rank == 0:
            atomic_save(weights, os.path.join(tmp, "backbone.pt"))
            atomic_save(opt_state, os.path.join(tmp, "optimizer.pt"))
            if ema_state is not None:
                atomic_save({"state": ema_state, "updates": ema.updates}, os.path.join(tmp, "ema.pt"))
            meta = {**asdict(state), "world_size": world_size, "num_classes": num_classes,
                    "batch_size": int(config.batch_size) if config else 0,
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "margin": margin,
                    "config": plain(dict(config)) if config else {}, **(extra_meta or {})}
            atomic_save(meta, os.path.join(tmp, "meta.pt"))

    # what a checkpoint takes on disk: the previous one's size, else this rank's share times W
    needed = _previous_size(output) or _tensor_bytes([weights, opt_state, ema_state]) + \
        _tensor_bytes(head_payload) * world_size
    _agree(_attempt(write_parts, output, needed), tmp)

    def publish():
        fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(output)
        atomic_write_text(os.path.join(output, "latest"), os.path.basename(final) + "\n")
        prune_checkpoints(output, state.step, state.run_id, keep)
        if export_to:
            atomic_save(exported(ema_state if ema_state is not None else weights), export_to)
    _agree(_attempt(publish, output, needed) if rank == 0 else None, tmp)
    return final


def _attempt(write, output: str, needed: int) -> tuple[str, str] | None:
    """None when `write()` succeeds, else the message to raise on every rank; for want of space
    it names what a checkpoint needs and what was free when this rank failed."""
    try:
        write()
        return None
    except CheckpointError as exc:
        message, no_space = str(exc), isinstance(exc, NoSpaceError)
    except OSError as exc:
        message, no_space = f"{exc.filename or 'checkpoint'}: cannot write ({exc.strerror or exc})", \
            exc.errno == errno.ENOSPC
    if no_space:
        need = f"a checkpoint needs about {needed / 2**20:.0f} MiB; " if needed else ""
        message += f" ({need}{_free_bytes(output) / 2**20:.0f} MiB free); the partial save was removed"
    return ("no space", message) if no_space else ("error", message)


def _agree(problem: tuple[str, str] | None, tmp: str) -> None:
    """Collective: every rank learns whether any rank's write failed (no rank waits forever at
    a barrier for one that gave up); then all raise the first failing rank's error alike, and
    the partial save is removed."""
    problems = [p for p in from_every_rank(problem) if p is not None]
    if not problems:
        return
    if get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kind, message = problems[0]
    raise NoSpaceError(message) if kind == "no space" else CheckpointError(message)


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _previous_size(output: str) -> int:
    found = list_checkpoints(output)
    if not found:
        return 0
    newest = found[-1][1]
    return sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest)
               if os.path.isfile(os.path.join(newest, f)))


def list_checkpoints(output: str) -> list[tuple[int, str]]:
    """(step, directory) of every `checkpoint-<step>` under `output`, oldest first."""
    if not os.path.isdir(output):
        return []
    found = [(int(m.group(1)), os.path.join(output, name))
             for name in os.listdir(output) if (m := CHECKPOINT_NAME.match(name))]
    return sorted(found)


def _meta_or_none(ckpt: str) -> dict | None:
    try:
        meta = torch.load(os.path.join(ckpt, "meta.pt"), map_location="cpu", weights_only=True)
    except Exception:  # missing, truncated or foreign: not an intact checkpoint
        return None
    return meta if isinstance(meta, dict) else None


HEAD_FILE = re.compile(r"^head-(\d+)-(\d+)\.pt$")


def missing_files(ckpt: str, ema_optional: bool = False) -> list[str]:
    """What checkpoint directory `ckpt` lacks to be complete (empty when intact): meta.pt
    readable, backbone.pt, optimizer.pt, head files covering every class of meta's
    num_classes, an rng file per rank of the saved world size (not for an imported run), and
    ema.pt when EMA was on (unless `ema_optional`: a resume that restarts the EMA)."""
    if not os.path.isdir(ckpt):
        return [ckpt]
    meta = _meta_or_none(ckpt)
    if meta is None:
        return ["meta.pt"]
    names = set(os.listdir(ckpt))
    missing = [f for f in ("backbone.pt", "optimizer.pt") if f not in names]
    if (meta.get("config") or {}).get("ema") and "ema.pt" not in names and not ema_optional:
        missing.append("ema.pt")
    if not meta.get("imported_from"):  # an imported run has no RNG states to restore
        missing += [f"rng-rank{r}.pt" for r in range(int(meta.get("world_size", 1)))
                    if f"rng-rank{r}.pt" not in names]
    spans = sorted((int(m.group(1)), int(m.group(2))) for m in map(HEAD_FILE.match, names) if m)
    covered = 0  # the head files must tile [0, num_classes) without a gap
    for a, b in spans:
        if a > covered:
            break
        covered = max(covered, b)
    num_classes = int(meta.get("num_classes", 0))
    if covered < num_classes:
        missing.append(f"head files for classes [{covered}, {num_classes})")
    return missing


def _intact(ckpt: str, ema_optional: bool = False) -> bool:
    return not missing_files(ckpt, ema_optional)


def prune_checkpoints(output: str, newest_step: int, run_id: str, keep: int) -> list[str]:
    """Delete checkpoints of run `run_id` older than `newest_step` so that `keep` remain,
    counting the newest (0 keeps all). Checkpoints of other runs, unreadable ones and newer
    ones are never touched. Returns the deleted directories."""
    if keep <= 0 or not run_id:
        return []
    older = [path for step, path in list_checkpoints(output)
             if step < newest_step and (_meta_or_none(path) or {}).get("run_id") == run_id]
    doomed = older[:max(0, len(older) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(path, onerror=lambda _, where, exc: logger.warning(
            "could not delete %s while pruning old checkpoints (%s): it takes disk space; delete it by hand",
            where, exc[1]))
    return doomed


def find_checkpoint(path: str, ema_optional: bool = False) -> str | None:
    """The checkpoint directory `path` is, or the one a run output's `latest` names; when
    `latest` is missing, dangling or garbage, the newest intact checkpoint (with a warning).
    None when there is none."""
    if os.path.isfile(os.path.join(path, "meta.pt")):
        return path
    latest = os.path.join(path, "latest")
    named = None
    if os.path.isfile(latest):
        with open(latest, "rb") as f:
            named = f.read(256).decode("utf-8", "replace").strip()
        if CHECKPOINT_NAME.match(named) and _intact(os.path.join(path, named), ema_optional):
            return os.path.join(path, named)
    for _, ckpt in reversed(list_checkpoints(path)):
        if _intact(ckpt, ema_optional):
            if named is not None:
                lacks = missing_files(os.path.join(path, named), ema_optional) if CHECKPOINT_NAME.match(named) else []
                logger.warning("%s names %r, which is not an intact checkpoint%s; using the newest intact one, %s",
                               latest, named[:64], f" (it lacks {', '.join(lacks)})" if lacks else "", ckpt)
            return ckpt
    return None


def resolve_checkpoint(path: str, ema_optional: bool = False) -> str:
    """Like `find_checkpoint`, but an error when there is no checkpoint."""
    ckpt = find_checkpoint(path, ema_optional)
    if ckpt is None:
        found = list_checkpoints(path)
        lacks = missing_files(found[-1][1], ema_optional) if found else []
        newest = f" (the newest, {found[-1][1]}, lacks {', '.join(lacks)})" if lacks else ""
        if "ema.pt" in lacks:
            newest += "; --reset_ema true resumes without it, restarting the EMA from the loaded weights"
        raise CheckpointError(f"{path}: not a checkpoint (no meta.pt), and no intact checkpoint-* directory in it"
                              f"{newest}")
    return ckpt


def read_backbone_weights(path: str, ema: bool = True) -> tuple[dict, dict]:
    """(backbone state dict, training config) of the checkpoint at `path` (a checkpoint
    directory or a run output): the EMA weights when the checkpoint has them and `ema`."""
    ckpt = resolve_checkpoint(path)
    config = safe_load(os.path.join(ckpt, "meta.pt")).get("config", {})
    ema_path = os.path.join(ckpt, "ema.pt")
    if ema and os.path.isfile(ema_path):
        return exported(safe_load(ema_path)["state"]), config
    return exported(safe_load(os.path.join(ckpt, "backbone.pt"))), config


def _load_head(ckpt: str, head, head_opt) -> None:
    start, end = head.class_start, head.class_start + head.num_local
    weight = head.weight.detach()
    new_state: dict = {}
    covered = 0
    for name in sorted(n for n in os.listdir(ckpt) if HEAD_FILE.match(n)):
        path = os.path.join(ckpt, name)
        a, b = (int(v) for v in HEAD_FILE.match(name).groups())
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        part = safe_load(path)
        if part["num_classes"] != head.num_classes:
            raise CheckpointError(f"{path}: head of {part['num_classes']} classes, this run has {head.num_classes}")
        k = part.get("subcenters", 1)
        if k != head.subcenters:
            raise CheckpointError(f"{path}: {k} sub-centres per class, this run's margin has {head.subcenters}")
        mine, theirs = slice((lo - start) * k, (hi - start) * k), slice((lo - a) * k, (hi - a) * k)
        with torch.no_grad():
            weight[mine].copy_(part["weight"][theirs])
        for key, v in part["state"].items():
            if torch.is_tensor(v) and v.dim() == 2:
                new_state.setdefault(key, torch.zeros_like(weight, dtype=v.dtype))[mine].copy_(v[theirs])
            else:
                new_state[key] = v
        covered += hi - lo
    if covered != end - start:
        raise CheckpointError(f"{ckpt}: head files cover {covered} of the {end - start} classes [{start}, {end})")
    if head_opt is not None and new_state:
        head_opt.state[head.weight] = new_state


def resume_changes(ckpt: str, saved: dict, saved_margin: dict, margin_loss, config) -> bool:
    """The rule for config changes at resume (docs/training.md, Resuming), one line each. Returns whether
    the checkpoint's margin statistics are loaded.
    - another margin type: refused when either margin keeps running statistics (adaface,
      curricularface), unless `reset_margin` (they start afresh); between state-less margins
      it continues with a warning;
    - another `gradient_acc`: continues, warning that the optimizer step now takes another number
      of batches (steps per epoch and the effective batch change; lr is not rescaled);
    - `ema` turned off: continues, warning that the EMA is dropped and ema.pt no longer written.
    `margin_loss` None: a label-free run (no head), whose margin key means nothing."""
    if config is None:
        return True
    before, now = saved.get("margin", config.margin), config.margin
    if before != now and margin_loss is not None:
        stateful = bool(saved_margin) or bool(margin_loss.state_dict())
        if stateful and not config.reset_margin:
            raise CheckpointError(f"{ckpt}: trained with margin '{before}', this run uses '{now}', and their running "
                                  f"statistics cannot carry over: resume with --margin {before}, or pass "
                                  f"--reset_margin true to start '{now}'s statistics afresh")
        logger.warning("margin '%s' (checkpoint) -> '%s' (this run): the head's weights carry over%s", before, now,
                       "; the margin's running statistics start afresh" if stateful else "")
    acc_before = saved.get("gradient_acc", config.gradient_acc)
    if acc_before != config.gradient_acc:
        logger.warning("gradient_acc %d (checkpoint) -> %d (this run): an optimizer step now takes %d batches per rank, "
                       "so steps per epoch and the effective batch change; lr %g is not rescaled", acc_before,
                       config.gradient_acc, config.gradient_acc, config.lr)
    if saved.get("ema") and not config.ema:
        logger.warning("ema turned off: the checkpoint's EMA is dropped, ema.pt is no longer written, and model.pt "
                       "now holds the trained (not averaged) weights")
    return before == now


def load_checkpoint(path: str, *, backbone, backbone_opt, head, head_opt, ema=None, scaler=None,
                    rank: int = 0, world_size: int = 1, batch_size: int | None = None,
                    config=None) -> tuple[TrainState, dict]:
    """Restore everything saved by `save_checkpoint`, resharding to this world size. With
    `config`, its `optimizer` must be the checkpoint's, and a missing ema.pt of a run that
    had EMA on is an error unless `config.reset_ema`."""
    ckpt = resolve_checkpoint(path, ema_optional=bool(config is not None and config.reset_ema))
    meta = safe_load(os.path.join(ckpt, "meta.pt"))
    saved_config = meta.get("config") or {}
    num_classes = head.num_classes if head is not None else 0  # 0: label-free, no head
    if meta["num_classes"] != num_classes:
        raise CheckpointError(f"{ckpt}: trained with {meta['num_classes']} classes, this run has {num_classes}")
    if config is not None and saved_config.get("optimizer", config.optimizer) != config.optimizer:
        raise CheckpointError(f"{ckpt}: trained with optimizer '{saved_config['optimizer']}', this run uses "
                              f"'{config.optimizer}'; its optimizer state cannot carry over: resume with "
                              f"--optimizer {saved_config['optimizer']}")
    keep_margin = resume_changes(ckpt, saved_config, meta.get("margin") or {},
                                 head.margin_loss if head is not None else None, config)
    weights = safe_load(os.path.join(ckpt, "backbone.pt"))  # a corrupt file is reported as such
    try:
        backbone.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(f"{ckpt}/backbone.pt does not fit this network: {exc}") from None
    backbone_opt.load_state_dict(safe_load(os.path.join(ckpt, "optimizer.pt")))
    if ema is not None:
        ema_path = os.path.join(ckpt, "ema.pt")
        if os.path.isfile(ema_path):
            saved = safe_load(ema_path)
            ema.load_state_dict(saved["state"], updates=saved["updates"])
        elif saved_config.get("ema") and not (config is not None and config.reset_ema):
            raise CheckpointError(f"{ema_path} is missing, but the checkpoint was trained with ema on: restore "
                                  f"the file, or pass --reset_ema true to restart the EMA from the loaded weights")
        else:  # EMA switched on at resume (or reset on request): it starts from the loaded weights
            logger.warning("EMA starts from the weights of %s", ckpt)
            ema.load_state_dict(backbone.state_dict(), updates=0)
    if head is not None:
        _load_head(ckpt, head, head_opt)
    if head is not None and meta.get("margin") and keep_margin:
        head.margin_loss.load_state_dict(meta["margin"])
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    state = TrainState(meta["step"], meta["epoch"], meta["batch_in_epoch"], meta.get("run_id") or new_run_id())
    if meta["world_size"] == world_size and not meta.get("imported_from"):
        set_rng_state(safe_load(os.path.join(ckpt, f"rng-rank{rank}.pt")))
    if batch_size and (meta["world_size"], meta["batch_size"]) != (world_size, batch_size):
        # the samples already seen this epoch, in this run's batches (rounded down)
        seen = meta["batch_in_epoch"] * meta["batch_size"] * meta["world_size"]
        state.batch_in_epoch = seen // (batch_size * world_size)
    return state, meta
