"""Capacity model: per-rank memory and traffic of a ShardFace job, from its config.

Pure arithmetic over the layouts the code really uses (heads/sharded_ce.py, parallel/zero.py),
except the backbone's parameter count and activations, which are read off the network built
on the `meta` device (no memory): activations are the bytes autograd saves for backward at
the batch size. `scripts/plan.py` prints it; tests hold its head and ZeRO-2 figures against
peaks measured on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shardface.errors import ConfigError
from shardface.heads.sharding import check_world_fits, class_shard

F32 = 4
GB = 1e9
STATE_PER_PARAM = {"sgd": 1, "adamw": 2}  # fp32 tensors of optimizer state per parameter
CUDA_RESERVE = 1.5e9  # CUDA context, NCCL buffers, allocator slack: kept free on the GPU
# channels-last batches (config.channels_last) raised the backbone step's peak by 1479 MiB (r50)
# and 1476 MiB (r100) at batch 128, fp16, on an H100 (benchmarks/runs/gpu.md): the same for
# both depths, so not saved activations (those are layout-free: the same bytes either way on the
# CPU); taken here as scratch growing with the batch, from that one batch size
CHANNELS_LAST_SCRATCH_PER_SAMPLE = 1477 * 2**20 / 128


@dataclass
class Plan:
    """Bytes per rank, by part (`parts`), and bytes each rank sends per step (`sends`)."""

    parts: dict[str, float] = field(default_factory=dict)
    sends: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def head_bytes(self) -> float:
        return sum(v for k, v in self.parts.items() if k.startswith("head"))

    def zero_bytes(self) -> float:
        return sum(v for k, v in self.parts.items() if k.startswith("zero"))


def head_memory(
    num_classes: int,
    world: int,
    batch: int,
    dim: int,
    *,
    subcenters: int = 1,
    sample_rate: float = 1.0,
    chunk: int = 8192,
    row_block: int = 128,
    optimizer: str = "sgd",
    momentum: float = 0.9,
    fused: bool = False,
) -> dict[str, float]:
    """Per-rank bytes of the class-sharded head (the largest shard, rank 0)."""
    n = class_shard(num_classes, world, 0).size
    B = batch * world
    rows = n * subcenters * dim * F32
    n_used = n if sample_rate >= 1 else min(n, max(int(sample_rate * n), B))
    tile = min(chunk or n_used, n_used) * subcenters
    states = STATE_PER_PARAM[optimizer] if (optimizer != "sgd" or momentum > 0) else 0
    parts = {"head weight": rows, "head optimizer state": states * rows}
    if fused:  # backward recomputes a B x tile block per tile and steps it; no gradient, no kept cosines
        # (a tile's rows are stepped in place; sampled rows are gathered with their state)
        parts["head tile buffers"] = 4 * B * tile * F32 + (2 * tile * dim * F32 if sample_rate < 1 else 0)
    else:
        parts["head weight gradient"] = rows
        # the first min(B, dim) rows' cosines live in the weight gradient (sampling: no first
        # block there); the rest in row_block x shard
        first = min(B, dim) if sample_rate >= 1 else 0
        r = min(row_block, B - first)
        parts["head kept cosines"] = r * n_used * subcenters * F32
        # a block's tile and its gradient (the radial term is taken from the tile)
        parts["head tile buffers"] = 2 * max(first, r) * tile * F32 + (
            2 * tile * dim * F32 if sample_rate < 1 else 0
        )
    parts["head embeddings"] = 4 * B * dim * F32  # gathered, normalised, their gradient, target rows
    return parts


def backbone_counts(network: str, dim: int, batch: int, grad_checkpoint: bool = False) -> tuple[int, int]:
    """(parameters, bytes saved for backward at `batch` in fp32), from a meta-device forward."""
    from shardface.backbones import get_model

    with torch.device("meta"):
        model = get_model(network, num_features=dim, grad_checkpoint=grad_checkpoint)
        params = sum(p.numel() for p in model.parameters())
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.empty(batch, 3, 112, 112))
    return params, saved[0]


def zero_memory(
    params: int, world: int, optimizer: str = "sgd", momentum: float = 0.9, param_bytes: int = F32
) -> dict[str, float]:
    """Per-rank bytes of ZeRO-2 beyond the parameters, on the NCCL (collective) exchange: fp32
    gradient and state shards, and the persistent bucket buffer the parameters' gradients
    are views of (one model-dtype copy of the gradients, reduce-scattered bucket by bucket).
    Gloo's point-to-point exchange lends buckets from a pool instead: not modelled."""
    shard = math.ceil(params / world) * F32
    states = STATE_PER_PARAM[optimizer] if (optimizer != "sgd" or momentum > 0) else 0
    return {
        "zero gradient shard": shard,
        "zero optimizer state shard": states * shard,
        "zero gradient buckets": params * param_bytes if world > 1 else 0.0,
    }


