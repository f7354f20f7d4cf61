#!/usr/bin/env python
"""Write a verification set in insightface's .bin format (a pickle of (encoded images, issame),
pair i being images 2i and 2i+1) from an image folder of identities held out of training.
`python -m scripts.make_bin HELD_OUT_FOLDER OUT.bin [--pairs N] [--seed S]`, or the pairs of a list
in its order: `python -m scripts.make_bin FOLDER OUT.bin --pairs_list pairs.txt --align`.

Half the pairs are two images of one identity, half images of two identities, drawn without
repeats and fixed by --seed; same and different pairs alternate, so every fold of the 10-fold
protocol holds both kinds. scripts.verify and training's val_targets read the file as lfw.bin.
With --align the images are photos: each photo's largest face is aligned to 112x112 first, and
photos without a face are left out of the draw and named (refused with --strict).

With --pairs_list (LFW's pairs.txt or a plain `path1 path2 1|0` list, eval.pairs; or a CFP root
with --protocol FP or FF, eval.cfp: insightface's cfp_fp.bin and cfp_ff.bin) the pairs are the
list's, in its order, so verification's 10 folds are the list's own (LFW view 2's 10 sets of 600,
CFP's 10 splits of 700). A pair is never dropped: with --align a photo where no face is found,
after the retries asked for (--retry_upsample, --retry_mmod: on by default for a CFP root), is
cut at a fallback face (infer.pair_photos, as scripts.verify does) and named; --strict refuses
such photos instead. Each photo is aligned once however many pairs name it; its detection is
cached beside the list (infer.cache), where scripts.verify finds it.

Under torchrun with --align (`torchrun --nnodes N --nproc_per_node K -m scripts.make_bin ...`) each
rank searches a share of the photos for faces, and rank 0 writes the .bin one process writes: a
drawn set's ranks keep their parts beside OUT.bin until it is published (infer.ranked); a list's
ranks share each search rank 0's faces cache leaves to do (infer.pair_photos)."""

from __future__ import annotations

import itertools
import random
import sys

from shardface.dataset import DataError, list_identity_folders
from shardface.dataset.geometry import check_files
from shardface.dataset.images import jpeg_decoder, stored_bytes
from shardface.dataset.shares import Ranks, tool_ranks
from shardface.errors import ConfigError
from shardface.eval.cfp import read_list
from shardface.eval.pairs import check_images
from shardface.eval.verification import NFOLDS, write_bin
from shardface.faces.stream import align_groups, aligned_pngs
from shardface.infer.pair_photos import cache_paths, check_cache
from shardface.infer.ranked import find_faces_ranked
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_align_options,
    add_pair_list_options,
    detection_from,
    face_detection,
    list_faces,
    retries_from,
    workers_from,
)
from shardface.utils.outputs import check_output_file, refuse_inputs
from shardface.utils.progress import progress_bar

DEFAULT_PAIRS = 3000


def draw_pairs(
    groups: list[list[str]], pairs: int | None, seed: int
) -> tuple[list[tuple[str, str]], list[bool]]:
    """`pairs` pairs of paths (same and different alternating, same first) and their issame;
    `pairs=None` takes DEFAULT_PAIRS or as many balanced pairs as the images allow."""
    rng = random.Random(seed)
    same_pool = [pair for g in groups for pair in itertools.combinations(g, 2)]
    labelled = [(path, label) for label, g in enumerate(groups) for path in g]
    n_possible = (len(labelled) ** 2 - sum(len(g) ** 2 for g in groups)) // 2
    if pairs is None:
        pairs = min(DEFAULT_PAIRS, 2 * len(same_pool), 2 * n_possible)
    n_same, n_diff = (pairs + 1) // 2, pairs // 2
    if len(same_pool) < n_same:
        raise ValueError(
            f"{len(same_pool)} same-identity pairs exist (identities with 2 or more images), "
            f"{n_same} needed: pass --pairs {2 * len(same_pool)} or fewer, or add images"
        )
    same = rng.sample(same_pool, n_same)
    if n_possible < n_diff:
        raise ValueError(
            f"{n_possible} different-identity pairs exist, {n_diff} needed: "
            f"pass --pairs {2 * n_possible} or fewer, or add identities"
        )
    diff: list[tuple[str, str]] = []
    seen: set[frozenset] = set()
    while len(diff) < n_diff:
        (a, la), (b, lb) = rng.sample(labelled, 2)
        if la != lb and frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            diff.append((a, b))
    order = [p for pair in itertools.zip_longest(same, diff) for p in pair if p is not None]
    issame = [
        bool(v)
        for pair in itertools.zip_longest([True] * n_same, [False] * n_diff)
        for v in pair
        if v is not None
    ]
    return order, issame


def _helped(ranks: Ranks, output: str) -> int:
    print(f"rank {ranks.rank} of {ranks.world}: the faces of its share are found; rank 0 writes {output}")
    return 0


