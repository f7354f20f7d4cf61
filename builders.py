"""A run's parts built from its config: the backbone, the margin head, their optimizers and
the data-parallel module the backbone is called through. train.py composes these."""
from __future__ import annotations

import logging

import torch
from torch import nn

from backbones import get_model
from checkpoint.folders import find_checkpoint
from configs.errors import ConfigError
from dataset import build_dataset
from distill.head import DistillLoss, attach_projection
from distill.losses import DISTILL_LOSSES, centred, constant_student_loss
from distill.teacher import load_teacher, teacher_statistics
from distill.teacher_file import TeacherFile, data_transform
from faces.folder_dataset import build_aligned_dataset
from heads import PartialFC, SampledRowsOptimizer
from infer.weights import init_backbone_from
from losses import build_margin
from parallel.ddp import DDPOptimizer
from parallel.zero import Zero2Optimizer

logger = logging.getLogger("shardface")

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def build_train_dataset(cfg, train: bool = True, normalize: bool = False) -> torch.utils.data.Dataset:
    """The training set of `cfg.rec`, as uint8 images (the loop normalises them on its device):
    with `cfg.align`, the aligned faces of a folder of photos. `train=False, normalize=True`:
    the same images in the same order, unaugmented and ready for a network (scripts.drop_subcenters)."""
    if cfg.align:
        if cfg.resize:
            raise ConfigError("align true and resize true: choose one (alignment makes 112x112 crops)")
        return build_aligned_dataset(cfg.rec, cfg.num_classes, cfg.align_detector, train=train,
                                     normalize=normalize, strict=cfg.align_strict)
    return build_dataset(cfg.rec, cfg.num_classes, train=train, skip_bad_images=cfg.skip_bad_images,
                         normalize=normalize, resize=cfg.resize)


def build_backbone(cfg) -> nn.Module:
    return get_model(cfg.network, num_features=cfg.embedding_size, dropout=cfg.dropout,
                     fp16=cfg.fp16, bf16=cfg.bf16, grad_checkpoint=cfg.grad_checkpoint)


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
        refuse = {"gradient_acc > 1 (rows would step every micro-batch)": cfg.gradient_acc > 1,
                  "fp16 (a step the loss scaler skips would already have moved the head)": cfg.fp16,
                  "clip_head true with max_grad_norm > 0 (the global norm is not known yet; set "
                  "clip_head false to clip the backbone only)": cfg.clip_head and cfg.max_grad_norm > 0}
        bad = [why for why, hit in refuse.items() if hit]
        if bad:
            raise ConfigError("config head_fused_optimizer true cannot serve: " + "; ".join(bad))
    return PartialFC(build_margin(cfg), cfg.embedding_size, cfg.num_classes, cfg.sample_rate,
                     chunk_size=cfg.chunk_size or None,
                     row_block=cfg.row_block, precision=cfg.head_precision,
                     fused_optimizer=cfg.head_fused_optimizer).to(device)


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


