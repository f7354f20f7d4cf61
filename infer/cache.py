"""Caches keyed by photo content, on the face stream: a gallery's embeddings (infer.enrolment), a
pair list's faces and each model's embeddings of them (infer.pair_photos), so that a second run
embeds (or searches) only what is new. One `Cache` class; a subclass per kind.

A cache is one SQLite database (the standard library's sqlite3): a `header` table of one JSON row
(kind, FORMAT and what made the rows: model, crop, options) and `rows` (the photo's `content_key`
and whatever else the row depends on -> the row: an array's bytes and dtype, or a JSON record,
such as a photo's size and its `Face.to_dict`; no row where nothing was found).
- A path holding anything but a cache of the kind is refused by name and left alone (CacheError);
  a file of ShardFace's own cache name that is not one (cut short) is called damaged.
- One of the kind made otherwise (format, model or options: `changes`) is not read, and one whose
  rows cannot be trusted is not either; a warning says which, and the first save replaces it.
- Entries are only added, each batch in one transaction, every `save_every_s` seconds and at
  `save`: two runs at once both add theirs (SQLite locks the file for each write), and a run killed
  at any moment leaves what it committed, which the next run takes up. Nothing to merge."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import time
import urllib.parse

import numpy as np

from shardface.dataset.errors import DataError
from shardface.dataset.fingerprint import file_ends
from shardface.errors import OutputError
from shardface.utils.outputs import check_output_file

FORMAT = 5  # 5: JSON records beside arrays (4: SQLite, 3: npz with part folders)
HASH_BLOCK = 1 << 16  # the bytes hashed at each end of a photo
SAVE_EVERY_S = 30.0  # a killed run loses at most this much work (and one batch)
LOCK_WAIT_S = 60.0  # how long a write waits for another run's
logger = logging.getLogger("shardface")


class CacheError(DataError):
    """A cache path that holds something else, never overwritten: the message names it."""


class _Damaged(Exception):
    """A cache of ours whose rows cannot be trusted (the reason)."""


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


def _reading(path: str) -> sqlite3.Connection:
    """A read-only connection: reading never creates or changes the file."""
    return sqlite3.connect(
        f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=LOCK_WAIT_S
    )


class Cache:
    """key -> row (an array of `shape`; with shape None, a JSON record) or None, read from `path`
    (None: in memory only) unless `rebuild`. Each kind's `what`, `hint` and `redo` word its messages."""

    kind = what = hint = redo = ""
    unit = False

    def __init__(
        self,
        path: str | None,
        header: dict,
        shape: tuple | None,
        rebuild: bool = False,
        save_every_s: float = SAVE_EVERY_S,
    ):
        self.path = path
        self.shape = shape
        self.rebuild = rebuild
        self.save_every_s = save_every_s
        self.header = {"kind": self.kind, "format": FORMAT, **header}
        self.entries, self.new, self.unsaved = {}, set(), {}
        self.last = time.monotonic()
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
                self.rebuild = True

    @classmethod
    def ours(cls, header: dict) -> bool:
        return header.get("kind") == cls.kind

    @classmethod
    def read_header(cls, path: str) -> dict | None:
        """The header of the cache at `path`, None where nothing is; CacheError where something else is."""
        if not os.path.lexists(path):
            return None
        try:
            with contextlib.closing(_reading(path)) as db:
                row = db.execute("SELECT json FROM header").fetchone()
            header, reason = (json.loads(row[0]) if row else None), "another kind"
        except (sqlite3.Error, ValueError) as exc:  # not a database, cut short, no header table
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

    def put(self, key: str, row: np.ndarray | dict | None) -> None:
        """Add an entry; every `save_every_s` seconds the new ones are committed."""
        self.entries[key] = self.unsaved[key] = row
        self.new.add(key)
        if self.path is not None and time.monotonic() - self.last >= self.save_every_s:
            self._commit()

    def save(self) -> None:
        """Commit what is new (nothing is written where nothing is)."""
        if self.path is not None and self.new:
            self._commit()
            self.new = set()

    def _commit(self) -> None:
        """The unsaved entries added in one transaction; where the file's header is not this cache's
        (another format, model or options, or rows not to be trusted), its rows are replaced by this run's."""
        mine = json.dumps(self.header, sort_keys=True)
        with contextlib.closing(sqlite3.connect(self.path, timeout=LOCK_WAIT_S)) as db, db:
            db.execute("CREATE TABLE IF NOT EXISTS header (json TEXT NOT NULL)")
            db.execute("CREATE TABLE IF NOT EXISTS rows (key TEXT PRIMARY KEY, dtype TEXT, row BLOB)")
            stored = db.execute("SELECT json FROM header").fetchone()
            entries = self.unsaved
            if self.rebuild or stored is None or json.loads(stored[0]) != self.header:
                db.execute("DELETE FROM rows")
                db.execute("DELETE FROM header")
                db.execute("INSERT INTO header VALUES (?)", (mine,))
                entries = self.entries
            db.executemany(
                "INSERT OR REPLACE INTO rows VALUES (?, ?, ?)",
                [(k, *self._encode(r)) for k, r in entries.items()],
            )
        self.unsaved, self.rebuild, self.last = {}, False, time.monotonic()

    def _encode(self, row) -> tuple[str | None, bytes | None]:
        if row is None:
            return None, None
        if self.shape is None:
            return "json", json.dumps(row, sort_keys=True).encode()
        return np.asarray(row).dtype.str, np.ascontiguousarray(row).tobytes()

    def _read(self, path: str) -> dict:
        """The entries of a cache whose header matched; _Damaged (the reason) when its rows are not
        finite rows of `shape` (of unit length where `unit`), or not JSON records."""
        try:
            with contextlib.closing(_reading(path)) as db:
                stored = db.execute("SELECT key, dtype, row FROM rows").fetchall()
        except sqlite3.Error as exc:
            raise _Damaged(f"unreadable ({type(exc).__name__}: {exc})") from None
        if self.shape is None:
            try:
                return {k: None if blob is None else json.loads(blob) for k, _, blob in stored}
            except ValueError as exc:
                raise _Damaged(f"a row is not JSON ({exc})") from None
        out, size = {}, int(np.prod(self.shape))
        for key, dtype, blob in stored:
            if blob is None:
                out[key] = None
                continue
            try:
                row = np.frombuffer(blob, np.dtype(dtype))
            except (TypeError, ValueError) as exc:
                raise _Damaged(f"row {key!r}: {exc}") from None
            if row.size != size:
                raise _Damaged(f"row {key!r} holds {row.size} values, not {self.shape}")
            out[key] = row.reshape(self.shape)
        rows = np.array([r.reshape(-1) for r in out.values() if r is not None], np.float64).reshape(-1, size)
        bad = ~np.isfinite(rows).all(1) | (self.unit & (np.abs(np.linalg.norm(rows, axis=1) - 1) > 1e-3))
        if bad.any():
            raise _Damaged(f"{int(bad.sum())} rows are not finite" + (" unit vectors" if self.unit else ""))
        return out
