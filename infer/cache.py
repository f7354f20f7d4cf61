"""Caches keyed by photo content, on the face stream: a gallery's embeddings (infer.enrolment), a
pair list's faces and each model's embeddings of them (infer.pair_photos), so that a second run
embeds (or searches) only what is new. One `Cache` class; a subclass per kind.

A cache is one npz: `header` (JSON: kind, FORMAT and what made the rows: model, crop, options),
`keys` (the photo's `content_key` and whatever else the row depends on), `has_row` (False: nothing
found, as a photo without a face) and the rows, under the kind's `field`.
- A path holding anything but a cache of the kind is refused by name and left alone (CacheError).
- One of the kind made otherwise (format, model or options: `changes`) is not read, and one whose
  arrays cannot be trusted is rebuilt; a warning says which.
- Entries are only added: when anything is new, `save` atomically publishes (utils.atomic) the
  file's entries, read again just before (another run's too), with this run's.
- A long run saves its new entries every `save_every_s` seconds to `PATH.parts/HOST-PID/part-N.npz`:
  a later or concurrent run of the same header takes them up; `save` removes its own and dead processes'."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import shutil
import time

import numpy as np

from shardface.dataset.errors import DataError
from shardface.dataset.fingerprint import file_ends
from shardface.errors import OutputError
from shardface.utils.atomic import check_output_file, host_name, process_alive, publishing

FORMAT = 3  # 3: every kind in one layout, keyed by content (2: the gallery's own)
HASH_BLOCK = 1 << 16  # the bytes hashed at each end of a photo
SAVE_EVERY_S = 30.0  # a killed run loses at most this much work (and one batch)
logger = logging.getLogger("shardface")


class CacheError(DataError):
    """A cache path that holds something else, never overwritten: the message names it."""


class _Damaged(Exception):
    """A cache of ours whose arrays cannot be trusted (the reason)."""


def content_key(path: str) -> str:
    """A photo's key, whatever its name or mtime: `size:hash` of its size and first and last HASH_BLOCK bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        return (
            f"{size}:" + hashlib.sha256(str(size).encode() + file_ends(fd, size, HASH_BLOCK)).hexdigest()[:32]
        )
    finally:
        os.close(fd)


