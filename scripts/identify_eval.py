#!/usr/bin/env python
"""1:N accuracy of a model on a folder of people: rank-1/5 and CMC (closed set), TPIR at FPIR (open set).
`python -m scripts.identify_eval MODEL DIR [--align] [--gallery_per_id N] [--unknown_ids K] [--plot cmc_det.png]`

DIR is one folder per person, as scripts.identify's gallery. K people (drawn with --seed) are
held out: all their images are non-mated probes. Of every other person, N images (drawn with
--seed) are enrolled as their mean template and the rest are mated probes (a person with N
images or fewer is enrolled without probes: a distractor). Definitions: eval/identification.py
(IJB-C's): rank-k counts mated probes; FPIR counts non-mated probes whose best score passes the
threshold, TPIR mated probes found at rank 1 above it."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import json
import os
import sys

import numpy as np

from eval.embedder import load_embedder
from eval.gallery import GalleryError, check_image, list_gallery, photo_faces, refuse_faceless
from eval.identification import FPIR_LEVELS, cmc, det_curve, mate_ranks, plot_cmc_det, tpir_at_fpir
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from faces.photos import Detection
from scripts.identify import add_model_args, face_detection


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


def evaluate(embedder, folder: str, align: bool, per_id: int, unknown: int, seed: int,
             detection: Detection = Detection(), batch_size: int = 64, max_rank: int = 20, strict: bool = False):
    people = list_gallery(folder)
    if unknown >= len(people):
        raise GalleryError(f"{folder}: --unknown_ids {unknown} leaves no one to enrol ({len(people)} people)")
    enrolled, mated, nonmated = split(people, per_id, unknown, seed)
    if not mated:
        raise GalleryError(f"{folder}: no person has more than --gallery_per_id {per_id} images, so no mated probes")
    files = sorted({f for _, fs in enrolled for f in fs} | {f for _, f in mated + nonmated})
    for f in files:  # every header before the first embedding
        check_image(os.path.join(folder, f), embedder.template, align)
    faces, paths = {}, [os.path.join(folder, f) for f in files]
    found = photo_faces(paths, embedder, align, detection, batch_size)
    if strict:
        refuse_faceless(paths, found, detection)
    for face in found:
        if face.index == 0:  # the largest face of each image
            faces[os.path.relpath(face.path, folder)] = face.embedding
    names, templates = [], []
    for name, fs in enrolled:
        found = [faces[f] for f in fs if f in faces]
        if found:
            mean = np.mean(found, 0)
            names.append(name)
            templates.append(mean / np.linalg.norm(mean))
    probes = [(n, faces[f]) for n, f in mated + nonmated if f in faces]
    scores = np.stack([e for _, e in probes]) @ np.stack(templates).T
    ranks, mate = mate_ranks(scores, np.array(names), np.array([n for n, _ in probes]))
    nonmated_top = scores[ranks < 0].max(1) if (ranks < 0).any() else np.zeros(0)
    result = {"people_enrolled": len(names), "mated_probes": int((ranks >= 0).sum()),
              "nonmated_probes": int((ranks < 0).sum()),
              "cmc": cmc(ranks, min(max_rank, len(names))).tolist()}
    result["rank1"], result["rank5"] = result["cmc"][0], result["cmc"][min(5, len(names)) - 1]
    if len(nonmated_top):
        result["tpir_at_fpir"] = {str(f): {"tpir": t, "threshold": th}
                                  for f, (t, th) in tpir_at_fpir(ranks, mate, nonmated_top, FPIR_LEVELS).items()}
    return result, (ranks, mate, nonmated_top)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, "the folder's images")
    p.add_argument("folder", help="one folder of images per person")
    p.add_argument("--gallery_per_id", type=int, default=1, help="images enrolled per person (default 1)")
    p.add_argument("--unknown_ids", type=int, default=None,
                   help="people held out as non-mated probes (default: a tenth, at least 1)")
    p.add_argument("--seed", type=int, default=0, help="draws the held-out people and the enrolled images")
    p.add_argument("--plot", default=None, help="PNG path for the CMC and DET curves")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args(argv)
    if args.gallery_per_id < 1:
        p.error(f"--gallery_per_id must be at least 1, got {args.gallery_per_id}")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise GalleryError(f"--plot {args.plot}: its directory does not exist")
    unknown = args.unknown_ids if args.unknown_ids is not None else max(1, len(list_gallery(args.folder)) // 10)
    detection = face_detection(args)
    embedder = load_embedder(args.model, args.network, ema=not args.no_ema)
    result, (ranks, mate, non) = evaluate(embedder, args.folder, args.align, args.gallery_per_id, unknown, args.seed,
                                          detection, args.batch_size, strict=args.strict)
    if args.plot:
        fpir, fnir = det_curve(ranks, mate, non) if len(non) else (np.zeros(0), None)
        plot_cmc_det(np.array(result["cmc"]), fpir, fnir, args.plot, f"{os.path.basename(args.folder)}: "
                     f"{result['people_enrolled']} enrolled, {result['mated_probes']} mated and "
                     f"{result['nonmated_probes']} non-mated probes")
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{result['people_enrolled']} people enrolled ({args.gallery_per_id} images each at most), "
          f"{result['mated_probes']} mated probes, {result['nonmated_probes']} non-mated probes ({unknown} people)")
    print(f"closed set: rank-1 {result['rank1']:.4f}  rank-5 {result['rank5']:.4f}")
    for f, v in result.get("tpir_at_fpir", {}).items():
        print(f"open set: TPIR@FPIR {float(f):.0e}: {v['tpir']:.4f} (threshold {v['threshold']:.4f})")
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
