#!/usr/bin/env python
"""Who is this? 1:N search of query photos against a gallery folder of people.
`python -m scripts.identify MODEL --gallery DIR [--align] [--top K] [--threshold T | --threshold-from VAL.bin] QUERY...`

The gallery is one folder per person; each person is scored by the mean template of their
images (infer/enrolment.py). The enrolment is cached in DIR/.shardface_gallery.sqlite and updated
when images are added, changed or removed; a gallery file of another MODEL is refused
(--rebuild replaces it). One line per face of each query: the file, the face (index and box),
the best person and their cosine score, or `unknown (best ...)` when the score is below the
threshold (in --json, `"name": null`).
The threshold used and where it came from are printed first (infer/thresholds.py): --threshold,
--threshold_from, or the MODEL's own (dlib's distance 0.6; a trained run's, at a stated FAR on
its validation set, saved by training and carried by export_onnx); a MODEL with none names no one."""

from __future__ import annotations

import json
import sys

from shardface.dataset.folders import image_files
from shardface.eval.verification import fit_threshold
from shardface.infer.enrolment import (
    GalleryError,
    GalleryFile,
    check_image,
    default_cache,
    embedded_faces,
    enrol,
    matches,
)
from shardface.infer.search import ENGINES
from shardface.infer.thresholds import chosen_threshold, no_threshold
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_align_options,
    add_model_options,
    face_detection,
    model_from,
    workers_from,
)


def query_files(inputs: list[str], template, align: bool) -> list[str]:
    """The query images (folders searched recursively), each header read: a file that is not an
    image is refused by name before the gallery is enrolled."""
    try:
        paths = image_files(inputs)
    except FileNotFoundError as exc:
        raise GalleryError(str(exc)) from None
    for path in paths:
        check_image(path, template, align)
    return paths


def result_rows(places: list[tuple[str, int]], matched) -> list[dict]:
    """One JSON row per face, at `places` (photo, index of the face: 0 the largest) with its Match
    (infer.enrolment); `name` is null where nobody reaches the threshold (a person may be called
    "unknown")."""
    return [
        {
            "file": path,
            "face": index,
            "box": [int(round(v)) for v in m.face.box],
            "name": m.name,
            "score": round(m.score, 6),
            "candidates": [{"name": n, "score": round(v, 6)} for n, v in m.candidates],
        }
        for (path, index), m in zip(places, matched)
    ]


def format_row(row: dict, threshold, top: int) -> str:
    where = f"{row['file']}  face {row['face']} [{','.join(map(str, row['box']))}]"
    best = row["candidates"][0]
    if row["name"] is None:
        text = f"{where}  unknown (best {best['name']} {best['score']:.4f} < threshold {threshold:.4f})"
    else:
        text = f"{where}  {row['name']} {row['score']:.4f}"
    if top > 1:
        text += "  top: " + ", ".join(f"{c['name']} {c['score']:.4f}" for c in row["candidates"])
    return text


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p)
    add_align_options(p, "the gallery and query images")
    p.add_argument("queries", nargs="+", help="query photos or folders of them")
    p.add_argument("--gallery", required=True, help="folder with one folder of images per person")
    p.add_argument("--top", type=int, default=1, help="candidates to list per face (default 1)")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="cosine score below which a face is `unknown`, in [-1, 1] (default: the MODEL's own; "
        "dlib: its distance 0.6)",
    )
    how.add_argument(
        "--threshold_from",
        default=None,
        metavar="BIN",
        help="a verification .bin: use the threshold that separates its pairs best",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    p.add_argument(
        "--cache",
        default=None,
        help="the gallery file (default GALLERY/.shardface_gallery.sqlite, "
        "with --no_ema GALLERY/.shardface_gallery.no_ema.sqlite)",
    )
    p.add_argument(
        "--rebuild", action="store_true", help="enrol every image again, replacing the gallery file"
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=ENGINES,
        help="search engine, all exact with the same results: auto (default: the faster of the two "
        "for the gallery's size, the number of faces and the threads, by the table in "
        "benchmarks/runs/search_grid.md), faiss (IndexFlatIP) or exact (ours, blocked torch)",
    )
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top must be at least 1, got {args.top}")
    chosen_threshold(args.threshold)  # a threshold that is no cosine: refused before any work
    detection = face_detection(args)
    cache = args.cache or default_cache(args.gallery, ema=not args.no_ema)
    GalleryFile.check(cache)
    embedder = model_from(args, detection)
    chosen = chosen_threshold(args.threshold, own=embedder.threshold)
    if chosen is None and not args.threshold_from:  # refused before the gallery is enrolled
        raise no_threshold(args.model)
    # each answered once
    queries = list(dict.fromkeys(query_files(args.queries, embedder.template, args.align)))
    if args.threshold_from:  # insightface's 112x112 crops, re-framed onto the model's template
        chosen = fit_threshold(embedder, args.threshold_from, batch_size=args.batch_size)
    threshold = chosen.value
    workers = workers_from(args)
    gallery = enrol(
        args.gallery,
        embedder,
        args.align,
        cache,
        args.rebuild,
        batch_size=args.batch_size,
        show_progress=not args.json,
        strict=args.strict,
        workers=workers,
    )
    photos = embedded_faces(
        queries,
        embedder,
        args.align,
        args.batch_size,
        workers,
        show_progress=not args.json,
        strict=args.strict,
    )
    places = [(photo.name, i) for photo in photos for i in range(len(photo.faces))]
    faces = [face for photo in photos for face in photo.faces]
    rows = result_rows(places, matches(faces, gallery, threshold, args.top, args.engine, embedder.device))
    without = [q for q in queries if q not in {photo.name for photo in photos}]
    if args.json:
        print(
            json.dumps(
                {
                    "model": embedder.name,
                    "gallery": args.gallery,
                    "people": len(gallery.names),
                    "threshold": threshold,
                    "threshold_source": chosen.source,
                    "faces": rows,
                    "no_face": without,
                },
                indent=1,
            )
        )
        return 0
    print(chosen.line())
    for path in queries:  # in the order given
        lines = [format_row(row, threshold, args.top) for row in rows if row["file"] == path]
        print("\n".join(lines) if lines else f"{path}  no face found")
    return 0


if __name__ == "__main__":
    sys.exit(main())