class Cache:
    """key -> row (an array of `shape`) or None, read from `path` (None: in memory only) and its saved
    parts unless `rebuild`. Each kind's `what`, `hint` and `redo` word its messages."""

    kind = what = hint = redo = ""
    field, unit = "embeddings", False

    def __init__(
        self,
        path: str | None,
        header: dict,
        shape: tuple,
        rebuild: bool = False,
        save_every_s: float = SAVE_EVERY_S,
    ):
        self.path, self.shape, self.rebuild, self.save_every_s = path, tuple(shape), rebuild, save_every_s
        self.header = {"kind": self.kind, "format": FORMAT, **header}
        self.entries, self.new, self.unsaved = {}, set(), {}
        self.last, self.part = time.monotonic(), 0
        old = self.check(path) if path is not None else None  # something else there: refused, even to rebuild
        if path is None or rebuild:
            return
        said = self.changes(old) if old is not None else []
        if said:
            logger.warning("%s: %s changed since it was written: %s", path, " and ".join(said), self.redo)
        elif old is not None:
            try:
                self.entries = self._read(path)
            except _Damaged as exc:
                logger.warning("%s: a damaged %s (%s): %s", path, self.what, exc, self.redo)
        for part in sorted(glob.glob(os.path.join(glob.escape(f"{path}.parts"), "*-*", "part-*.npz"))):
            try:  # another run's saved work (one that just finished removed it)
                saved = self._read(part) if self.read_header(part) == self.header else {}
            except (CacheError, _Damaged, OSError):
                continue
            saved = {k: v for k, v in saved.items() if k not in self.entries}
            self.entries.update(saved)
            self.new.update(saved)

    @classmethod
    def ours(cls, header: dict) -> bool:
        return header.get("kind") == cls.kind

    @classmethod
    def read_header(cls, path: str) -> dict | None:
        """The header of the cache at `path`, None where nothing is; CacheError where something else is."""
        if not os.path.lexists(path):
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                header, reason = json.loads(str(z["header"])), "another kind"
        except Exception as exc:  # not an npz, truncated, no header: never replaced
            header, reason = None, f"{type(exc).__name__}: {exc}"
            if ".shardface_" in os.path.basename(path):  # our own name: one of ours, cut short
                raise CacheError(
                    f"{path}: a damaged ShardFace {cls.what} ({reason}); delete it (it is made again) or "
                    f"{cls.hint}"
                ) from None
        if isinstance(header, dict) and cls.ours(header):
            return header
        raise CacheError(
            f"{path}: exists and is not a ShardFace {cls.what} ({reason}); it is left as it is: {cls.hint}"
        )

    @classmethod
    def check(cls, path: str, write: bool = False) -> dict | None:
        """Before any work: `path` holds a cache of this kind (its header returned: replacing it
        destroys nothing else) or nothing yet; its folder must take a new file where nothing is
        there, or with `write` (else a cache is only read while nothing is new: a read-only folder is fine)."""
        header = cls.read_header(path) if os.path.isfile(path) else None
        if header is None or write:
            try:  # as root, /dev/fd of a list `<(...)` passes os.access, not this
                check_output_file(path, what=cls.what)
            except OutputError as exc:
                raise OutputError(f"{exc}; {cls.hint}") from None
        return header

    def changes(self, old: dict) -> list[str]:
        """What differs between the header `old` and this run's that changes the rows, in words."""
        return [f"its {k} ({old.get(k)}, now {v})" for k, v in self.header.items() if old.get(k) != v]

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> np.ndarray | None:
        return self.entries.get(key)

    def put(self, key: str, row: np.ndarray | None) -> None:
        """Add an entry; every `save_every_s` seconds the new ones go to this process's part."""
        self.entries[key] = self.unsaved[key] = row
        self.new.add(key)
        if self.path is not None and time.monotonic() - self.last >= self.save_every_s:
            own = os.path.join(f"{self.path}.parts", f"{host_name()}-{os.getpid()}")
            os.makedirs(own, exist_ok=True)
            self._write(os.path.join(own, f"part-{self.part:06d}.npz"), self.unsaved)
            self.unsaved, self.part, self.last = {}, self.part + 1, time.monotonic()

    def save(self) -> None:
        """Publish the entries, with any that another run added to the file since, when anything
        is new; then remove this run's parts and those of processes that are gone."""
        if self.path is None:
            return
        if self.new:
            if not self.rebuild and self.read_header(self.path) == self.header:
                with contextlib.suppress(_Damaged):
                    self.entries = {**self._read(self.path), **self.entries}
            self._write(self.path, self.entries)
            self.new, self.unsaved, self.rebuild = set(), {}, False
        parts = f"{self.path}.parts"
        for folder in glob.glob(os.path.join(glob.escape(parts), "*-*")):
            host, _, pid = os.path.basename(folder).rpartition("-")
            if (
                host == host_name()
                and pid.isdigit()
                and (int(pid) == os.getpid() or not process_alive(int(pid)))
            ):
                shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(parts)

    def _read(self, path: str) -> dict:
        """The entries of a cache whose header matched; _Damaged (the reason) when its arrays are
        not one finite row of `shape` (of unit length where `unit`) for each key that has one."""
        try:
            with np.load(path, allow_pickle=False) as z:
                keys, has, rows = z["keys"], z["has_row"], z[self.field]
        except Exception as exc:
            raise _Damaged(f"unreadable ({type(exc).__name__}: {exc})") from None
        found = int(has.sum()) if has.dtype == bool and keys.ndim == 1 and has.shape == keys.shape else -1
        if rows.shape != (found, *self.shape):
            raise _Damaged(f"rows of shape {rows.shape} for {found} of {keys.shape} keys, each {self.shape}")
        flat = rows.reshape(found, -1).astype(np.float64)
        bad = ~np.isfinite(flat).all(1) | (self.unit & (np.abs(np.linalg.norm(flat, axis=1) - 1) > 1e-3))
        if bad.any():
            raise _Damaged(f"{int(bad.sum())} rows are not finite" + (" unit vectors" if self.unit else ""))
        it = iter(rows)
        return {key: next(it) if h else None for key, h in zip(keys.tolist(), has.tolist())}

    def _write(self, path: str, entries: dict) -> None:
        rows = [r for r in entries.values() if r is not None]
        with publishing(path) as tmp, open(tmp, "wb") as f:
            np.savez(
                f,
                header=np.array(json.dumps(self.header, sort_keys=True)),
                keys=np.array(list(entries), str),
                has_row=np.array([r is not None for r in entries.values()], bool),
                **{self.field: np.array(rows).reshape(len(rows), *self.shape)},
            )
