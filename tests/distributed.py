"""The multi-rank test helper (see parallel/spawn.py)."""
from parallel.spawn import free_port, run_distributed

__all__ = ["run_distributed", "free_port"]