class Distillation:
    """The run's teacher and its loss (issue #29; README 'Distillation'). `loss(head, embeddings,
    labels, images, rows)` replaces `head(embeddings, labels)` in the step; with no head
    (label-free) it is the distillation loss alone."""

    # the student's term must go clearly below a constant student's: this share of it, once this
    # share of the run has passed, or the log warns (issue #40: uncentred dlib targets let a
    # label-free student sit at a constant's level while its loss fell)
    COLLAPSE_RATIO, COLLAPSE_AFTER = 0.8, 0.2

    def __init__(self, teacher, loss: DistillLoss):
        self.teacher, self.distill_loss = teacher, loss
        self.constant_loss: float | None = None
        self._warned = False

    def prepare(self, cfg, dataset, device, resumed: dict | None) -> None:
        """Before the first step: the centre of the teacher's targets (`distill_center`), the
        checkpoint's when resuming one that has it (so a resume keeps it), else measured
        (distill.teacher.teacher_statistics); and the loss a constant student would get."""
        saved = (resumed or {}).get("distill")
        if saved is not None and bool(saved.get("center") is not None) == bool(cfg.distill_center):
            center = saved["center"]
            self.distill_loss.center = None if center is None else center.to(device)
            self.constant_loss = saved.get("constant_loss")
            return
        mean, sample = teacher_statistics(self.teacher, dataset, cfg.distill_center_samples, device)
        center = mean if cfg.distill_center else None
        self.distill_loss.center = center
        self.constant_loss = constant_student_loss(cfg.distill_loss, centred(sample, center)) if len(sample) else None
        # the sample's targets are unit vectors (teacher_statistics): their mean cosine to the mean direction
        spread = float(sample.matmul(torch.nn.functional.normalize(mean, dim=0)).mean()) if len(sample) else float("nan")
        if resumed is not None:
            logger.warning("distill_center %s now, but the checkpoint's targets were %s: the targets change from "
                           "this step", "true" if cfg.distill_center else "false",
                           "not centred" if cfg.distill_center else "centred")
        logger.info("teacher %s: mean cosine of its targets to their mean direction %.3f; targets %s; a constant "
                    "student's %s loss is %.4f", self.teacher.name, spread,
                    "centred (distill_center true)" if center is not None else "not centred", cfg.distill_loss,
                    self.constant_loss if self.constant_loss is not None else float("nan"))

    def checkpoint_meta(self) -> dict:
        """What a resume needs to give the same targets (joins the checkpoint's meta.pt)."""
        center = self.distill_loss.center
        return {"distill": {"center": None if center is None else center.detach().cpu(),
                            "constant_loss": self.constant_loss}}

    def report(self, step: int, total_steps: int) -> None:
        """At a log step: the distillation term beside a constant student's loss; a warning,
        once, when the student is not clearly below it after the run's first part."""
        term = self.distill_loss.take_term()
        if term is None or self.constant_loss is None:
            return
        logger.info("step %d: distillation term %.4f (a constant student: %.4f)", step, term, self.constant_loss)
        if not self._warned and step >= self.COLLAPSE_AFTER * total_steps and \
                term > self.COLLAPSE_RATIO * self.constant_loss:
            self._warned = True
            logger.warning("step %d: the distillation term %.4f is not clearly below the %.4f a constant student gets: "
                           "the student may be learning the teacher's shared direction, not identities%s", step, term,
                           self.constant_loss, "" if self.distill_loss.center is not None else
                           " (distill_center false: try true)")

    @property
    def teacher_rows(self):
        """What the DataLoader's workers read per record with its image (a teacher file's
        `row`), or None: get_dataloader's `teacher_rows`."""
        return self.teacher.teacher_rows

    def check_data(self, cfg, dataset) -> None:
        """A teacher file must belong to this run's data, read as this run reads it (at start,
        before the run is accepted)."""
        if isinstance(self.teacher, TeacherFile):
            if cfg.skip_bad_images:
                raise ConfigError(f"config skip_bad_images true with teacher file {self.teacher.path}: a skipped image "
                                  f"is replaced by the next one, which would meet another image's target")
            self.teacher.check_data(cfg.rec, len(dataset), dataset.fingerprint(), data_transform(cfg))

    def loss(self, head, embeddings, labels, images, rows) -> torch.Tensor:
        """`rows`: what the loader's batch held after the labels (a teacher file's rows), or []."""
        targets = self.teacher.targets(images, rows[0] if rows else None)
        return self.distill_loss(head, embeddings, labels, targets)


def build_distillation(cfg, backbone: nn.Module, device) -> Distillation | None:
    """None without `cfg.teacher`. Otherwise the teacher (checked at start: it runs on its
    input and gives N x D), and for the cosine loss with D_t != embedding_size a projection
    registered on the backbone (distill.head.attach_projection): call before
    build_data_parallel, after init_backbone."""
    if not cfg.teacher:
        return None
    if cfg.distill_loss not in DISTILL_LOSSES:
        raise ConfigError(f"config distill_loss = {cfg.distill_loss!r}: expected one of {', '.join(DISTILL_LOSSES)}")
    precision = "fp16" if cfg.fp16 else "bf16" if cfg.bf16 else None
    teacher = load_teacher(cfg.teacher, cfg.teacher_network, device, precision)
    if getattr(teacher, "cast_once", 0):
        logging.getLogger("shardface").info("teacher %s: the weights of %d layers cast to %s once (not by autocast "
                                            "at every step)", teacher.name, teacher.cast_once, precision)
    projection = None
    if cfg.distill_loss == "cosine" and teacher.dim != cfg.embedding_size:
        projection = attach_projection(backbone, cfg.embedding_size, teacher.dim, cfg.seed + 29)
    return Distillation(teacher, DistillLoss(cfg.distill_loss, cfg.distill_weight, projection))

