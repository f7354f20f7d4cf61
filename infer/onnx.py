"""MODEL form `.onnx`: an exported model (scripts/export_onnx.py) run by onnxruntime behind the
module interface the rest of the code takes. Its crop template and its threshold travel in the
file's metadata (`TEMPLATE_KEY`, infer.thresholds.THRESHOLD_KEY)."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from torch import nn

from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.load import refuse_non_finite
from shardface.faces.align import ARCFACE_112, Template
from shardface.infer.thresholds import THRESHOLD_KEY, saved_threshold

TEMPLATE_KEY = "shardface.template"  # ONNX metadata: the crop template the model takes (JSON)


def template_json(template: Template) -> str:
    return json.dumps(
        {"name": template.name, "size": list(template.size), "points": np.asarray(template.points).tolist()}
    )


MIN_SPREAD = 0.02  # the five points' spread across their narrower principal axis, in crop sides


def template_problem(template: Template) -> str | None:
    """Why `template` cannot align a face, or None. Its five points must be finite, inside the crop, and
    span it in two directions: coincident points make the similarity transform divide by zero (every crop
    black, every face alike), collinear ones leave it undetermined across the line. insightface's and
    dlib's templates spread 0.11 to 0.15 crop sides across their narrower axis, far above MIN_SPREAD."""
    height, width = template.size
    if min(height, width) < 1:
        return f"crop size {height}x{width}"
    points = np.asarray(template.points, np.float64)
    if points.shape != (5, 2) or not np.isfinite(points).all():
        return "its five points are not finite numbers"
    outside = ~((points >= 0).all(1) & (points[:, 0] <= width) & (points[:, 1] <= height))
    if outside.any():
        return f"point {int(np.flatnonzero(outside)[0]) + 1} lies outside the {width}x{height} crop"
    spread = np.linalg.svd(points - points.mean(0), compute_uv=False) / np.sqrt(len(points))
    if spread[-1] < MIN_SPREAD * min(height, width):
        return (
            "its five points coincide"
            if spread[0] < MIN_SPREAD * min(height, width)
            else "its five points lie on one line"
        ) + f" (spread {spread[-1]:.2f} pixels)"
    return None


class OnnxBackbone(nn.Module):
    """The exported model at `path` (input N x 3 x h x w float32 RGB in [-1, 1]; no TEMPLATE_KEY: insightface's
    112x112 crop). Without weights of its own it takes input on any device, output on theirs; a fixed batch size
    is fed whole batches. Refused at load, by name: non-finite weights, output not N x D, `template_problem`."""

    def __init__(self, path: str):
        super().__init__()
        import onnx  # only the ONNX form needs them
        import onnxruntime as ort
        from onnx import numpy_helper

        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: ONNX model not found")
        providers = [
            p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in ort.get_available_providers()
        ]
        options = ort.SessionOptions()
        # torch's thread count (torchrun gives each of W ranks its share), not a pool of every core per process
        options.intra_op_num_threads = torch.get_num_threads()
        try:
            graph = onnx.load(path).graph
            self.session = ort.InferenceSession(path, sess_options=options, providers=providers)
        except Exception as exc:  # onnx and onnxruntime raise their own types for every bad file
            raise CheckpointError(f"{path}: not a readable ONNX model ({str(exc).splitlines()[0]})") from None
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.template = self._template(path, metadata.get(TEMPLATE_KEY))
        try:
            record = json.loads(metadata[THRESHOLD_KEY]) if THRESHOLD_KEY in metadata else None
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable {THRESHOLD_KEY} metadata ({exc})") from None
        self.threshold = saved_threshold(record, f"{path} metadata")
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or list(inputs[0].shape[1:]) != [3, *self.template.size]:
            raise CheckpointError(
                f"{path}: expected one input of shape N x 3 x {self.template.size[0]} x "
                f"{self.template.size[1]} (as scripts.export_onnx writes), got "
                f"{[(i.name, i.shape) for i in inputs]}"
            )
        if len(outputs[0].shape) != 2:
            raise CheckpointError(
                f"{path}: its output '{outputs[0].name}' has shape {outputs[0].shape}, not "
                f"N x D (one embedding per image); export the embedding, not a feature map"
            )
        weights = {w.name: numpy_helper.to_array(w) for w in graph.initializer}
        refuse_non_finite(
            {k: torch.from_numpy(w.copy()) for k, w in weights.items() if w.dtype.kind == "f"}, path
        )
        self.input_name = inputs[0].name
        batch = inputs[0].shape[0]
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.path = path

    @staticmethod
    def _template(path: str, recorded: str | None) -> Template:
        if recorded is None:
            return ARCFACE_112
        try:
            t = json.loads(recorded)
            template = Template(
                str(t["name"]),
                (int(t["size"][0]), int(t["size"][1])),
                np.asarray(t["points"], np.float64).reshape(5, 2),
            )
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(f"{path}: unreadable {TEMPLATE_KEY} metadata ({exc})") from None
        problem = template_problem(template)
        if problem:
            raise CheckpointError(
                f"{path}: {TEMPLATE_KEY} metadata names no usable crop ({problem}): {recorded}"
            )
        return template

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.detach().float().cpu().numpy()
        n = len(x)
        step = self.fixed_batch or max(n, 1)
        parts = []
        for start in range(0, n, step):
            chunk = x[start : start + step]
            if len(chunk) < step:  # a fixed batch size: pad the last chunk, keep its rows only
                chunk = np.concatenate([chunk, np.zeros((step - len(chunk), *chunk.shape[1:]), chunk.dtype)])
            parts.append(self.session.run(None, {self.input_name: chunk})[0][: min(step, n - start)])
        out = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
        if out.ndim != 2 or out.shape[0] != n:
            raise CheckpointError(
                f"{self.path}: output of shape {out.shape} for {n} images; expected {n} x D"
            )
        return torch.from_numpy(out).to(images.device)