def write_list_bin(args, ranks: Ranks) -> int:
    """--pairs_list: the list's pairs in its order (see the module docstring)."""
    for given, name in ((args.pairs is not None, "--pairs"), (args.seed is not None, "--seed")):
        if given:
            raise ConfigError(f"{name} draws pairs; --pairs_list takes the list's own")
    if not args.align and (
        args.retry_upsample is not None or args.retry_mmod is not None or args.cache_dir is not None
    ):
        raise ConfigError(
            "--retry_upsample, --retry_mmod and --cache_dir search photos for faces: pass --align"
        )
    detection = face_detection(args)
    retries_from(args, detection)
    check_output_file(args.output, overwrite=args.overwrite)
    pair_list = read_list(args.pairs_list, args.folder, args.protocol, folder_is="FOLDER")
    check_images(pair_list)
    photos = pair_list.photos
    cache = cache_paths(args.pairs_list, None, args.cache_dir)[0]
    refuse_inputs([args.output] + ([cache] if args.align else []), photos + [args.pairs_list])
    if args.align:
        check_cache(cache)
        ranks.agree(photos, detection, args.retry_upsample, args.retry_mmod, args.strict, root="")
        faces = list_faces(args, pair_list, detection, args.strict, ranks).faces
        if ranks.rank != 0:
            return _helped(ranks, args.output)
        # each photo once
        encoded = dict(zip(photos, aligned_pngs(photos, faces, workers=workers_from(args))))
    else:
        check_files(photos, args.resize)
        encoded = {p: stored_bytes(p, args.resize) for p in photos}
    issame = pair_list.issame
    write_bin(args.output, [encoded[p] for pair in pair_list.pairs for p in pair], issame)
    sizes = sorted({stop - start for start, stop in pair_list.folds})
    print(
        f"wrote {args.output}: {len(issame)} pairs ({sum(issame)} same, {len(issame) - sum(issame)} different) "
        f"of {args.pairs_list} in its order, its {len(pair_list.folds)} folds of "
        f"{' or '.join(map(str, sizes))} pairs verification's folds, {len(photos)} images"
    )
    return 0


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="image folder, one sub-folder per held-out identity")
    p.add_argument("output", help="the .bin file to write")
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help=f"number of pairs, half same, half different (default {DEFAULT_PAIRS}, or as many as "
        "the images allow; LFW has 6000)",
    )
    p.add_seed(None, "fixes which pairs are drawn (default 0)")
    p.add_argument(
        "--pairs_list",
        default=None,
        help="write the pairs of this list, in its order: LFW's pairs.txt (images FOLDER/name/"
        "name_000n.jpg) or one `path1 path2 1|0` pair a line, paths relative to FOLDER (an "
        "absolute path is read where it points, even outside FOLDER); with --align a photo "
        "without a face is cut at a fallback face, never left out",
    )
    p.add_argument(
        "--resize",
        action="store_true",
        help="resize images that are not 112x112 instead of refusing them (resizing is not "
        "alignment; see docs/photos.md)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT.bin")
    add_align_options(p, "the images")
    add_pair_list_options(p)
    args = p.parse_args(argv)
    jpeg_decoder()  # a torchvision of another build: one line now, before any output
    ranks = tool_ranks()  # under torchrun with --align: the ranks share the face finding, rank 0 writes
    if ranks.world > 1 and not args.align:
        raise ConfigError(
            f"torchrun's {ranks.world} ranks: only --align's face finding is shared among machines; "
            "without --align write the .bin in one process"
        )
    if args.pairs_list is not None:
        return write_list_bin(args, ranks)
    if (
        args.retry_upsample is not None
        or args.retry_mmod is not None
        or args.cache_dir is not None
        or args.protocol
    ):
        raise ConfigError(
            "--retry_upsample, --retry_mmod, --cache_dir and --protocol are for --pairs_list (photos "
            "without a face are left out of a drawn set)"
        )
    args.seed = 0 if args.seed is None else args.seed
    if args.pairs is not None and args.pairs < NFOLDS:
        raise DataError(f"--pairs {args.pairs}: verification needs at least {NFOLDS} pairs (its folds)")
    check_output_file(args.output, overwrite=args.overwrite)
    names, groups = list_identity_folders(args.folder)
    parts = None
    if args.align:
        detection = detection_from(args)
        what = "finding faces" + (f" (rank 0's share of {ranks.world})" if ranks.world > 1 else "")
        with progress_bar(sum(map(len, groups)), what, shown=ranks.rank == 0) as bar:
            paths = [p for g in groups for p in g]
            ranked = find_faces_ranked(paths, detection, args.output, ranks, bar.update, workers_from(args))
        if ranked is None:
            return _helped(ranks, args.output)
        found, parts = ranked
        groups, faces = align_groups(groups, detection, args.strict, names=names, found=found)
    try:
        pairs, issame = draw_pairs(groups, args.pairs, args.seed)
    except ValueError as exc:  # too few pairs
        raise DataError(f"{args.folder}: {exc}") from None
    if len(issame) < NFOLDS:
        raise DataError(
            f"{args.folder}: only {len(issame)} balanced pairs can be drawn, fewer than the {NFOLDS} "
            "folds of verification: add people or images"
        )
    used = sorted({path for pair in pairs for path in pair})
    refuse_inputs([args.output], used)
    if not args.align:
        check_files(used, args.resize)
    # each is decoded (a truncated one is named) or aligned
    encoded = (
        dict(zip(used, aligned_pngs(used, faces, workers=workers_from(args))))
        if args.align
        else {path: stored_bytes(path, args.resize) for path in used}
    )
    write_bin(args.output, [encoded[path] for pair in pairs for path in pair], issame)
    if parts is not None:  # the ranks' faces, kept until the output is published
        parts.remove()
    print(
        f"wrote {args.output}: {len(issame)} pairs ({sum(issame)} same, {len(issame) - sum(issame)} "
        f"different) of {len(groups)} identities, {len(used)} images"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
