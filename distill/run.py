"""Distillation in a training run: the teacher, its targets' centre and the loss that replaces
the head's in the step (docs/distillation.md). train.py builds it with
`build_distillation` and calls `prepare` once the run's output is taken."""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardface.distill.head import DistillLoss, attach_projection
from shardface.distill.losses import DISTILL_LOSSES, centred, constant_student_loss
from shardface.distill.teacher import load_teacher, teacher_statistics
from shardface.distill.teacher_file import TeacherFile, data_transform
from shardface.errors import ConfigError

logger = logging.getLogger("shardface")


class Distillation:
    """The run's teacher and its loss (docs/distillation.md). `loss(head, embeddings,
    labels, images, rows)` replaces `head(embeddings, labels)` in the step; with no head
    (label-free) it is the distillation loss alone."""

    # the student's term must go clearly below a constant student's: this share of it, once this
    # share of the run has passed, or the log warns (uncentred dlib targets let a
    # label-free student sit at a constant's level while its loss fell)
    COLLAPSE_RATIO, COLLAPSE_AFTER = 0.8, 0.2

    def __init__(self, teacher, loss: DistillLoss):
        self.teacher, self.distill_loss = teacher, loss
        self.constant_loss: float | None = None
        self._warned = False

    def prepare(self, cfg, dataset, device, resumed: dict | None) -> None:
        """Before the first step: the centre of the teacher's targets (`distill_center`), the
        checkpoint's when resuming one that has it from this teacher (so a resume keeps it), else
        measured (distill.teacher.teacher_statistics); and the loss a constant student would get."""
        saved = (resumed or {}).get("distill")
        measured_on = (saved or {}).get("teacher")  # None in a checkpoint from before it was recorded
        other_teacher = measured_on is not None and not self._is_teacher(measured_on)
        same_centring = saved is not None and bool(saved.get("center") is not None) == bool(
            cfg.distill_center
        )
        if same_centring and not other_teacher:
            center = saved["center"]
            self.distill_loss.center = None if center is None else center.to(device)
            self.constant_loss = saved.get("constant_loss")
            return
        mean, sample = teacher_statistics(self.teacher, dataset, cfg.distill_center_samples, device)
        center = mean if cfg.distill_center else None
        self.distill_loss.center = center
        self.constant_loss = (
            constant_student_loss(cfg.distill_loss, centred(sample, center)) if len(sample) else None
        )
        # the sample's targets are unit vectors (teacher_statistics): their mean cosine to the mean direction
        spread = (
            float(sample.matmul(torch.nn.functional.normalize(mean, dim=0)).mean())
            if len(sample)
            else float("nan")
        )
        if other_teacher:
            logger.warning(
                "teacher %s (fingerprint %s) now, but the checkpoint's centre and constant-student loss "
                "came from teacher %s (fingerprint %s): measured again for this teacher",
                self.teacher.name,
                self.teacher.fingerprint or "unknown",
                measured_on.get("name"),
                measured_on.get("fingerprint") or "unknown",
            )
        elif resumed is not None:
            logger.warning(
                "distill_center %s now, but the checkpoint's targets were %s: the targets change from "
                "this step",
                "true" if cfg.distill_center else "false",
                "not centred" if cfg.distill_center else "centred",
            )
        logger.info(
            "teacher %s: mean cosine of its targets to their mean direction %.3f; targets %s; a constant "
            "student's %s loss is %.4f",
            self.teacher.name,
            spread,
            "centred (distill_center true)" if center is not None else "not centred",
            cfg.distill_loss,
            self.constant_loss if self.constant_loss is not None else float("nan"),
        )

    def _is_teacher(self, recorded: dict) -> bool:
        """Whether `recorded` (a checkpoint's "teacher") names this run's teacher: by fingerprint
        where both have one (a moved file or a renamed run is the same teacher), else by name."""
        if recorded.get("fingerprint") and self.teacher.fingerprint:
            return recorded["fingerprint"] == self.teacher.fingerprint
        return recorded.get("name") == self.teacher.name

    def checkpoint_meta(self) -> dict:
        """What a resume needs to give the same targets (joins the checkpoint's meta.pt): the
        centre, the constant student's loss, and the teacher they were measured on."""
        center = self.distill_loss.center
        return {
            "distill": {
                "center": None if center is None else center.detach().cpu(),
                "constant_loss": self.constant_loss,
                "teacher": {"name": self.teacher.name, "fingerprint": self.teacher.fingerprint},
            }
        }

    def report(self, step: int, total_steps: int) -> None:
        """At a log step: the distillation term beside a constant student's loss; a warning,
        once, when the student is not clearly below it after the run's first part."""
        term = self.distill_loss.take_term()
        if term is None or self.constant_loss is None:
            return
        logger.info(
            "step %d: distillation term %.4f (a constant student: %.4f)", step, term, self.constant_loss
        )
        if (
            not self._warned
            and step >= self.COLLAPSE_AFTER * total_steps
            and term > self.COLLAPSE_RATIO * self.constant_loss
        ):
            self._warned = True
            logger.warning(
                "step %d: the distillation term %.4f is not clearly below the %.4f a constant student gets: "
                "the student may be learning the teacher's shared direction, not identities%s",
                step,
                term,
                self.constant_loss,
                "" if self.distill_loss.center is not None else " (distill_center false: try true)",
            )

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
                raise ConfigError(
                    f"config skip_bad_images true with teacher file {self.teacher.path}: a skipped image "
                    f"is replaced by the next one, which would meet another image's target"
                )
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
        raise ConfigError(
            f"config distill_loss = {cfg.distill_loss!r}: expected one of {', '.join(DISTILL_LOSSES)}"
        )
    precision = "fp16" if cfg.fp16 else "bf16" if cfg.bf16 else None
    teacher = load_teacher(cfg.teacher, cfg.teacher_network, device, precision)
    if getattr(teacher, "cast_once", 0):
        logger.info(
            "teacher %s: the weights of %d layers cast to %s once (not by autocast at every step)",
            teacher.name,
            teacher.cast_once,
            precision,
        )
    projection = None
    if cfg.distill_loss == "cosine" and teacher.dim != cfg.embedding_size:
        projection = attach_projection(backbone, cfg.embedding_size, teacher.dim, cfg.seed + 29)
    return Distillation(teacher, DistillLoss(cfg.distill_loss, cfg.distill_weight, projection))
