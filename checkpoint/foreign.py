"""Run folders that ShardFace did not write, and never writes into.

An arcface_torch output holds `checkpoint_gpu_<rank>.pt` (one per rank, with
`save_all_states`), its `model.pt` and its own `training.log`. Nothing in it is a ShardFace
checkpoint, so the ordinary start rules would either call it empty (`--resume auto` starts
fresh beside it) or an earlier ShardFace run (`--overwrite true` replaces its `model.pt`).
It is refused before anything is created there, whatever `--resume` and `--overwrite` say,
with the import command that turns it into a ShardFace run elsewhere.
"""

from __future__ import annotations

import os
import re
import shlex

from shardface.checkpoint.files import CheckpointError
from shardface.configs import parse_overrides

ARCFACE_RANK_FILE = re.compile(r"^checkpoint_gpu_(\d+)\.pt$")
_RUN_KEYS = ("output", "resume", "overwrite")  # a train.py command's own, not the run's config


def arcface_torch_rank_files(folder: str) -> list[str]:
    """The `checkpoint_gpu_<rank>.pt` names in `folder`, by rank (empty when none, or no folder)."""
    if not os.path.isdir(folder):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := ARCFACE_RANK_FILE.match(name))]
    return [name for _, name in sorted(found)]


def config_overrides(overrides: list[str], dropped: tuple[str, ...] = _RUN_KEYS) -> list[str]:
    """The `--key value` arguments of `overrides`, without those whose key is in `dropped`."""
    return [a for key, value in parse_overrides(overrides) if key not in dropped for a in (f"--{key}", value)]


def refuse_arcface_torch_output(output: str, config_path: str, overrides: list[str]) -> None:
    """Raise CheckpointError when `output` is an arcface_torch run folder, naming the import
    command (its config, this command's config overrides, the folder and a new output)."""
    files = arcface_torch_rank_files(output)
    if not files:
        return
    target = output.rstrip("/") + "_shardface"
    command = " ".join(
        shlex.quote(a)
        for a in [
            "python",
            "-m",
            "scripts.import_arcface_torch",
            config_path,
            output,
            target,
            *config_overrides(overrides),
        ]
    )
    raise CheckpointError(
        f"{output} is an arcface_torch run ({', '.join(files[:2])}{' ...' if len(files) > 2 else ''}): ShardFace "
        f"never writes into it, not even with --overwrite true; import it into a new folder and continue there: "
        f"{command}"
    )
