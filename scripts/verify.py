#!/usr/bin/env python
"""Verify a trained backbone on LFW-format .bin sets and print a table of results (10-fold accuracy).
`python -m scripts.verify MODEL --bin lfw.bin [--bin cfp_fp.bin ...]`.

The .bin sets hold insightface's 112x112 crops; a model made for another crop (MODEL `dlib`,
150x150 dlib chips) sees them re-framed onto its template (infer.model.Model.from_crops):
what falls outside the 112 crop is black, which costs some accuracy (README 'Your own images')."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

from eval.verification import NFOLDS, load_bin, test
from faces.align import ARCFACE_112
from infer.embed import refuse_non_finite_embeddings
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from scripts.options import add_model_options, model_from


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p, batch_size=128)
    p.add_argument("--bin", action="append", required=True, help="a .bin file (repeatable)")
    args = p.parse_args(argv)
    embedder = model_from(args)
    model = embedder.for_crops(ARCFACE_112)
    if model is not embedder.module:
        print(f"{embedder.name} takes {embedder.template.name} crops: the sets' {ARCFACE_112.name} crops are re-framed onto it")
    rows = []
    for path in args.bin:
        r = test(load_bin(path, min_pairs=NFOLDS), model, args.batch_size)
        for emb in (r.embeddings, r.embeddings_flip):  # NaN distances would verify as chance
            refuse_non_finite_embeddings(emb, f"{args.model} on {path}")
        rows.append((os.path.basename(path), r.accuracy, r.accuracy_flip, r.std_flip, r.xnorm))
    print(f"{'set':<20} {'acc':>8} {'acc-flip':>9} {'std':>7} {'XNorm':>8}")
    for name, acc, acc_flip, std_flip, xnorm in rows:
        print(f"{name:<20} {acc:8.4f} {acc_flip:9.4f} {std_flip:7.4f} {xnorm:8.3f}")
    print(f"acc, acc-flip: {NFOLDS}-fold accuracy (insightface's protocol: each fold judged at the threshold best on "
          f"the other {NFOLDS - 1}); scripts.compare --threshold-from prints the best-threshold accuracy over all "
          f"pairs, fitted to them and so usually higher")
    return 0


if __name__ == "__main__":
    sys.exit(main())
