#!/usr/bin/env python
"""IJB-B / IJB-C evaluation of a trained backbone: 1:1 verification (TAR at fixed FAR, optional ROC
plot) or, with --protocol 1:N, identification (rank-1/5 and TPIR@FPIR per gallery, eval/ijb_1n.py).
`python -m scripts.ijb RUN_OR_CHECKPOINT --root /data/IJB_release/IJBC --target IJBC [--protocol 1:N]`."""

from __future__ import annotations

import sys

from shardface.eval.ijb import check_roc_path, evaluate_ijb, meta_folder
from shardface.eval.ijb_1n import evaluate_ijb_1n
from shardface.faces.align import ARCFACE_112
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import add_model_options, model_from


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("--root", required=True, help="IJB directory with meta/ and loose_crop/")
    p.add_argument(
        "--target", default="IJBC", choices=["IJBB", "IJBC"], help="which benchmark ROOT holds (default IJBC)"
    )
    p.add_argument("--roc", default=None, help="PNG path for the ROC plot (1:1)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --roc file")
    p.add_argument(
        "--protocol",
        default="1:1",
        choices=["1:1", "1:N"],
        help="1:1 verification (default) or 1:N identification with the mixed probes",
    )
    args = p.parse_args(argv)
    if args.protocol == "1:N" and args.roc:
        p.error("--roc draws the 1:1 ROC; it has no meaning with --protocol 1:N")
    meta_folder(args.root)  # before the model is loaded: a wrong --root, and the ROC's place
    check_roc_path(args.roc, args.overwrite)
    backbone = model_from(args).module_for(ARCFACE_112)  # IJB crops are aligned to it
    if args.protocol == "1:N":
        for gallery, m in evaluate_ijb_1n(args.root, backbone, args.target.lower(), args.batch_size).items():
            tpir = "  ".join(f"TPIR@FPIR {f:.0e}: {t:.4f}" for f, t in m.get("tpir", {}).items())
            print(
                f"{args.target} 1:N {gallery}: rank-1 {m['rank1']:.4f}  rank-5 {m['rank5']:.4f}  {tpir}  "
                f"({m['mated']} mated, {m['nonmated']} non-mated probes)"
            )
        return 0
    tars = evaluate_ijb(args.root, backbone, args.target.lower(), args.batch_size, args.roc, args.overwrite)
    print(f"{args.target} 1:1 TAR@FAR: " + "  ".join(f"{far:.0e}: {tar:.4f}" for far, tar in tars.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
