"""The margin heads written straight from their papers (and the authors' code), over full
B x C logits on one process, independently of losses/: what the sharded heads must equal.

Each `*_loss(emb, weight, labels, state)` returns (loss, new_state); `state` holds the
running statistics before the step. `classes` restricts the softmax to those classes
(Partial FC's sample), labels given as class ids.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _cosines(emb, weight, k=1):
    cos = F.normalize(emb) @ F.normalize(weight).t()
    if k > 1:
        cos = cos.view(cos.shape[0], -1, k).max(2).values
    return cos


def _ce(logits, labels, classes):
    if classes is not None:
        logits = logits[:, classes]
        labels = torch.searchsorted(classes, labels)
    return F.cross_entropy(logits, labels)


def arcface_target(cos_y, m):
    """cos(theta + m), continuing as cos - m sin(m) once theta + m passes pi."""
    theta = torch.acos(cos_y.clamp(-1 + 1e-7, 1 - 1e-7))
    return torch.where(cos_y > math.cos(math.pi - m), torch.cos(theta + m), cos_y - math.sin(math.pi - m) * m)


def adaface_loss(emb, weight, labels, state, s=64.0, m=0.4, h=0.333, t_alpha=0.01, classes=None):
    eps = 1e-3
    norms = emb.norm(dim=1)
    cos = (F.normalize(emb) @ F.normalize(weight).t()).clamp(-1 + eps, 1 - eps)
    safe = norms.clamp(0.001, 100).detach()
    mean = safe.mean() * t_alpha + (1 - t_alpha) * state["mean"]
    std = safe.std() * t_alpha + (1 - t_alpha) * state["std"]
    scaler = ((safe - mean) / (std + eps) * h).clamp(-1, 1)
    onehot = F.one_hot(labels, cos.shape[1]).float()
    theta = cos.acos()
    theta_m = (theta + onehot * (-m * scaler)[:, None]).clamp(eps, math.pi - eps)
    logits = (theta_m.cos() - onehot * (m + m * scaler)[:, None]) * s
    return _ce(logits, labels, classes), {"mean": mean, "std": std}


def magface_loss(
    emb,
    weight,
    labels,
    state,
    s=64.0,
    l_a=10.0,
    u_a=110.0,
    l_m=0.45,
    u_m=0.8,
    lambda_g=20.0,
    easy_margin=True,
    classes=None,
):
    a = emb.norm(dim=1).clamp(l_a, u_a)
    margin = (u_m - l_m) / (u_a - l_a) * (a - l_a) + l_m
    cos = (F.normalize(emb) @ F.normalize(weight).t()).clamp(-1, 1)
    b = torch.arange(len(labels))
    cos_y = cos[b, labels]
    with_margin = torch.cos(torch.acos(cos_y.clamp(-1 + 1e-7, 1 - 1e-7)) + margin)
    if easy_margin:
        target = torch.where(cos_y > 0, with_margin, cos_y)
    else:
        target = torch.where(
            cos_y > torch.cos(math.pi - margin), with_margin, cos_y - torch.sin(math.pi - margin) * margin
        )
    logits = (s * cos).index_put((b, labels), s * target)
    reg = (a / u_a**2 + 1 / a).mean()
    return _ce(logits, labels, classes) + lambda_g * reg, state


def curricularface_loss(emb, weight, labels, state, s=64.0, m=0.5, classes=None):
    cos = (F.normalize(emb) @ F.normalize(weight).t()).clamp(-1, 1)
    b = torch.arange(len(labels))
    cos_y = cos[b, labels]
    cos_y_m = torch.cos(torch.acos(cos_y.clamp(-1 + 1e-7, 1 - 1e-7)) + m)  # cos(theta_y + m)
    t = cos_y.detach().mean() * 0.01 + 0.99 * state["t"]
    hard = cos > cos_y_m.detach()[:, None]
    logits = torch.where(hard, cos * (t + cos), cos)
    logits = logits.index_put((b, labels), arcface_target(cos_y, m))
    return _ce(s * logits, labels, classes), {"t": t}


def subcenter_arcface_loss(emb, weight, labels, state, s=64.0, margin=0.5, k=3, classes=None):
    cos = _cosines(emb, weight, k)
    b = torch.arange(len(labels))
    logits = (s * cos).index_put((b, labels), s * arcface_target(cos[b, labels], margin))
    return _ce(logits, labels, classes), state


INITIAL_STATE = {
    "adaface": {"mean": torch.tensor(20.0), "std": torch.tensor(100.0)},
    "curricularface": {"t": torch.tensor(0.0)},
    "magface": {},
    "subcenter_arcface": {},
}
