"""Pair lists: the pairs a verification protocol names, read in their order with their folds.

Two formats, told apart by their first line:
- LFW's `pairs.txt`: a header `folds n` (view 2: `10 300`), then per fold n same pairs
  `name i j` and n different pairs `name1 i name2 j`, the image of `name i` being
  `FOLDER/name/name_%04d.jpg`. Fold k is lines [k * 2n, (k + 1) * 2n) of the pairs.
- a plain list, one pair a line: `path1 path2 1|0` (1: the same person), paths relative to
  FOLDER (an absolute path is taken as it is, and may name a photo outside FOLDER); separated
  by tabs where a path holds a space, else by any whitespace. Blank lines and lines starting
  with `#` are skipped. Its folds are verification's: NFOLDS contiguous runs of
  pairs, the first `n % NFOLDS` one pair longer (sklearn's KFold without shuffling).

Verification scores NFOLDS contiguous folds of the pairs in order (eval.verification), so a pair
set kept in the list's order is scored on the list's own folds: LFW's 10 sets of 600 are the 10
folds. An LFW header with another number of folds is refused (its folds would not be the ones
scored). A malformed line is one error naming the file and line; a list naming images that do
not exist is one error naming the first and counting all (`check_images`), before any work."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from shardface.dataset.errors import DataError
from shardface.eval.verification import NFOLDS, VerificationResult, evaluate
from shardface.infer.embed import l2_normalize


class PairListError(DataError):
    """A pair list that cannot be read, or that names images that are not there."""


@dataclass(frozen=True)
class PairList:
    """The pairs of a list file, in its order, as image paths under its image folder."""

    path: str  # the list file
    folder: str  # the images' folder
    format: str  # "lfw" or "plain"
    pairs: list[tuple[str, str]]  # image paths (FOLDER joined)
    issame: list[bool]
    lines: list[int]  # each pair's line in the file (1-based)
    folds: list[tuple[int, int]]  # [start, stop) pair indices of each fold, in order

    @property
    def photos(self) -> list[str]:
        """Every image the pairs name, once each, in the order they first appear."""
        return list(dict.fromkeys(p for pair in self.pairs for p in pair))

    def rows(self) -> np.ndarray:
        """2 x pairs indices into `photos`, interleaved as a .bin holds them (pair i: 2i, 2i + 1)."""
        where = {p: i for i, p in enumerate(self.photos)}
        return np.array([where[p] for pair in self.pairs for p in pair], np.int64)

    def first_line(self) -> dict[str, int]:
        """The line on which each image first appears."""
        seen: dict[str, int] = {}
        for pair, line in zip(self.pairs, self.lines):
            for p in pair:
                seen.setdefault(p, line)
        return seen


def contiguous_folds(n: int, nfolds: int = NFOLDS) -> list[tuple[int, int]]:
    """The [start, stop) of `nfolds` contiguous folds of n pairs, as verification splits them:
    the first `n % nfolds` folds hold one pair more."""
    bounds, start = [], 0
    for k in range(nfolds):
        size = n // nfolds + (k < n % nfolds)
        bounds.append((start, start + size))
        start += size
    return bounds


def is_whole_number(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes superscripts ('³'), which int() refuses."""
    return text.isascii() and text.isdigit()


def _lfw_image(folder: str, name: str, number: str, where: str) -> str:
    if not is_whole_number(number) or int(number) < 1:
        raise PairListError(f"{where}: image number {number!r} is not a positive whole number")
    return os.path.join(folder, name, f"{name}_{int(number):04d}.jpg")


def _fields(line: str) -> list[str]:
    return [f.strip() for f in line.split("\t")] if "\t" in line else line.split()


