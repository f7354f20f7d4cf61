"""Distillation losses between a student's and a teacher's embeddings.

Both are pure functions of the rows they are given; distill/head.py decides which rows
each rank passes, so that W ranks equal one process with the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DISTILL_LOSSES = ("cosine", "relational")


def centred(targets: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor:
    """The teacher's targets with its mean embedding `center` (over the training data)
    subtracted and re-normalised: what is left is what tells identities apart. None: as given."""
    if center is None:
        return targets
    return F.normalize(F.normalize(targets.float(), dim=1, eps=1e-12) - center.float(), dim=1, eps=1e-12)


def constant_student_loss(kind: str, targets: torch.Tensor) -> float:
    """The loss of the best student that gives every image one and the same embedding, on these
    (already centred, if so) unit targets: the level a trained student must be clearly below.
    cosine: 1 - |mean target| (the constant is the mean direction); relational: every student
    cosine is 1, so the mean of (1 - cos(t_i, t_j))^2."""
    t = F.normalize(targets.double(), dim=1, eps=1e-12)
    if kind == "cosine":
        return float(1.0 - t.mean(0).norm())
    return float((1.0 - t @ t.T).square().mean())


def cosine_distill(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """mean over rows of 1 - cos(student_i, teacher_i); both N x D (the student already
    projected to the teacher's D when the sizes differ)."""
    return (1.0 - F.cosine_similarity(student.float(), teacher.float(), dim=1, eps=1e-12)).mean()


def relational_distill(
    student_rows: torch.Tensor,
    student_all: torch.Tensor,
    teacher_rows: torch.Tensor,
    teacher_all: torch.Tensor,
) -> torch.Tensor:
    """mean over (i in rows, j in all) of (cos(s_i, s_j) - cos(t_i, t_j))^2: the student's and
    the teacher's cosine-similarity matrices compared, rows x all of them. Student and teacher
    may have different sizes D (no projection). With rows = all this is the whole batch's
    N x N comparison."""
    s_rows, s_all = F.normalize(student_rows.float(), dim=1), F.normalize(student_all.float(), dim=1)
    t_rows, t_all = F.normalize(teacher_rows.float(), dim=1), F.normalize(teacher_all.float(), dim=1)
    return (s_rows @ s_all.T - t_rows @ t_all.T).square().mean()
