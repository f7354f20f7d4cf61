#!/usr/bin/env python
"""1:N accuracy of a model on a folder of people: rank-1/5 and CMC (closed set), TPIR at FPIR (open set).
`python -m scripts.identify_eval MODEL DIR [--align] [--gallery_per_id N] [--unknown_ids K] [--plot cmc_det.png]`

DIR is one folder per person, as scripts.identify's gallery. K people (drawn with --seed) are
held out: all their images are non-mated probes. Of every other person, N images (drawn with
--seed) are enrolled as their mean template and the rest are mated probes (a person with N
images or fewer is enrolled without probes: a distractor). Definitions: eval/identification.py
(IJB-C's): rank-k counts mated probes; FPIR counts non-mated probes whose best score passes the
threshold, TPIR mated probes found at rank 1 above it. Images without a face (--align) are left
out and named, enrolment and probes apart; a person left with no enrolled face is named and
their probes left out (not counted as non-mated). A figure the data cannot support is `n/a`,
saying what it needs: rank-k with k people enrolled or fewer, TPIR at FPIR f with fewer than
1/f non-mated probes.

Under torchrun (`torchrun --nnodes N --nproc_per_node K -m scripts.identify_eval MODEL DIR ...`) each
rank embeds a contiguous share of the sorted images, and rank 0 reports what one process reports
(dataset/shares.py: the ranks agree on the job first; a rank that fails ends them all)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from shardface.dataset.shares import Ranks, share_of, tool_ranks
from shardface.eval.identification import (
    FPIR_LEVELS,
    cmc,
    det_curve,
    mate_ranks,
    nonmated_needed,
    plot_cmc_det,
    tpir_at_fpir,
)
from shardface.infer.enrolment import GalleryError, embedded_faces, list_gallery
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_align_options,
    add_model_options,
    face_detection,
    model_from,
    workers_from,
)
from shardface.utils.outputs import check_output_file


def split(people: list[tuple[str, list[str]]], per_id: int, unknown: int, seed: int):
    """(enrolled [(name, files)], mated [(name, file)], non-mated [(name, file)])."""
    rng = np.random.default_rng(seed)
    held = set(rng.choice(len(people), unknown, replace=False).tolist()) if unknown else set()
    enrolled, mated, nonmated = [], [], []
    for i, (name, files) in enumerate(people):
        if i in held:
            nonmated += [(name, f) for f in files]
            continue
        order = [files[j] for j in rng.permutation(len(files))]
        enrolled.append((name, sorted(order[:per_id])))
        mated += [(name, f) for f in sorted(order[per_id:])]
    return enrolled, mated, nonmated


def evaluate(
    model,
    folder: str,
    align: bool,
    per_id: int,
    unknown: int,
    seed: int,
    batch_size: int = 64,
    max_rank: int = 20,
    strict: bool = False,
    workers: int = 1,
    show_progress: bool = False,
    ranks: Ranks = Ranks(),
):
    people = list_gallery(folder)
    if unknown < 0:
        raise GalleryError(f"--unknown_ids {unknown}: the number of people held out, 0 or more")
    if unknown >= len(people):
        raise GalleryError(f"{folder}: --unknown_ids {unknown} leaves no one to enrol ({len(people)} people)")
    enrolled, mated, nonmated = split(people, per_id, unknown, seed)
    if not mated:
        raise GalleryError(
            f"{folder}: no person has more than --gallery_per_id {per_id} images, so no mated probes"
        )
    files = sorted({f for _, fs in enrolled for f in fs} | {f for _, f in mated + nonmated})
    faces, paths = {}, [os.path.join(folder, f) for f in files]
    ranks.agree(paths, align, per_id, unknown, seed, strict, root="", what="images")
    share = share_of(len(paths), ranks.rank, ranks.world)
    shares = ranks.outcome(
        lambda: embedded_faces(  # every header is read before the first embedding
            paths[share.start : share.end],
            model,
            align,
            batch_size,
            workers,
            largest_only=True,
            show_progress=show_progress and ranks.rank == 0,
            strict=strict,
        )
    )
    for photo in (photo for found in shares for photo in found):  # the largest face of each image
        faces[os.path.relpath(photo.name, folder)] = photo.face.embedding
    names, templates, not_enrolled = [], [], []
    for name, fs in enrolled:
        found = [faces[f] for f in fs if f in faces]
        if found:
            mean = np.mean(found, 0)
            names.append(name)
            templates.append(mean / np.linalg.norm(mean))
        else:
            not_enrolled.append(name)
    if not names:
        raise GalleryError(
            f"{folder}: none of the {sum(len(fs) for _, fs in enrolled)} images drawn for enrolment "
            f"has a face, so no one is enrolled"
        )
    # a person with no enrolled face is in no gallery, yet not held out: their probes are left
    # out (counted as non-mated they would shift FPIR)
    left_out = [f for n, f in mated if n in set(not_enrolled)]
    mated = [(n, f) for n, f in mated if n not in set(not_enrolled)]
    no_face = {
        "enrolment": [f for _, fs in enrolled for f in fs if f not in faces],
        "probes": [f for _, f in mated + nonmated if f not in faces],
    }
    if not any(f in faces for _, f in mated):
        raise GalleryError(
            f"{folder}: no mated probe has a face to search for ({len(no_face['probes'])} probe "
            f"image(s) without a face, {len(left_out)} of people left unenrolled)"
        )
    probes = [(n, faces[f]) for n, f in mated + nonmated if f in faces]
    scores = np.stack([e for _, e in probes]) @ np.stack(templates).T
    ranks, mate = mate_ranks(scores, np.array(names), np.array([n for n, _ in probes]))
    nonmated_top = scores[ranks < 0].max(1) if (ranks < 0).any() else np.zeros(0)
    result = {
        "people_enrolled": len(names),
        "mated_probes": int((ranks >= 0).sum()),
        "nonmated_probes": int((ranks < 0).sum()),
        "no_face": no_face,
        "not_enrolled": {"people": not_enrolled, "probes_left_out": left_out},
        "cmc": cmc(ranks, min(max_rank, len(names))).tolist(),
    }
    # rank-k says something only when k is below the people enrolled (at k >= people it is 1)
    result["rank1"], result["rank5"] = ((result["cmc"][k - 1] if k < len(names) else None) for k in (1, 5))
    if len(nonmated_top):
        measured = tpir_at_fpir(ranks, mate, nonmated_top, FPIR_LEVELS)
        result["tpir_at_fpir"] = {
            str(f): (
                {"tpir": t, "threshold": th}
                if len(nonmated_top) >= nonmated_needed(f)
                else {"tpir": None, "threshold": None, "needs_nonmated_probes": nonmated_needed(f)}
            )
            for f, (t, th) in measured.items()
        }
    return result, (ranks, mate, nonmated_top)


def report_lines(result: dict, folder: str, per_id: int, unknown: int) -> list[str]:
    """The text report: counts, what was left out and why, and each figure or why it is n/a."""
    lines = [
        f"{result['people_enrolled']} people enrolled ({per_id} images each at most), "
        f"{result['mated_probes']} mated probes, {result['nonmated_probes']} non-mated probes ({unknown} people)"
    ]
    for kind, files in result["no_face"].items():
        if files:
            lines.append(
                f"no face found in {len(files)} {'probe' if kind == 'probes' else kind} image(s), left out: "
                + ", ".join(os.path.join(folder, f) for f in files)
            )
    if result["not_enrolled"]["people"]:
        lines.append(
            f"not enrolled, no enrolment image with a face: {', '.join(result['not_enrolled']['people'])}; "
            f"their {len(result['not_enrolled']['probes_left_out'])} probe(s) left out"
        )
    ranks = [
        f"rank-{k} "
        + (
            f"{result[f'rank{k}']:.4f}"
            if result[f"rank{k}"] is not None
            else f"n/a (needs more than {k} people enrolled)"
        )
        for k in (1, 5)
    ]
    lines.append("closed set: " + "  ".join(ranks))
    if "tpir_at_fpir" not in result:
        lines.append("open set: n/a (no non-mated probes: hold people out with --unknown_ids)")
    for f, v in result.get("tpir_at_fpir", {}).items():
        if v["tpir"] is None:
            lines.append(
                f"open set: TPIR@FPIR {float(f):.0e}: n/a (needs >= {v['needs_nonmated_probes']} "
                f"non-mated probes, has {result['nonmated_probes']})"
            )
        else:
            lines.append(
                f"open set: TPIR@FPIR {float(f):.0e}: {v['tpir']:.4f} (threshold {v['threshold']:.4f})"
            )
    return lines


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p)
    add_align_options(p, "the folder's images")
    p.add_argument("folder", help="one folder of images per person")
    p.add_argument("--gallery_per_id", type=int, default=1, help="images enrolled per person (default 1)")
    p.add_argument(
        "--unknown_ids",
        type=int,
        default=None,
        help="people held out as non-mated probes (default: a tenth, at least 1)",
    )
    p.add_seed(0, "draws the held-out people and the enrolled images (default 0)")
    p.add_argument("--plot", default=None, help="PNG path for the CMC and DET curves")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args(argv)
    if args.gallery_per_id < 1:
        p.error(f"--gallery_per_id must be at least 1, got {args.gallery_per_id}")
    if (
        args.plot
    ):  # before the evaluation: a directory, a missing folder or an existing file without --overwrite
        check_output_file(args.plot, overwrite=args.overwrite, what="--plot")
    unknown = (
        args.unknown_ids if args.unknown_ids is not None else max(1, len(list_gallery(args.folder)) // 10)
    )
    tool = tool_ranks()  # under torchrun: each rank embeds its share (on its own GPU), rank 0 reports
    detection = face_detection(args)
    model = model_from(args, detection)
    result, (ranks, mate, non) = evaluate(
        model,
        args.folder,
        args.align,
        args.gallery_per_id,
        unknown,
        args.seed,
        args.batch_size,
        strict=args.strict,
        workers=workers_from(args),
        show_progress=not args.json,
        ranks=tool,
    )
    if tool.rank != 0:  # (with --json, rank 0's document alone)
        if not args.json:
            print(f"rank {tool.rank} of {tool.world}: its share of the images is embedded; rank 0 reports")
        return 0
    if args.plot:
        fpir, fnir = det_curve(ranks, mate, non) if len(non) else (np.zeros(0), None)
        plot_cmc_det(
            np.array(result["cmc"]),
            fpir,
            fnir,
            args.plot,
            f"{os.path.basename(args.folder)}: "
            f"{result['people_enrolled']} enrolled, {result['mated_probes']} mated and "
            f"{result['nonmated_probes']} non-mated probes",
        )
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("\n".join(report_lines(result, args.folder, args.gallery_per_id, unknown)))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