def forward_peak(network: str, dim: int, batch: int, size: tuple[int, int] = (112, 112)) -> int:
    """Bytes of the largest input plus output of one module in a no-gradient forward (a frozen
    teacher keeps nothing for backward), from a meta-device forward."""
    from shardface.backbones import get_model

    peak = [0]

    def hook(module, inputs, output):
        if torch.is_tensor(output) and inputs and torch.is_tensor(inputs[0]):
            nbytes = (inputs[0].numel() + output.numel()) * F32
            peak[0] = max(peak[0], nbytes)

    with torch.device("meta"), torch.no_grad():
        model = get_model(network, num_features=dim)
        for m in model.modules():
            m.register_forward_hook(hook)
        model(torch.empty(batch, 3, *size))
    return peak[0]


def teacher_memory(cfg) -> dict[str, float]:
    """Per-rank bytes of distillation's teacher: an on-the-fly one's fp32 weights (read from its
    file) and the peak of its no-gradient forward on the rank's batch; a teacher file's batch
    of rows. (The projection, embedding_size x D_t, is counted nowhere: it is tiny.)"""
    if not cfg.get("teacher"):
        return {}
    import os

    from shardface.distill.teacher_file import TeacherFile, is_teacher_file
    from shardface.infer.weights import load_backbone_state

    if is_teacher_file(cfg.teacher):
        return {"teacher targets": cfg.batch_size * TeacherFile(cfg.teacher).dim * F32}
    if cfg.teacher.lower().endswith(".onnx"):  # onnxruntime's weights; its activations are not modelled
        return {"teacher weights (onnx)": float(os.path.getsize(cfg.teacher))}
    state, config = load_backbone_state(cfg.teacher)
    weights = sum(v.numel() for v in state.values() if v.is_floating_point()) * F32
    network = cfg.get("teacher_network") or config.get("network")
    dim = config.get("embedding_size", 512)
    parts = {"teacher weights": float(weights)}
    if network:
        parts["teacher forward"] = float(forward_peak(network, dim, cfg.batch_size))
    return parts


def plan(cfg, gpus: int) -> Plan:
    """The whole job per rank: backbone (ZeRO-2 or DDP), activations, head (none when label-free,
    num_classes 0); and traffic."""
    headless = cfg.num_classes == 0
    if not headless:
        check_world_fits(cfg.num_classes, gpus)  # what train.py would refuse does not fit
    params, saved = backbone_counts(cfg.network, cfg.embedding_size, cfg.batch_size, cfg.grad_checkpoint)
    half = 0.5 if (cfg.fp16 or cfg.bf16) else 1.0  # autocast: activations mostly in 16 bits
    p = Plan()
    p.parts["backbone parameters"] = params * F32
    if cfg.zero:
        p.parts.update(zero_memory(params, gpus, cfg.optimizer, cfg.momentum))
    else:
        states = STATE_PER_PARAM[cfg.optimizer] if (cfg.optimizer != "sgd" or cfg.momentum > 0) else 0
        p.parts["ddp gradient"] = params * F32
        p.parts["ddp optimizer state"] = states * params * F32
    p.parts["backbone activations"] = saved * half
    if cfg.get("channels_last"):
        p.parts["backbone channels-last scratch"] = CHANNELS_LAST_SCRATCH_PER_SAMPLE * cfg.batch_size
    if not headless:
        p.parts.update(
            head_memory(
                cfg.num_classes,
                gpus,
                cfg.batch_size,
                cfg.embedding_size,
                sample_rate=cfg.sample_rate,
                chunk=cfg.chunk_size,
                row_block=cfg.row_block,
                optimizer=cfg.optimizer,
                momentum=cfg.momentum,
                fused=cfg.head_fused_optimizer,
            )
        )
    p.parts.update(teacher_memory(cfg))
    W, b, D = gpus, cfg.batch_size, cfg.embedding_size
    ring = (W - 1) / W
    p.sends = {
        "embeddings all-gather": (W - 1) * b * D * F32,
        "labels all-gather": (W - 1) * b * 8,
        "target cosines all-reduce": 2 * ring * W * b * F32,
        "row statistics all-gather": (W - 1) * W * b * F32,
        "embedding gradients reduce-scatter": ring * W * b * D * F32,
    }
    if headless:  # no head: only the relational loss gathers (and scatters back) the embeddings
        gathered = cfg.get("distill_loss") == "relational"
        p.sends = {k: v for k, v in p.sends.items() if gathered and k.startswith("embedding")}
    p.sends[("ZeRO-2 gradients + parameters" if cfg.zero else "DDP all-reduce")] = 2 * ring * params * F32
    return p


