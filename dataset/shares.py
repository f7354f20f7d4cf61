"""One photo list over many machines, as torchrun starts a tool
(`torchrun --nnodes N --nproc_per_node K -m scripts.align SRC OUT`, as it starts training): each rank
takes a contiguous share of the sorted list, writes what it makes of it into its part folder beside
the output, and rank 0 joins the parts into exactly what one process writes.

- `tool_ranks()`: this process's rank and world in torchrun's process group (gloo, from torchrun's
  variables), or rank 0 of 1 where torchrun did not start it.
- `share_of(count, rank, world)`: rank r takes n_r = N // W + (r < N % W) items from
  (N // W) * r + min(r, N % W), the split of the head's classes (`heads.sharding.class_shard`).
- `Ranks.agree(items, *shaping, root=)`: before any work the ranks all-gather what decides the
  output: the list's names, its files' sizes, the options. Where a rank's differs, every rank ends
  at once with an error naming the difference. Copies of the same photos with other modification
  times (each node's local copy) are the same job.
- `Parts.make(rank, items, fill)`: a rank's part is filled under a staging name and published whole
  (utils.atomic.publishing_dir), its manifest `part.json` written last. A part that a run of this
  job left complete is kept, where its share's files (sizes and times, on this rank's machine) are
  the ones it was made from; else it is made again.
- `Ranks.outcome(work)`: each rank's result, or the error of its work, all-gathered: where one
  rank failed, every rank ends with its error, naming that rank. A rank that dies (killed) ends
  the job through torchrun, which stops the others and names it. No rank polls a folder.
- `Parts.join(out, manifests, items, report)`: every part's files into `out` (hard links; a copy
  where the file system has none), and the CSV `report` of each part concatenated under one
  header. Checked: each report lists exactly its share, in order; each part holds the files its
  manifest counts; no two parts hold one file.

The parts stay until rank 0 has published the output, then `Parts.remove()` deletes them: a job
killed before that keeps every rank's work, and a run again completes from it.
"""

from __future__ import annotations

import atexit
import csv
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from shardface.errors import UserError
from shardface.heads.sharding import class_shard
from shardface.parallel.flat import Range
from shardface.utils.atomic import publishing, publishing_dir

MANIFEST = "part.json"


class PartError(UserError, RuntimeError):
    """A rank of a many-rank job that failed, disagrees with rank 0, or left a part that does not
    match its share."""


def share_of(count: int, rank: int, world: int) -> Range:
    """The items [start, end) of rank `rank` among `world`: contiguous, sizes differing by one at most."""
    return class_shard(count, world, rank)


def _digest(values) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(str(v).encode("utf-8", "surrogateescape") + b"\0")
    return h.hexdigest()[:16]


def _stats(items: Sequence[str], root: str | None, *fields: str) -> list:
    return (
        []
        if root is None
        else [tuple(getattr(os.stat(os.path.join(root, i)), f) for f in fields) for i in items]
    )


def list_key(items: Sequence[str], *shaping, root: str | None = None) -> str:
    """16 hex digits naming the job: the items (in order), each item's file size where `root` names
    their folder ("" for paths as they are), and `shaping` (what else decides the output: options,
    as their repr). Modification times are not in it: every rank's copy of the photos is the same job."""
    return _digest([*items, *_stats(items, root, "st_size"), repr(shaping)])


@dataclass(frozen=True)
class Ranks:
    """This process's place among a tool's ranks (module docstring)."""

    rank: int = 0
    world: int = 1

    def gathered(self, value) -> list:
        """`value` of every rank, in rank order, on every rank (one all-gather; none for one rank)."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def agree(self, items: Sequence[str], *shaping, root: str | None = None, what: str = "photos") -> None:
        """Every rank has the same job as rank 0, or every rank raises a PartError naming the difference."""
        sizes = _stats(items, root, "st_size")
        mine = {
            "count": len(items),
            "names": _digest(items),
            "sizes": _digest(sizes),
            "options": repr(shaping),
        }
        theirs = self.gathered(mine)
        for rank, job in enumerate(theirs):
            differ = [k for k in mine if job[k] != theirs[0][k]]
            if not differ:
                continue
            if "count" in differ or "names" in differ:
                why = f"lists {job['count']} {what} under its source, rank 0 {theirs[0]['count']}, or other names"
            elif "sizes" in differ:
                why = f"has the same {len(items)} {what} with other file sizes (another copy of them?)"
            else:
                why = f"runs with other options ({job['options']}, rank 0: {theirs[0]['options']})"
            raise PartError(
                f"rank {rank} of {self.world} {why}: run every rank with the same {what} and options"
            )

    def outcome(self, work: Callable):
        """`work()`'s result on every rank, gathered in rank order; where a rank's work raised, every
        rank raises: that rank its own error, the others a PartError naming it and its message."""
        try:
            mine, error = ("ok", work()), None
        except Exception as exc:
            mine, error = (
                ("error", f"{type(exc).__name__}: {exc}" if not isinstance(exc, UserError) else str(exc)),
                exc,
            )
        everyone = self.gathered(mine)
        if error is not None:
            raise error
        failed = [(rank, text) for rank, (status, text) in enumerate(everyone) if status == "error"]
        if failed:
            rank, text = failed[0]
            raise PartError(f"rank {rank} of {self.world} failed: {text}")
        return [value for _, value in everyone]


def tool_ranks(env=None) -> Ranks:
    """This process's rank among the tool's ranks: torchrun's process group (joined here, gloo) where
    torchrun started it (it sets TORCHELASTIC_RUN_ID), else rank 0 of 1. On a node with GPUs, each
    local rank's models run on its own GPU (LOCAL_RANK, modulo the GPUs). RANK and WORLD_SIZE left set
    in a shell are named and ignored, never taken for a share to wait on."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world > 1 and "TORCHELASTIC_RUN_ID" not in env:
        print(
            f"RANK={env.get('RANK')} and WORLD_SIZE={world} are set, but torchrun did not start this process: "
            "running as one process (start the ranks with torchrun to share the photos among machines)",
            file=sys.stderr,
            flush=True,
        )
        return Ranks()
    if world == 1:
        return Ranks()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")  # torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        # left while the interpreter is whole: a process that exits with a gloo group alive can die
        # of SIGABRT as it finalizes ("terminate called without an active exception")
        atexit.register(_leave_process_group)
    import torch

    if torch.cuda.is_available():  # a model runs on this rank's own GPU of its node
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count())
    return Ranks(dist.get_rank(), dist.get_world_size())


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Part:
    """A part being written: fill `folder`; `summary` (JSON values) goes into its manifest."""

    folder: str
    summary: dict


