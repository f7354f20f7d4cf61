#!/usr/bin/env python
"""Export a backbone to ONNX (input `data`: N x 3 x h x w RGB in [-1, 1], h x w its crop: 112x112,
150x150 for `dlib`; dynamic batch, fp32) and check onnxruntime against torch on batches of 1 and 8
before the file replaces anything (it is published atomically; an output that is an input is
refused). `python -m scripts.export_onnx MODEL [OUT]`: OUT is the .onnx file or a directory for
`model.onnx`, by default the run's own directory (for `dlib`, OUT is needed). An existing OUT is
replaced only with `--overwrite`, except the run's own `model.onnx` that an earlier export wrote,
which each export refreshes (`refreshes`). The model's crop
template is recorded in the file's metadata (`shardface.template`), so the ONNX form is fed as the
original."""

from __future__ import annotations

import json
import os
import sys
import warnings

import numpy as np
import torch

from shardface.checkpoint.files import CheckpointError
from shardface.faces.align import ARCFACE_112, Template
from shardface.infer.model import model_files, model_kind
from shardface.infer.onnx import TEMPLATE_KEY, template_json
from shardface.infer.thresholds import THRESHOLD_KEY
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import add_model_options, model_from
from shardface.utils.atomic import publishing
from shardface.utils.outputs import check_output_file, refuse_inputs


def export(
    model: torch.nn.Module,
    output: str,
    opset: int = 17,
    template: Template = ARCFACE_112,
    parity: bool = False,
    threshold: dict | None = None,
) -> None:
    """Write `model` to `output` with its crop template in the metadata, and the run's own
    threshold where it has one (infer.thresholds: THRESHOLD_KEY), published atomically
    (utils.atomic): with `parity`, the file is checked against torch (`check_parity`) before it
    replaces anything."""
    import onnx

    model = model.float().eval()
    dummy = torch.zeros(1, 3, *template.size)
    # the TorchScript exporter: the dynamo one needs onnxscript, not among our dependencies
    warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export")
    # dlib's add_prev compares shapes, fixed by the fixed input size: the trace is exact
    warnings.filterwarnings("ignore", category=torch.jit.TracerWarning, module="backbones.dlib_resnet")
    with publishing(output) as tmp:
        torch.onnx.export(
            model,
            dummy,
            tmp,
            input_names=["data"],
            output_names=["embedding"],
            dynamic_axes={"data": {0: "batch"}, "embedding": {0: "batch"}},
            opset_version=opset,
            dynamo=False,
        )
        proto = onnx.load(tmp)
        entry = proto.metadata_props.add()
        entry.key, entry.value = TEMPLATE_KEY, template_json(template)
        if threshold is not None:
            entry = proto.metadata_props.add()
            entry.key, entry.value = THRESHOLD_KEY, json.dumps(threshold)
        onnx.save(proto, tmp)
        if parity:
            check_parity(model, tmp, size=template.size, name=output)


def check_parity(
    model: torch.nn.Module,
    onnx_path: str,
    batches=(1, 8),
    seed: int = 0,
    size: tuple[int, int] = (112, 112),
    name: str | None = None,
) -> float:
    """max |onnx - torch| relative to max(1, max |torch|); raises when it exceeds 1e-4, and
    when either output is not finite (NaN compares as no difference at all)."""
    import onnx
    import onnxruntime as ort

    name = name or onnx_path
    onnx.checker.check_model(onnx.load(onnx_path))
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for n in batches:
        x = torch.rand(n, 3, *size, generator=g) * 2 - 1
        with torch.no_grad():
            ref = model(x).numpy()
        out = session.run(None, {"data": x.numpy()})[0]
        if out.shape != ref.shape:
            raise RuntimeError(f"onnx output shape {out.shape} != torch {ref.shape} at batch {n}")
        for what, values in (("torch", ref), ("onnxruntime", out)):
            if not np.isfinite(values).all():
                raise CheckpointError(
                    f"{name}: {what}'s output is not finite (NaN or inf) at batch {n}; "
                    f"the model is unusable, nothing was exported"
                )
        rel = float(np.abs(out - ref).max() / max(1.0, float(np.abs(ref).max())))
        print(
            f"batch {n}: max |onnx - torch| = {np.abs(out - ref).max():.3e} "
            f"(relative to max(1, max|torch|) = {rel:.3e})"
        )
        worst = max(worst, rel)
    if worst > 1e-4:
        raise RuntimeError(f"{name}: onnxruntime differs from torch by {worst:.3e} > 1e-4")
    return worst


def output_path(checkpoint: str, output: str | None) -> str:
    """Where the model goes: `output` itself, `output/model.onnx` when it is a directory (or
    ends in a separator), or `model.onnx` beside what was exported (in a run or checkpoint
    directory, or beside a model.pt)."""
    if output is None:
        folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(os.path.abspath(checkpoint))
        return os.path.join(folder, "model.onnx")
    if os.path.isdir(output) or output.endswith(("/", os.sep)):
        return os.path.join(output, "model.onnx")
    return output


def is_export(path: str) -> bool:
    """Whether `path` is an ONNX model this export wrote (its metadata records the crop template)."""
    import onnx

    if not os.path.isfile(path):
        return False
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception:  # a photo, a text file, a damaged model: not ours to refresh
        return False
    return any(entry.key == TEMPLATE_KEY for entry in proto.metadata_props)


def refreshes(model: str, output: str) -> bool:
    """Whether the export may replace `output` without --overwrite: only the run's own `model.onnx`
    (the default OUT of `model`: in its run or checkpoint directory, or beside its model.pt) that an
    earlier export wrote. Anything else there (a photo, a text file, another model) is the user's."""
    if model_kind(model) == "dlib":  # no run of its own: OUT is always the user's choice
        return False
    own = output_path(model, None)
    return os.path.realpath(output) == os.path.realpath(own) and is_export(output)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    add_model_options(p, batch_size=None)
    p.add_argument(
        "output",
        nargs="?",
        default=None,
        help="the .onnx file, or a directory for model.onnx (default: model.onnx in the run's directory)",
    )
    p.add_argument("--opset", type=int, default=17, help="ONNX opset version (default 17)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUT (the run's own model.onnx of an earlier export is refreshed "
        "without it)",
    )
    args = p.parse_args(argv)
    kind = model_kind(args.model)
    if kind == "dlib" and args.output is None:
        raise CheckpointError("dlib has no run directory to export into: pass OUT (e.g. dlib.onnx)")
    if kind == "onnx":
        raise CheckpointError(f"{args.model}: already an ONNX model")
    output = output_path(args.model, args.output)
    refuse_inputs([output], model_files(args.model))
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    # before the model is loaded: an existing OUT is replaced only with --overwrite, but for `refreshes`
    check_output_file(output, overwrite=args.overwrite or refreshes(args.model, output), what="OUT")
    model = model_from(args)
    module = model.module.cpu()
    own = model.threshold.record if model.threshold is not None else None
    export(module, output, args.opset, model.template, parity=True, threshold=own)
    how = f"at FAR {own['far']:g}" if own and "far" in own else "dlib's own rule"
    print(
        f"exported {output}" + (f" with the model's threshold {own['threshold']:.4f} ({how})" if own else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