def _read_lfw(path: str, folder: str, rows: list[tuple[int, list[str]]]) -> PairList:
    (header_line, header), body = rows[0], rows[1:]
    nfolds, per_kind = (int(v) for v in header)
    if nfolds != NFOLDS or per_kind < 1:
        raise PairListError(
            f"{path}:{header_line}: header `{' '.join(header)}` names {nfolds} folds of {per_kind} "
            f"same and {per_kind} different pairs; verification scores {NFOLDS} folds, so the list "
            f"needs {NFOLDS} (LFW view 2's pairs.txt starts `10 300`)"
        )
    pairs, issame, lines = [], [], []
    for line, f in body:
        where = f"{path}:{line}"
        if len(f) == 3:
            pairs.append((_lfw_image(folder, f[0], f[1], where), _lfw_image(folder, f[0], f[2], where)))
        elif len(f) == 4:
            pairs.append((_lfw_image(folder, f[0], f[1], where), _lfw_image(folder, f[2], f[3], where)))
        else:
            raise PairListError(
                f"{where}: {len(f)} fields; an LFW pair is `name i j` (same person) or "
                f"`name1 i name2 j` (two people)"
            )
        issame.append(len(f) == 3)
        lines.append(line)
    size = 2 * per_kind
    if len(pairs) != nfolds * size:
        raise PairListError(
            f"{path}: the header (line {header_line}) names {nfolds} folds of {size} pairs, "
            f"{nfolds * size} in all; the file holds {len(pairs)}"
        )
    folds = [(k * size, (k + 1) * size) for k in range(nfolds)]
    for k, (start, stop) in enumerate(folds):
        same = sum(issame[start:stop])
        if same != per_kind:
            raise PairListError(
                f"{path}: fold {k + 1} (lines {lines[start]}-{lines[stop - 1]}) holds {same} same "
                f"and {size - same} different pairs; the header names {per_kind} of each"
            )
    return PairList(path, folder, "lfw", pairs, issame, lines, folds)


def _read_plain(path: str, folder: str, rows: list[tuple[int, list[str]]]) -> PairList:
    pairs, issame, lines = [], [], []
    for line, f in rows:
        if len(f) != 3 or f[2] not in ("0", "1"):
            raise PairListError(
                f"{path}:{line}: expected `path1 path2 1|0` (1: the same person), got "
                f"{len(f)} fields" + (f" ending {f[-1]!r}" if len(f) == 3 else "")
            )
        pairs.append((os.path.join(folder, f[0]), os.path.join(folder, f[1])))
        issame.append(f[2] == "1")
        lines.append(line)
    if len(pairs) < NFOLDS:
        raise PairListError(f"{path}: {len(pairs)} pairs, fewer than the {NFOLDS} folds of verification")
    return PairList(path, folder, "plain", pairs, issame, lines, contiguous_folds(len(pairs)))


def read_pair_list(path: str, folder: str) -> PairList:
    """The pairs of the list file at `path`, images under `folder` (see the module docstring)."""
    try:
        with open(path, encoding="utf-8-sig") as f:  # an editor's BOM is not part of the header
            text = f.read()
    except FileNotFoundError:
        raise PairListError(f"{path}: pair list not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PairListError(f"{path}: cannot read the pair list ({exc})") from None
    rows = [
        (i, _fields(line))
        for i, line in enumerate(text.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not rows:
        raise PairListError(f"{path}: no pairs in the list")
    first = rows[0][1]
    if len(first) == 2 and all(is_whole_number(v) for v in first):
        return _read_lfw(path, folder, rows)
    return _read_plain(path, folder, rows)


def check_images(pair_list: PairList) -> None:
    """Refuse, as one line, a list naming images that are not files (the first named, all counted)."""
    photos = pair_list.photos
    missing = [p for p in photos if not os.path.isfile(p)]
    if missing:
        line = pair_list.first_line()[missing[0]]
        raise PairListError(
            f"{pair_list.path}: {len(missing)} of the {len(photos)} images it names are not found "
            f"under {pair_list.folder}, the first {missing[0]} (line {line})"
        )


def score_pairs(pair_list: PairList, emb: np.ndarray, emb_flip: np.ndarray) -> VerificationResult:
    """Verification of the list's pairs from each photo's raw embedding and its mirror image's
    (rows as `pair_list.photos`), exactly as eval.verification.test scores a .bin: the pairs in
    the list's order, so its NFOLDS folds are the list's."""
    rows = pair_list.rows()
    a, b = emb[rows], emb_flip[rows]
    xnorm = float(np.mean([np.linalg.norm(e, axis=1).mean() for e in (a, b)]))
    acc = evaluate(l2_normalize(a), pair_list.issame, NFOLDS)[2]
    acc_flip = evaluate(l2_normalize(a + b), pair_list.issame, NFOLDS)[2]
    return VerificationResult(
        float(np.mean(acc)),
        float(np.std(acc)),
        float(np.mean(acc_flip)),
        float(np.std(acc_flip)),
        xnorm,
        a,
        b,
    )
