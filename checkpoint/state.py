"""What a checkpoint holds besides weights: the run's position (TrainState), RNG states,
the config as plain values, and the backbone parts that only training uses."""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass

import numpy as np
import torch

# submodules of the training backbone that only training uses (distillation's projection,
# distill/head.py): checkpointed with it, left out of model.pt and of every weights reader
DISTILL_PROJECTION = "distill_projection"  # distill.head registers it on the backbone
TRAINING_ONLY = (DISTILL_PROJECTION,)


def exported(weights: dict | None) -> dict | None:
    """A backbone state dict without its TRAINING_ONLY parts."""
    if weights is None:
        return None
    return {k: v for k, v in weights.items() if k.split(".", 1)[0] not in TRAINING_ONLY}


def weights_fingerprint(weights: dict) -> str:
    """A short hash of a backbone state dict (names, shapes, values), taken as the fp32 network
    that reads it holds them: for the weights a MODEL loads, it equals that Model's fingerprint
    (infer.model.load_model's, of the eval-mode fp32 network). Files derived from a
    model's weights record it (threshold.json)."""
    digest = hashlib.sha256()
    for name, t in sorted(weights.items()):
        t = t.detach().cpu()
        t = t.float() if t.is_floating_point() else t
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def new_run_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # micro-batches this rank consumed in `epoch`
    run_id: str = ""  # names the run across resumes; pruning only deletes its checkpoints
    data_size: int = (
        0  # the data set `batch_in_epoch` counts in (checkpoint/data_position.py); 0: not recorded
    )
    data_fingerprint: str = ""


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }
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


def cpu_tensors(state: dict) -> dict:
    """A state dict whose tensors are compact CPU copies: a CPU-only host opens the file
    without `map_location`, and each tensor holds its own bytes, not the whole flat buffer a
    ZeRO-2 parameter is a view of."""
    return {k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v for k, v in state.items()}
