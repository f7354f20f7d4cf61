"""The config keys that may differ between the ranks of one job; every other key must be the
same on every rank, and train.py refuses a job whose ranks disagree (parallel/agreement.py)."""

from __future__ import annotations

# key -> why it may differ per rank
PER_RANK_KEYS = {
    "output": "one shared directory may be mounted at another path on each node; that every rank sees the same "
    "directory is checked on the directory itself (checkpoint/run_lock.py)",
    "num_workers": "loader processes are a node's CPU resource; a sample's pixels and mirroring depend only on "
    "(seed, epoch, index), never on which worker read it",
}
SECRET_KEYS = ("wandb_key",)  # compared, but their values are never printed


def rank_independent(cfg: dict) -> dict:
    """`cfg` without the keys that may differ per rank."""
    return {key: value for key, value in cfg.items() if key not in PER_RANK_KEYS}
