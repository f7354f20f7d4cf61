"""A run's parts built from its config: the training set, the backbone, the margin head, their optimizers and
the data-parallel module the backbone is called through, and `ModelParts`, all that a step runs and steps.
train.py composes these."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from shardface.backbones import get_model
from shardface.checkpoint.folders import find_checkpoint
from shardface.dataset import build_dataset
from shardface.dataset.aligned import AlignedFolderDataset
from shardface.dataset.errors import DataLayoutError
from shardface.dataset.folders import list_identity_folders, list_images
from shardface.distill.run import Distillation, build_distillation
from shardface.errors import ConfigError
from shardface.faces.align import ARCFACE_112
from shardface.faces.detect import Detection
from shardface.faces.stream import Crop, align_groups
from shardface.faces.workers import default_workers
from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.heads.graph import CapturedHead
from shardface.infer.weights import init_backbone_from
from shardface.losses import build_margin
from shardface.parallel.ddp import DDPOptimizer
from shardface.parallel.ema import ShardedEMA
from shardface.parallel.scaler import DynamicLossScaler
from shardface.parallel.zero import Zero2Optimizer
from shardface.utils.progress import progress_bar
from shardface.utils.seed import seed_everything

logger = logging.getLogger("shardface")

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def build_train_dataset(cfg, train: bool = True, normalize: bool = False) -> torch.utils.data.Dataset:
    """The training set of `cfg.rec`, as uint8 images (the loop normalises them on its device):
    with `cfg.align`, the aligned faces of a folder of photos. `train=False, normalize=True`:
    the same images in the same order, unaugmented and ready for a network (scripts.drop_subcenters)."""
    if cfg.align:
        if cfg.resize:
            raise ConfigError("align true and resize true: choose one (alignment makes 112x112 crops)")
        return build_aligned_dataset(cfg, train, normalize)
    return build_dataset(
        cfg.rec,
        cfg.num_classes,
        train=train,
        skip_bad_images=cfg.skip_bad_images,
        normalize=normalize,
        resize=cfg.resize,
    )


def build_aligned_dataset(cfg, train: bool = True, normalize: bool = False) -> AlignedFolderDataset:
    """`align true`: every photo of the image folder `cfg.rec` (one sub-folder per identity, or
    with num_classes 0 every photo under it) searched for faces at start, on every core (on every
    rank: for large folders run scripts.align once and train on its crops instead); photos without
    a face are left out and named, or refused with `align_strict`. Each item is its photo's
    largest face aligned onto insightface's 112x112 template."""
    if not os.path.isdir(cfg.rec) or os.path.isfile(os.path.join(cfg.rec, "train.rec")):
        raise DataLayoutError(
            f"{cfg.rec}: align true needs an image folder of photos (one sub-folder per "
            "identity); a RecordIO set holds aligned crops already"
        )
    classes, groups = list_identity_folders(cfg.rec) if cfg.num_classes else ([], [list_images(cfg.rec)])
    with progress_bar(sum(map(len, groups)), "finding faces") as bar:
        groups, faces = align_groups(
            groups,
            Detection(cfg.align_detector),
            cfg.align_strict,
            bar.update,
            classes or [cfg.rec],
            default_workers(),
        )
    dataset = AlignedFolderDataset(cfg.rec, classes, groups, faces, Crop(ARCFACE_112), train, normalize)
    if cfg.num_classes and dataset.num_classes != cfg.num_classes:
        raise DataLayoutError(
            f"{cfg.rec}: {dataset.num_classes} identity folders, config num_classes is {cfg.num_classes}"
        )
    return dataset


def build_backbone(cfg) -> nn.Module:
    return get_model(
        cfg.network,
        num_features=cfg.embedding_size,
        dropout=cfg.dropout,
        fp16=cfg.fp16,
        bf16=cfg.bf16,
        grad_checkpoint=cfg.grad_checkpoint,
    )


