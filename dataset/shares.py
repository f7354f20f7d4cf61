"""One photo list over many machines: each rank takes a contiguous share of the sorted list,
writes what it makes of it into a part folder beside the output, and rank 0 joins the parts
into exactly what one process writes.

- `launch_rank(rank, world)`: --rank/--world where given, else torchrun's RANK/WORLD_SIZE (only
  where torchrun started the process).
- `share_of(count, rank, world)`: rank r takes n_r = N // W + (r < N % W) items from
  (N // W) * r + min(r, N % W), the split of the head's classes (`heads.sharding.class_shard`).
- `list_key(items, *shaping, root=)`: a hash of the list, of its files' sizes and times, and of
  what shapes the output (options). The parts live in `<output>.parts-<key>/rank-<r>-of-<W>`, so
  a part made from another list, a replaced photo, other options or another world size is never
  taken for one of this job.
- `Parts.writing(rank, share)`: a rank's part is filled under a staging name and published
  whole (utils.atomic.publishing_dir), its manifest `part.json` written last. A rank that finds
  its part complete (a job run again after another rank failed) keeps it.
- `Parts.wait(items, timeout_s)`: rank 0 polls the shared file system until every part is
  there, each checked against its share (key, rank, world, the share's count and hash), and
  names the missing ranks when `timeout_s` passes.
- `Parts.join(out, items, report)`: every part's files into `out` (hard links; a copy where the
  file system has none), and the CSV `report` of each part (one row or more per item, the item
  in its first column) concatenated under one header. Checked: each report lists exactly its
  share, in order; each part holds the files its manifest counts; no two parts hold one file.

Coordination is the file system alone (no process group), so ranks may be started by torchrun
or by hand on machines that share the output's folder. The parts stay until rank 0 has
published the output, then `Parts.remove()` deletes them.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from shardface.errors import ConfigError, UserError
from shardface.heads.sharding import class_shard
from shardface.parallel.flat import Range
from shardface.utils.atomic import publishing, publishing_dir

MANIFEST = "part.json"
WAIT_MIN_S = 600.0  # rank 0 waits at least this long for the other ranks' parts after its own


class PartError(UserError, RuntimeError):
    """A part of a many-rank job that is missing or does not match its share."""


def launch_rank(rank: int | None = None, world: int | None = None, env=None) -> tuple[int, int]:
    """(rank, world size) from --rank/--world where given (both or neither), else from RANK and
    WORLD_SIZE where torchrun started this process (it sets TORCHELASTIC_RUN_ID), else (0, 1):
    variables left set in a shell are named and ignored, never taken for a share to wait on."""
    env = os.environ if env is None else env
    if (rank is None) != (world is None):
        raise ConfigError(
            "--rank and --world: give both (or neither, to take torchrun's RANK and WORLD_SIZE)"
        )
    if rank is None:
        try:
            rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
        except ValueError:
            raise ConfigError(
                f"RANK={env.get('RANK')!r} WORLD_SIZE={env.get('WORLD_SIZE')!r}: not whole numbers"
            ) from None
        if world > 1 and "TORCHELASTIC_RUN_ID" not in env:
            print(
                f"RANK={rank} and WORLD_SIZE={world} are set, but torchrun did not start this process: running "
                "as one process (pass --rank R --world W to share the photos among machines by hand)",
                file=sys.stderr,
                flush=True,
            )
            rank, world = 0, 1
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"--rank {rank} --world {world}: the world is at least 1 and the rank in [0, world)"
        )
    return rank, world


def share_of(count: int, rank: int, world: int) -> Range:
    """The items [start, end) of rank `rank` among `world`: contiguous, sizes differing by one at most."""
    return class_shard(count, world, rank)


def list_key(items: Sequence[str], *shaping, root: str | None = None) -> str:
    """16 hex digits of the SHA-256 of the items (in order), of each item's file (size and
    modification time: a photo replaced under the same name gives another key) where `root`
    names their folder ("" for paths as they are), and of `shaping` (what else decides the
    output: options, as their repr)."""
    h = hashlib.sha256()
    for item in items:
        h.update(item.encode("utf-8", "surrogateescape") + b"\0")
        if root is not None:
            st = os.stat(os.path.join(root, item))
            h.update(f"{st.st_size}:{st.st_mtime_ns}\0".encode())
    h.update(repr(shaping).encode())
    return h.hexdigest()[:16]


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

    def _expected(self, rank: int, items: Sequence[str]) -> dict:
        r = share_of(len(items), rank, self.world)
        share = items[r.start : r.end]
        return {
            "key": self.key,
            "rank": rank,
            "world": self.world,
            "count": len(share),
            "share": list_key(share),
        }

    def manifest(self, rank: int, items: Sequence[str]) -> dict | None:
        """The manifest of rank `rank`'s complete part, None where there is none yet; a part
        that does not match its share of `items` is a PartError naming it."""
        path = os.path.join(self.folder(rank), MANIFEST)
        try:
            with open(path) as f:
                found = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise PartError(
                f"{path}: unreadable part manifest ({exc}); remove {self.root} and run every rank again"
            )
        expected = self._expected(rank, items)
        wrong = [k for k, v in expected.items() if found.get(k) != v]
        if wrong:
            raise PartError(
                f"{path}: this part does not match rank {rank}'s share of the photo list "
                f"({', '.join(f'{k} {found.get(k)!r}, expected {expected[k]!r}' for k in wrong)}); "
                f"remove {self.root} and run every rank again"
            )
        return found

    @contextlib.contextmanager
    def writing(self, rank: int, items: Sequence[str]) -> Iterator[Part]:
        """`with parts.writing(rank, items) as part:` fill `part.folder` with rank `rank`'s
        share of `items`; when the block ends normally the folder is published whole with its
        manifest (the share's count and hash, the files it holds, `part.summary`)."""
        os.makedirs(self.root, exist_ok=True)
        with publishing_dir(self.folder(rank)) as tmp:
            part = Part(tmp, {})
            yield part
            files = sum(len(names) for _, _, names in os.walk(tmp))
            with publishing(os.path.join(tmp, MANIFEST)) as staged, open(staged, "w") as f:
                json.dump({**self._expected(rank, items), "files": files, "summary": part.summary}, f)

    def wait(self, items: Sequence[str], timeout_s: float, poll_s: float = 1.0) -> list[dict]:
        """Every rank's manifest, in rank order, once all parts are complete and match their
        shares; a PartError naming the missing ranks after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        found: dict[int, dict] = {}
        said = False
        while True:
            for rank in range(self.world):
                if rank not in found:
                    manifest = self.manifest(rank, items)
                    if manifest is not None:
                        found[rank] = manifest
            missing = [r for r in range(self.world) if r not in found]
            if not missing:
                return [found[r] for r in range(self.world)]
            if time.monotonic() >= deadline:
                raise PartError(
                    f"{self.root}: no complete part of rank {', '.join(map(str, missing))} of "
                    f"{self.world} after {timeout_s:.0f} s; run every rank with the same photos, "
                    f"output, options and world size{self._others()} (what was done is kept: a run "
                    "again redoes only missing parts)"
                )
            if not said and timeout_s > 0:
                print(
                    f"waiting up to {timeout_s:.0f} s for the part of rank {', '.join(map(str, missing))} of "
                    f"{self.world} in {self.root}",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            time.sleep(poll_s)

    def _others(self) -> str:
        """What else is beside this job's parts: parts of other lists or options, or of this
        list under another world size, in words ("" where nothing is)."""
        lists = [
            o
            for o in sorted(glob.glob(glob.escape(self.root.rsplit(".parts-", 1)[0]) + ".parts-*"))
            if o != self.root
        ]
        worlds = [
            f
            for f in sorted(glob.glob(os.path.join(glob.escape(self.root), "rank-*-of-*")))
            if not f.endswith(f"-of-{self.world}")
        ]
        said = [f"{', '.join(lists)} came from another photo list or other options"] if lists else []
        said += (
            [f"{', '.join(os.path.basename(f) for f in worlds)} in {self.root} came from another world size"]
            if worlds
            else []
        )
        return f" ({'; '.join(said)})" if said else ""

    def join(self, out: str, items: Sequence[str], report: str) -> dict:
        """Every part's files into the folder `out` and their CSV `report`s concatenated into
        `out/report` under one header (checked: module docstring); -> each summary key summed
        (numbers) or concatenated (lists) over the ranks, in rank order."""
        manifests = self.wait(items, 0.0)
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
