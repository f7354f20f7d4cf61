#!/usr/bin/env python
"""Verify a trained backbone on LFW-format .bin sets and print a table of results (10-fold accuracy).
`python -m scripts.verify MODEL --bin lfw.bin [--bin cfp_fp.bin ...]`, or straight from photos:
`python -m scripts.verify MODEL --pairs_list pairs.txt --images FOLDER`, or CFP's own protocols:
`python -m scripts.verify MODEL --pairs_list CFP_ROOT --protocol FP` (or FF).

The .bin sets hold insightface's 112x112 crops; a model made for another crop (MODEL `dlib`,
150x150 dlib chips) sees them re-framed onto its template (infer.model.Model.reframe):
what falls outside the 112 crop is black, which costs some accuracy (docs/photos.md).

With --pairs_list (LFW's pairs.txt, a plain `path1 path2 1|0` list, eval.pairs, or a CFP root
with --protocol, eval.cfp) each photo is
cut to the model's own crop (infer.stream: dlib's own chip for MODEL `dlib`, the 112 alignment for
ours), so nothing is re-framed and no .bin is written; the pairs are scored in the list's order,
on its own folds, in the same table. No pair is dropped: a photo where no face is found (after
the retries asked for) is cut at a fallback face and named, as scripts.make_bin does (one place
decides: infer.pair_photos); --strict refuses such photos instead. Detected faces are cached
beside the list per photo content and face options, embeddings per model (infer.cache), so
a second model on the same list does not detect again, and a second run embeds nothing."""

from __future__ import annotations

import os
import sys

from shardface.errors import ConfigError
from shardface.eval.cfp import list_name, read_list
from shardface.eval.pairs import check_images, score_pairs
from shardface.eval.verification import NFOLDS, load_bin, test
from shardface.faces.align import ARCFACE_112
from shardface.infer.embed import refuse_non_finite_embeddings
from shardface.infer.pair_photos import EmbeddingCache, cache_paths, check_cache, pair_embeddings
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_detection_options,
    add_model_options,
    add_pair_list_options,
    add_workers_option,
    face_detection,
    list_faces,
    model_from,
    retries_from,
)
from shardface.utils.outputs import refuse_inputs


def verify_list(args, embedder, pair_list, detection):
    """The list's pairs, each photo cut to the model's own crop: the VerificationResult."""
    faces_cache, emb_cache = cache_paths(args.pairs_list, embedder.fingerprint, args.cache_dir)
    refuse_inputs([faces_cache, emb_cache], pair_list.photos + [args.pairs_list])
    for path in (faces_cache, emb_cache):
        check_cache(path)
    print(f"{embedder.name}: each photo cut to its own crop, {embedder.crop_name}")
    faces = list_faces(args, pair_list, detection, args.strict)
    embedded = pair_embeddings(
        embedder, pair_list.photos, faces, EmbeddingCache(emb_cache, embedder), args.batch_size
    )
    print(embedded.report())
    return score_pairs(pair_list, embedded.emb, embedded.emb_flip)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p, batch_size=128)
    p.add_argument("--bin", action="append", default=[], help="a .bin file (repeatable)")
    p.add_argument(
        "--pairs_list",
        default=None,
        help="verify the pairs of this list from photos: LFW's pairs.txt (images FOLDER/name/"
        "name_000n.jpg), one `path1 path2 1|0` pair a line, paths relative to --images (an "
        "absolute path is read where it points, even outside --images), or a CFP root with "
        "--protocol",
    )
    p.add_argument("--images", default=None, help="with --pairs_list, the folder of its photos")
    p.add_argument(
        "--strict",
        action="store_true",
        help="with --pairs_list, refuse photos without a face instead of cutting them at a fallback face",
    )
    add_detection_options(p)
    add_workers_option(p)
    add_pair_list_options(p)
    args = p.parse_args(argv)
    if not args.bin and args.pairs_list is None:
        raise ConfigError("nothing to verify: pass --bin FILE or --pairs_list FILE --images FOLDER")
    if args.images is not None and args.pairs_list is None:
        raise ConfigError("--images goes with --pairs_list: the list names photos in the folder")
    pair_list = detection = None
    if args.pairs_list is not None:  # the list and its photos checked, the detectors loaded, before any work
        detection = face_detection(args)
        retries_from(args, detection)
        pair_list = read_list(args.pairs_list, args.images, args.protocol)
        check_images(pair_list)
    embedder = model_from(args, detection)
    model = embedder.module_for(ARCFACE_112)
    if args.bin and model is not embedder.module:
        print(
            f"{embedder.name} takes {embedder.template.name} crops: the sets' {ARCFACE_112.name} crops are re-framed onto it"
        )
    rows = []
    if pair_list is not None:
        r = verify_list(args, embedder, pair_list, detection)
        rows.append((list_name(pair_list), r.accuracy, r.accuracy_flip, r.std_flip, r.xnorm))
    for path in args.bin:
        r = test(load_bin(path, min_pairs=NFOLDS, flag="--bin"), model, args.batch_size)
        for emb in (r.embeddings, r.embeddings_flip):  # NaN distances would verify as chance
            refuse_non_finite_embeddings(emb, f"{args.model} on {path}")
        rows.append((os.path.basename(path), r.accuracy, r.accuracy_flip, r.std_flip, r.xnorm))
    print(f"{'set':<20} {'acc':>8} {'acc-flip':>9} {'std':>7} {'XNorm':>8}")
    for name, acc, acc_flip, std_flip, xnorm in rows:
        print(f"{name:<20} {acc:8.4f} {acc_flip:9.4f} {std_flip:7.4f} {xnorm:8.3f}")
    print(
        f"acc, acc-flip: {NFOLDS}-fold accuracy (insightface's protocol: each fold judged at the threshold best on "
        f"the other {NFOLDS - 1}); scripts.compare --threshold-from prints the best-threshold accuracy over all "
        f"pairs, fitted to them and so usually higher"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