def budget_bytes(gpu_mem_gb: float) -> float:
    """The bytes a rank may plan for on a GPU of `gpu_mem_gb` GB: less CUDA_RESERVE. The memory
    must be a finite number of GB above the reserve (nan made `int(nan)` fail deep in
    `max_classes`; a negative one planned for a GPU that cannot exist)."""
    if not (
        isinstance(gpu_mem_gb, (int, float)) and math.isfinite(gpu_mem_gb) and gpu_mem_gb * GB > CUDA_RESERVE
    ):
        raise ConfigError(
            f"--gpu_mem_gb {gpu_mem_gb}: expected the GPU's memory in GB, a finite number above the "
            f"{CUDA_RESERVE / GB:g} GB kept for CUDA, NCCL and the allocator (e.g. 80)"
        )
    return gpu_mem_gb * GB - CUDA_RESERVE


def _check_budget(budget: float) -> None:
    if not math.isfinite(budget):
        raise ConfigError(
            f"memory budget {budget} bytes per rank: expected a finite number (see budget_bytes)"
        )


def max_classes(cfg, gpus: int, budget: float) -> int:
    """The largest num_classes whose plan fits `budget` bytes per rank (memory grows
    linearly with the classes per rank, so two points give the line)."""
    _check_budget(budget)

    def total(c):
        cfg2 = dict(cfg)
        cfg2["num_classes"] = c
        return plan(_Cfg(cfg2), gpus).total

    c0, c1 = gpus * 100_000, gpus * 1_100_000  # shards past the tile size: memory is linear there
    t0, t1 = total(c0), total(c1)
    slope = (t1 - t0) / (c1 - c0)
    return max(0, int(c0 + (budget - t0) / slope))


def pfc_v2_head_memory(num_classes: int, world: int, batch: int, dim: int, fp16: bool = True) -> float:
    """arcface_torch PFC v2 (sample_rate 1) per rank, by its algorithm: weight, gradient and
    momentum (fp32), the normalised weight copy (fp16 under amp), the B x n logits and the
    probabilities kept for backward (fp32)."""
    n = class_shard(num_classes, world, 0).size
    B = batch * world
    return 3 * n * dim * F32 + n * dim * (2 if fp16 else F32) + 2 * B * n * F32


def pfc_v2_max_classes(cfg, gpus: int, budget: float) -> int:
    """The same question for arcface_torch: DDP backbone (parameters, gradient, momentum),
    the same activations, and PFC v2's head (`pfc_v2_head_memory`)."""
    _check_budget(budget)
    params, saved = backbone_counts(cfg.network, cfg.embedding_size, cfg.batch_size, cfg.grad_checkpoint)
    fixed = 3 * params * F32 + saved * (0.5 if (cfg.fp16 or cfg.bf16) else 1.0)
    c0, c1 = gpus * 100_000, gpus * 1_100_000  # shards past the tile size: memory is linear there
    h0 = pfc_v2_head_memory(c0, gpus, cfg.batch_size, cfg.embedding_size, cfg.fp16)
    h1 = pfc_v2_head_memory(c1, gpus, cfg.batch_size, cfg.embedding_size, cfg.fp16)
    slope = (h1 - h0) / (c1 - c0)
    return max(0, int(c0 + (budget - fixed - h0) / slope))


class _Cfg(dict):
    __getattr__ = dict.__getitem__