def init_backbone(cfg, backbone: nn.Module) -> str | None:
    """Fine-tuning: load `cfg.init_backbone`'s weights into a new run's backbone (before the
    data-parallel wrapper copies them). A run that resumes a checkpoint keeps the checkpoint's.
    Returns what was done, for the run's log (which opens only once the run is accepted)."""
    if not cfg.init_backbone:
        return None
    if cfg.resume is True or (cfg.resume == "auto" and find_checkpoint(cfg.output) is not None):
        return f"init_backbone {cfg.init_backbone} ignored: this run resumes the checkpoint in {cfg.output}"
    init_backbone_from(backbone, cfg.init_backbone, cfg.network)
    return f"backbone initialised from {cfg.init_backbone}; the head starts fresh"


def build_head(cfg, device: torch.device | str = "cpu") -> PartialFC | None:
    """The class-sharded margin head on `device`; None for label-free training (`num_classes` 0,
    README 'Distillation'), where the distillation loss is the step's only loss."""
    if cfg.num_classes == 0:
        return None
    if cfg.head_fused_optimizer:
        # the head's rows are stepped inside backward: refuse what that cannot serve exactly
        refuse = {
            "gradient_acc > 1 (rows would step every micro-batch)": cfg.gradient_acc > 1,
            "fp16 (a step the loss scaler skips would already have moved the head)": cfg.fp16,
            "clip_head true with max_grad_norm > 0 (the global norm is not known yet; set "
            "clip_head false to clip the backbone only)": cfg.clip_head and cfg.max_grad_norm > 0,
        }
        bad = [why for why, hit in refuse.items() if hit]
        if bad:
            raise ConfigError("config head_fused_optimizer true cannot serve: " + "; ".join(bad))
    return PartialFC(
        build_margin(cfg),
        cfg.embedding_size,
        cfg.num_classes,
        cfg.sample_rate,
        chunk_size=cfg.chunk_size or None,
        row_block=cfg.row_block,
        precision=cfg.head_precision,
        fused_optimizer=cfg.head_fused_optimizer,
    ).to(device)


def head_graph_blocker(cfg, device: torch.device, distill=None) -> str | None:
    """Why `head_graph` cannot capture this run's head (it then runs eagerly), or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this run is on the {device.type.upper()}"
    if cfg.head_fused_optimizer:
        return "head_fused_optimizer steps the head inside backward, at a learning rate a graph would freeze"
    if distill is not None:
        return "distillation calls the head with a batch of its own"
    return None


def build_head_step(cfg, head: PartialFC | None, device: torch.device, distill=None):
    """What train.py calls for the head's loss: the head, or with `head_graph` its forward and
    backward replayed from CUDA graphs (heads.graph.CapturedHead). Where they cannot be, the head
    itself, and one log line saying why."""
    if head is None or not cfg.head_graph:
        return head
    blocker = head_graph_blocker(cfg, device, distill)
    if blocker is not None:
        logger.info("head_graph true: the head runs eagerly (%s)", blocker)
        return head
    return CapturedHead(head)


def optimizer_class(cfg) -> tuple[type[torch.optim.Optimizer], dict]:
    """The torch optimizer named by `cfg.optimizer` and its keyword arguments."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"config optimizer: unknown optimizer '{cfg.optimizer}' ({', '.join(OPTIMIZERS)})")
    kw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.optimizer == "sgd":
        kw["momentum"] = cfg.momentum
    return OPTIMIZERS[cfg.optimizer], kw


def build_data_parallel(cfg, backbone: nn.Module) -> tuple[nn.Module, Zero2Optimizer | DDPOptimizer]:
    """(the module to call forward on, the backbone optimizer that averages its gradients
    across ranks): ZeRO-2 hooks the backbone itself; DDP wraps it in a module of its own."""
    cls, kw = optimizer_class(cfg)
    if cfg.zero:
        return backbone, Zero2Optimizer(backbone, cls, **kw)
    optimizer = DDPOptimizer(backbone, cls, **kw)
    return optimizer.ddp, optimizer


