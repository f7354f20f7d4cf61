"""CFP's own protocol as a pair list (Sengupta et al., WACV 2016: Celebrities in Frontal-Profile).

Under the CFP root, as its authors ship it:
- `Data/Images/NNN/{frontal,profile}/NN.jpg`: 500 people, 10 frontal and 4 profile photos each;
- `Protocol/Pair_list_F.txt` (5,000 frontal photos) and `Pair_list_P.txt` (2,000 profiles): one
  `number path` a line, the path relative to `Protocol/`, the numbers 1, 2, ... in order;
- `Protocol/Split/{FF,FP}/01..10/{same,diff}.txt`: one pair `i,j` a line. In FF both numbers
  index the frontal list; in FP the first indexes the frontal list, the second the profile list.

`read_cfp(root, "FP")` gives a PairList of the protocol's 7,000 pairs in its own order: fold 01's
same pairs, then its different pairs, then fold 02's, and so on, so that verification's 10
contiguous folds are CFP's 10 splits, as insightface's `cfp_fp.bin` and `cfp_ff.bin` hold them.
A malformed line, a number outside its list, a fold of another size or a photo that is not there
is one error naming the file and line, before any work."""

from __future__ import annotations

import os

from shardface.eval.pairs import PairList, PairListError, is_whole_number, read_pair_list
from shardface.eval.verification import NFOLDS

PROTOCOLS = ("FP", "FF")
LISTS = {"F": "Pair_list_F.txt", "P": "Pair_list_P.txt"}


def is_cfp(path: str) -> bool:
    """Whether `path` is a CFP root (a folder holding Protocol/Split)."""
    return os.path.isdir(os.path.join(path, "Protocol", "Split"))


def _lines(path: str) -> list[tuple[int, str]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            return [(i, line.strip()) for i, line in enumerate(f, 1) if line.strip()]
    except FileNotFoundError:
        raise PairListError(
            f"{path}: not found (a CFP root holds Protocol/{', Protocol/'.join(LISTS.values())} "
            "and Protocol/Split)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PairListError(f"{path}: cannot read it ({exc})") from None


def read_photo_list(protocol: str, name: str) -> list[str]:
    """The photos of `Protocol/<name>`, in its order, as paths; each line `number path`, the
    numbers 1, 2, ... and every photo a file."""
    path = os.path.join(protocol, name)
    photos = []
    for line, text in _lines(path):
        fields = text.split()
        if len(fields) != 2 or not is_whole_number(fields[0]) or int(fields[0]) != len(photos) + 1:
            raise PairListError(
                f"{path}:{line}: expected `{len(photos) + 1} PATH` (the photos numbered 1, 2, ... "
                f"in order), got {text!r}"
            )
        photo = os.path.normpath(os.path.join(protocol, fields[1]))
        if not os.path.isfile(photo):
            raise PairListError(f"{path}:{line}: photo {photo} not found")
        photos.append(photo)
    if not photos:
        raise PairListError(f"{path}: no photos")
    return photos


def _pairs(path: str, first: list[str], second: list[str], what: str) -> list[tuple[tuple[str, str], int]]:
    out = []
    for line, text in _lines(path):
        fields = [f.strip() for f in text.split(",")]
        if len(fields) != 2 or not all(is_whole_number(f) for f in fields):
            raise PairListError(f"{path}:{line}: expected `i,j` (two photo numbers), got {text!r}")
        i, j = (int(f) for f in fields)
        if not (1 <= i <= len(first) and 1 <= j <= len(second)):
            raise PairListError(
                f"{path}:{line}: pair {i},{j} is outside the lists ({what}: 1-{len(first)} and "
                f"1-{len(second)})"
            )
        out.append(((first[i - 1], second[j - 1]), line))
    return out


def read_cfp(root: str, protocol: str) -> PairList:
    """The pairs of CFP's protocol `protocol` ("FP" or "FF") under the CFP root `root` (see the
    module docstring). Its `lines` are each pair's line in its split file."""
    if protocol not in PROTOCOLS:
        raise PairListError(f"--protocol {protocol}: CFP's protocols are {' and '.join(PROTOCOLS)}")
    if not is_cfp(root):
        raise PairListError(f"{root}: not a CFP root (no Protocol/Split folder)")
    folder = os.path.join(root, "Protocol")
    frontal = read_photo_list(folder, LISTS["F"])
    second = frontal if protocol == "FF" else read_photo_list(folder, LISTS["P"])
    what = "frontal and frontal" if protocol == "FF" else "frontal and profile"
    splits = os.path.join(folder, "Split", protocol)
    extra = sorted(set(os.listdir(splits)) - {f"{k:02d}" for k in range(1, NFOLDS + 1)})
    if extra:
        raise PairListError(
            f"{splits}: holds {', '.join(extra)} beside CFP's {NFOLDS} splits 01-{NFOLDS:02d}, which its "
            f"protocol scores; move {'them' if len(extra) > 1 else 'it'} out"
        )
    pairs = []
    issame = []
    lines = []
    folds = []
    for k in range(1, NFOLDS + 1):
        split = os.path.join(folder, "Split", protocol, f"{k:02d}")
        start = len(pairs)
        for name, same in (("same.txt", True), ("diff.txt", False)):
            found = _pairs(os.path.join(split, name), frontal, second, what)
            if not found:
                raise PairListError(f"{os.path.join(split, name)}: no pairs")
            pairs += [p for p, _ in found]
            lines += [line for _, line in found]
            issame += [same] * len(found)
        folds.append((start, len(pairs)))
    sizes = {stop - start for start, stop in folds}
    if len(sizes) != 1:
        raise PairListError(
            f"{os.path.join(folder, 'Split', protocol)}: its folds hold "
            f"{', '.join(str(b - a) for a, b in folds)} pairs; verification's {NFOLDS} folds are "
            "equal, so CFP's must be"
        )
    return PairList(
        os.path.join(folder, "Split", protocol), root, f"cfp-{protocol.lower()}", pairs, issame, lines, folds
    )


def read_list(
    path: str, folder: str | None, protocol: str | None = None, folder_is: str = "--images"
) -> PairList:
    """The pairs `--pairs_list PATH` names: CFP's protocol `protocol` where PATH is a CFP root
    (its photos are where its lists say; `folder`, if given, must be that root), else the list
    file's (eval.pairs) with its photos under `folder`; `folder_is` names the tool's option (or
    argument) that gave `folder`."""
    if is_cfp(path):
        if protocol is None:
            raise PairListError(
                f"{path}: a CFP root; pass --protocol FP (frontal-profile) or FF (frontal-frontal)"
            )
        if folder is not None and os.path.realpath(folder) != os.path.realpath(path):
            raise PairListError(
                f"{folder_is} {folder}: CFP's photos are under its root {path}, where its lists name them"
            )
        return read_cfp(path, protocol)
    if protocol is not None:
        raise PairListError(
            f"--protocol {protocol}: for a CFP root (a folder holding Protocol/Split); {path} is not one"
        )
    if folder is None:
        raise PairListError(f"--pairs_list {path}: pass --images FOLDER, the folder of its photos")
    return read_pair_list(path, folder)


def list_name(pair_list: PairList) -> str:
    """How result tables name a list: `cfp_fp`, `cfp_ff` (insightface's names), or its file's name."""
    return (
        pair_list.format.replace("-", "_")
        if pair_list.format.startswith("cfp")
        else os.path.basename(pair_list.path)
    )
