"""What an arcface_torch key means here when ShardFace does it its own way: one log line each."""

from __future__ import annotations


def compat_notes(cfg: dict) -> list[str]:
    """Warnings for arcface_torch keys that ShardFace accepts but serves differently."""
    notes = []
    if cfg.get("dali") or cfg.get("dali_aug"):
        notes.append(
            "config dali/dali_aug asks for NVIDIA DALI: ShardFace runs its own loader (workers decode "
            "in parallel, images mirrored at random); set dali False to silence this"
        )
    return notes