def build_head_optimizer(cfg, head: PartialFC | None) -> SampledRowsOptimizer | None:
    """The head's own optimizer over its class shard (model-parallel: no reduction); None
    without a head."""
    if head is None:
        return None
    cls, kw = optimizer_class(cfg)
    return SampledRowsOptimizer(head, cls, **kw)


@dataclass
class ModelParts:
    """All that a training step runs and steps, built alike on every rank by `build_model_parts`.

    `model` is what forward is called on: the backbone itself under ZeRO-2, DDP's wrapper
    otherwise. `head` is None label-free (`num_classes` 0), and `head_step` is what the loss
    calls: the head, or its CUDA-graph replay. `distill` is None without a teacher; `ema` and
    `scaler` are None where the config turns them off. `step` is the optimizer step, called on
    every rank alike (its clip and its fp16 check are collectives).
    """

    backbone: nn.Module
    model: nn.Module
    backbone_opt: Zero2Optimizer | DDPOptimizer
    head: PartialFC | None
    head_opt: SampledRowsOptimizer | None
    head_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    distill: Distillation | None
    ema: ShardedEMA | None
    scaler: DynamicLossScaler | None
    clip_head: bool  # false: the global-norm clip covers the backbone alone (arcface_torch)
    initialised: str | None  # what fine-tuning loaded, for the run's log
    optimizers: list = field(init=False)  # stepped in this order
    head_params: list = field(init=False)

    def __post_init__(self) -> None:
        self.optimizers = [opt for opt in (self.backbone_opt, self.head_opt) if opt is not None]
        self.head_params = list(self.head.parameters()) if self.head is not None else []

    def step(self, max_grad_norm: float) -> None:
        """[fp16 unscale] -> global-norm clip -> both optimizers -> EMA, then the gradients
        cleared. A step whose fp16 gradients overflowed on any rank is skipped on all."""
        scaler = self.scaler
        if scaler is None or scaler.unscale_(self.backbone_opt, extra_params=self.head_params):
            clipped_head = self.head_params if self.clip_head else []
            self.backbone_opt.clip_grad_norm_(max_grad_norm, extra_params=clipped_head)
            for opt in self.optimizers:
                opt.step()
            if self.ema is not None:
                self.ema.update()
        for opt in self.optimizers:
            opt.zero_grad()


def build_model_parts(cfg, device: torch.device, rank: int) -> ModelParts:
    """The run's `ModelParts` on `device`, in one fixed order on every rank. The backbone starts
    from the same seed on every rank; from its return on, each rank's randomness (Partial FC's
    sampling) is seeded by `cfg.seed + rank`."""
    torch.manual_seed(cfg.seed)  # identical initial backbone on every rank
    backbone = build_backbone(cfg).to(device)
    initialised = init_backbone(cfg, backbone)  # fine-tuning (not when resuming)
    head = build_head(cfg, device)
    distill = build_distillation(cfg, backbone, device)  # may add a projection to the backbone
    model, backbone_opt = build_data_parallel(cfg, backbone)
    head_opt = build_head_optimizer(cfg, head)
    parts = ModelParts(
        backbone=backbone,
        model=model,
        backbone_opt=backbone_opt,
        head=head,
        head_opt=head_opt,
        head_step=build_head_step(cfg, head, device, distill),
        distill=distill,
        ema=(
            ShardedEMA(backbone, cfg.ema_decay, cfg.ema_tau, optimizer=backbone_opt if cfg.zero else None)
            if cfg.ema
            else None
        ),
        scaler=DynamicLossScaler() if cfg.fp16 else None,
        clip_head=cfg.clip_head,
        initialised=initialised,
    )
    seed_everything(cfg.seed + rank)
    return parts
