"""The head against an fp64 full softmax: ArcFace cross-entropy over the whole logit matrix
in float64, and the head's relative errors against it (used by the GPU tests for TF32 and by
benchmarks/gpu.py to record them)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from shardface.heads import PartialFC
from shardface.losses import CombinedMarginLoss

S, M2 = 64.0, 0.5  # ArcFace


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """fp32 matmuls in TF32 ("high") or full fp32 ("highest") inside the block."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def arcface_fp64_reference(emb: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
    """Loss and gradients (embeddings, weight) of the full-softmax ArcFace cross-entropy in float64."""
    e = emb.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    cos = F.normalize(e, dim=1) @ F.normalize(w, dim=1).t()
    target = cos.gather(1, labels[:, None]).squeeze(1)
    theta = torch.arccos(target.clamp(-1.0, 1.0))
    if not bool((theta + M2 <= math.pi).all()):
        raise ValueError("a target angle + m2 exceeds pi: the reference has no fallback branch")
    logits = (S * cos).scatter(1, labels[:, None], (S * torch.cos(theta + M2))[:, None])
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return loss.detach(), e.grad, w.grad


def head_errors_against_fp64(
    device: torch.device,
    tf32: bool,
    classes: int = 20000,
    batch: int = 512,
    dim: int = 512,
    chunk: int | None = 4096,
    precision: str = "fp32",
) -> dict[str, float]:
    """Relative errors of PartialFC's loss and gradients (norm of the difference over the
    reference's norm) against the fp64 reference, with every fp32 matmul in TF32 or not
    (`tf32`, torch's global setting) and the head's own `precision` of its logits GEMM."""
    torch.manual_seed(0)
    head = PartialFC(
        CombinedMarginLoss(S, 1.0, M2, 0.0),
        dim,
        classes,
        1.0,
        chunk_size=chunk,
        validate=False,
        precision=precision,
    ).to(device)
    emb = torch.randn(batch, dim, device=device, requires_grad=True)
    labels = torch.randint(0, classes, (batch,), device=device)
    with matmul_precision(tf32):
        loss = head(emb, labels)
        loss.backward()
    ref_loss, ref_emb, ref_w = arcface_fp64_reference(emb, head.weight, labels)
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad_emb": rel(emb.grad, ref_emb),
        "grad_weight": rel(head.weight.grad, ref_w),
    }