class Parts:
    """The part folders of one job: `<output>.parts-<key>/rank-<r>-of-<world>` (module docstring)."""

    def __init__(self, output: str, key: str, world: int):
        output = os.path.abspath(output.rstrip(os.sep) or output)
        self.root = f"{output}.parts-{key}"
        self.key, self.world = key, world

    def folder(self, rank: int) -> str:
        return os.path.join(self.root, f"rank-{rank}-of-{self.world}")

    def _expected(self, rank: int, items: Sequence[str], root: str | None) -> dict:
        r = share_of(len(items), rank, self.world)
        share = items[r.start : r.end]
        files = _stats(share, root, "st_size", "st_mtime_ns")
        return {
            "key": self.key,
            "rank": rank,
            "world": self.world,
            "count": len(share),
            "share": _digest([*share, *files]),
        }

    def manifest(self, rank: int, items: Sequence[str], root: str | None = None) -> dict | None:
        """The manifest of rank `rank`'s complete part where it was made from its share of `items` as
        they are now (`root`: their folder, for their files' sizes and times); else None."""
        try:
            with open(os.path.join(self.folder(rank), MANIFEST)) as f:
                found = json.load(f)
        except (OSError, ValueError):  # none, or one a kill cut short: made again
            return None
        expected = self._expected(rank, items, root)
        return found if all(found.get(k) == v for k, v in expected.items()) else None

    def make(
        self, rank: int, items: Sequence[str], fill: Callable[[Part], None], root: str | None = None
    ) -> dict:
        """Rank `rank`'s part: kept where complete and current (`manifest`), else `fill(part)` fills
        `part.folder` and `part.summary`, and the folder is published whole with its manifest. -> the manifest."""
        kept = self.manifest(rank, items, root)
        if kept is not None:
            return kept
        os.makedirs(self.root, exist_ok=True)
        with publishing_dir(self.folder(rank)) as tmp:
            part = Part(tmp, {})
            fill(part)
            files = sum(len(names) for _, _, names in os.walk(tmp))
            manifest = {**self._expected(rank, items, root), "files": files, "summary": part.summary}
            with publishing(os.path.join(tmp, MANIFEST)) as staged, open(staged, "w") as f:
                json.dump(manifest, f)
        return manifest

    def join(self, out: str, manifests: list[dict], items: Sequence[str], report: str) -> dict:
        """Every part's files into the folder `out` and their CSV `report`s concatenated into
        `out/report` under one header (checked: module docstring); -> each summary key summed
        (numbers) or concatenated (lists) over the ranks, in rank order."""
        header = None
        with open(os.path.join(out, report), "wb") as joined:
            for rank in range(self.world):
                path = os.path.join(self.folder(rank), report)
                r = share_of(len(items), rank, self.world)
                self._check_report(path, items[r.start : r.end])
                with open(path, "rb") as f:
                    first = f.readline()
                    if header is None:
                        header = first
                        joined.write(header)
                    elif first != header:
                        raise PartError(f"{path}: its header differs from rank 0's part")
                    shutil.copyfileobj(f, joined)
        for rank, manifest in enumerate(manifests):
            folder, count = self.folder(rank), 0
            for dirpath, _, names in os.walk(folder):
                for name in names:
                    rel = os.path.relpath(os.path.join(dirpath, name), folder)
                    if rel == MANIFEST:
                        continue
                    count += 1
                    if rel == report:
                        continue
                    target = os.path.join(out, rel)
                    if os.path.lexists(target):
                        raise PartError(f"{os.path.join(folder, rel)}: another part holds {rel} too")
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    try:
                        os.link(os.path.join(dirpath, name), target)
                    except OSError:  # no hard links here
                        shutil.copyfile(os.path.join(dirpath, name), target)
            if count != manifest["files"]:
                raise PartError(
                    f"{folder}: holds {count} files, its manifest {manifest['files']}; "
                    f"remove {self.root} and run every rank again"
                )
        return _summed([m["summary"] for m in manifests])

    @staticmethod
    def _check_report(path: str, share: Sequence[str]) -> None:
        """The report's rows name the share's items, each in one run of rows, in order."""
        named = []
        with open(path, newline="") as f:
            rows = csv.reader(f)
            next(rows, None)
            for row in rows:
                if not named or named[-1] != row[0]:
                    named.append(row[0])
        if named != list(share):
            raise PartError(
                f"{path}: its rows list {len(named)} photos, not the {len(share)} of its share in order; "
                "remove the parts folder and run every rank again"
            )

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _summed(summaries: list[dict]) -> dict:
    out: dict = {}
    for summary in summaries:
        for k, v in summary.items():
            out[k] = out[k] + v if k in out else v
    return out
