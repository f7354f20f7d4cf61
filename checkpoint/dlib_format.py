"""A reader of dlib's serialization format, enough for its DNN files (the face descriptor of
face-recognition-models): the layers of a `loss_metric` network in input-to-output order, each
with its kind, geometry and learned tensors, as numpy arrays.

The format, as dlib's serialize.h and dnn/*.h write it:
- an integer is a control byte (bit 7: negative; low 4 bits: how many bytes follow) and that
  many little-endian magnitude bytes; a float is two integers, mantissa then exponent
  (value = mantissa * 2**exponent, exponents 32000.. mark inf and nan); a bool is the byte
  '0' or '1'; a string is its length (an integer) and its bytes;
- a tensor is version 2, four integers (samples, channels, rows, columns) and raw little-endian
  float32 values; an alias tensor (a view into a layer's `params`) is version 1 and its shape;
- layers nest: each wrapper writes its version and then the network below it, so a file holds
  every version from the output down to the input first, then the input layer, then each
  layer's own fields on the way back out. Tag and skip layers are version 1 and hold nothing else.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from shardface.checkpoint.files import CheckpointError

_INF, _NINF, _NAN = 32000, 32001, 32002


class DlibFormatError(CheckpointError):
    """A dlib model file that is truncated, damaged or not the network expected."""


@dataclass
class Layer:
    """One computational layer of a dlib network."""

    kind: str  # con, affine, relu, max_pool, avg_pool, add_prev, fc
    version: str  # the version string the file carries (con_4, fc_2...)
    offset: int  # where its fields start in the file
    attrs: dict = field(default_factory=dict)  # geometry: num_filters, nr, nc, stride, padding...
    tensors: dict = field(default_factory=dict)  # name -> float32 array in dlib's shape


@dataclass
class DlibNetwork:
    path: str
    loss: str
    input: dict  # kind, avg_red, avg_green, avg_blue, rows, cols
    layers: list  # Layer, input to output (tag and skip layers are not kept)


class _Reader:
    def __init__(self, data: bytes, path: str):
        self.data, self.path, self.pos = data, path, 0

    def fail(self, what: str, at: int | None = None) -> None:
        raise DlibFormatError(
            f"{self.path}: {what} at byte {self.pos if at is None else at} "
            f"of {len(self.data)} (not a dlib network file, or damaged)"
        )

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.data):
            self.fail(f"file ends inside {what}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def int(self, what: str = "an integer") -> int:
        at = self.pos
        ctrl = self.take(1, what)[0]
        size = ctrl & 0x0F
        if ctrl & 0x70 or size == 0 or size > 8:
            self.fail(f"bad control byte 0x{ctrl:02x} for {what}", at)
        value = int.from_bytes(self.take(size, what), "little")
        return -value if ctrl & 0x80 else value

    def float(self, what: str = "a float") -> float:
        mantissa, exponent = self.int(what), self.int(what)
        if exponent < _INF:
            return math.ldexp(mantissa, exponent)
        return {_INF: math.inf, _NINF: -math.inf}.get(exponent, math.nan)

    def bool(self, what: str = "a bool") -> bool:
        at = self.pos
        byte = self.take(1, what)
        if byte not in (b"0", b"1"):
            self.fail(f"bad bool byte {byte!r} for {what}", at)
        return byte == b"1"

    def string(self, what: str = "a string", length: int | None = None) -> str:
        length = self.int(what) if length is None else length
        if not 0 <= length <= 256:
            self.fail(f"implausible string length {length} for {what}")
        return self.take(length, what).decode("latin-1")

    def expect_version(self, wanted: int, what: str) -> None:
        at = self.pos
        version = self.int(what)
        if version != wanted:
            self.fail(f"{what} has version {version}, expected {wanted}", at)

    def tensor(self, what: str) -> np.ndarray:
        self.expect_version(2, what)
        shape = tuple(self.int(what) for _ in range(4))
        if any(n < 0 for n in shape):
            self.fail(f"negative shape {shape} for {what}")
        count = int(np.prod(shape))
        return np.frombuffer(self.take(4 * count, what), dtype="<f4").reshape(shape).astype(np.float32)

    def alias(self, what: str) -> tuple[int, ...]:
        self.expect_version(1, what)
        return tuple(self.int(what) for _ in range(4))


def _split(reader: _Reader, params: np.ndarray, views: dict[str, tuple], at: int, version: str) -> dict:
    """The alias tensors of a layer's flat `params`, in order."""
    flat, out, start = params.reshape(-1), {}, 0
    for name, shape in views.items():
        n = int(np.prod(shape))
        out[name] = flat[start : start + n].reshape(shape)
        start += n
    if start != flat.size:
        reader.fail(f"{version}: params hold {flat.size} values, its views {start}", at)
    return out


def _geometry(reader: _Reader, what: str) -> dict:
    nr, nc = reader.int(what), reader.int(what)
    stride_y, stride_x = reader.int(what), reader.int(what)
    pad_y, pad_x = reader.int(what), reader.int(what)
    return {"nr": nr, "nc": nc, "stride": (stride_y, stride_x), "padding": (pad_y, pad_x)}


def _read_layer(reader: _Reader) -> Layer:
    at = reader.pos
    version = reader.string("a layer's version")
    if version in ("con_4", "con_5", "con_6"):
        params = reader.tensor(f"{version} params")
        attrs = {"num_filters": reader.int(version)}
        attrs.update(_geometry(reader, version))
        views = {"weight": reader.alias(f"{version} filters"), "bias": reader.alias(f"{version} biases")}
        for _ in range(4):  # learning-rate and weight-decay multipliers: training only
            reader.float(version)
        attrs["use_bias"] = reader.bool(version) if version != "con_4" else True
        if version == "con_6" and reader.bool(version):
            reader.fail(f"{version} with a fused relu is not supported", at)
        return Layer("con", version, at, attrs, _split(reader, params, views, at, version))
    if version in ("affine_", "affine_2"):
        params = reader.tensor(f"{version} params")
        views = {"gamma": reader.alias(f"{version} gamma"), "beta": reader.alias(f"{version} beta")}
        attrs = {"mode": reader.int(version)}
        if version == "affine_2" and reader.bool(version):
            reader.fail(f"{version}: a disabled affine layer is not supported", at)
        return Layer("affine", version, at, attrs, _split(reader, params, views, at, version))
    if version in ("relu_", "relu_2"):
        if version == "relu_2" and reader.bool(version):
            reader.fail(f"{version}: a disabled relu is not supported", at)
        return Layer("relu", version, at)
    if version in ("max_pool_2", "avg_pool_2"):
        return Layer(version[:-2], version, at, _geometry(reader, version))
    if version == "add_prev_":
        return Layer("add_prev", version, at)
    if version in ("fc_2", "fc_3"):
        attrs = {"num_outputs": reader.int(version), "num_inputs": reader.int(version)}
        params = reader.tensor(f"{version} params")
        views = {"weight": reader.alias(f"{version} weights"), "bias": reader.alias(f"{version} biases")}
        attrs["bias_mode"] = reader.int(version)
        for _ in range(4):
            reader.float(version)
        if version == "fc_3":
            attrs["use_bias"] = reader.bool(version)
        if attrs["bias_mode"] == 1:  # FC_NO_BIAS: params hold the weights only
            views.pop("bias")
        return Layer("fc", version, at, attrs, _split(reader, params, views, at, version))
    reader.fail(f"unsupported layer '{version}'", at)
    raise AssertionError  # fail raised


def read_network(path: str) -> DlibNetwork:
    """The layers of a dlib `loss_metric` network file (dlib's face descriptor)."""
    if not os.path.isfile(path):
        raise DlibFormatError(f"{path}: dlib model file not found")
    with open(path, "rb") as f:
        data = f.read()
    r = _Reader(data, path)
    r.expect_version(1, "the loss layer")
    loss = r.string("the loss layer's version")
    if loss == "loss_metric_2":
        r.float("loss_metric margin"), r.float("loss_metric distance threshold")
    elif loss != "loss_metric_":
        r.fail(f"loss layer '{loss}' is not dlib's metric loss (a face descriptor network)")
    # the wrappers' versions, output first, until the input layer's name (a longer string)
    versions = []
    while True:
        at = r.pos
        value = r.int("a layer wrapper's version")
        if value not in (1, 2, 3):
            break
        versions.append((value, at))
    name = r.string("the input layer's version", length=value)
    if not versions or name not in ("input_rgb_image_sized", "input_rgb_image"):
        r.fail(f"input layer '{name}' is not an RGB image input", at)
    net_input = {
        "kind": name,
        "avg_red": r.float(name),
        "avg_green": r.float(name),
        "avg_blue": r.float(name),
    }
    if name == "input_rgb_image_sized":
        net_input["rows"], net_input["cols"] = r.int(name), r.int(name)
    innermost, at = versions.pop()
    if innermost not in (2, 3):
        r.fail(f"the first layer has wrapper version {innermost}, expected 2 or 3", at)
    layers = [_read_layer(r)]
    _skip_state(r, innermost, first=True)
    for version, at in reversed(versions):
        if version == 1:  # a tag or skip layer: nothing but its version
            continue
        if version != 2:
            r.fail(f"layer wrapper version {version}, expected 1 or 2", at)
        layers.append(_read_layer(r))
        _skip_state(r, version, first=False)
    if r.pos != len(data):
        r.fail(f"{len(data) - r.pos} bytes left after the network")
    return DlibNetwork(path, loss, net_input, layers)


def _skip_state(r: _Reader, version: int, first: bool) -> None:
    """A layer wrapper's training state after its layer: three flags and its gradient and
    output buffers (empty in a saved model, but read as written)."""
    for what in ("setup flag", "gradient flag", "output flag"):
        r.bool(what)
    for what in ("x_grad", "cached_output", "grad_final" if first else "params_grad"):
        r.tensor(what)
    if first and version == 3:
        r.int("sample expansion factor")


def state_dict_for(model: nn.Module, network: DlibNetwork) -> dict:
    """The state dict of `model` (a backbones.dlib_resnet.DlibResNet) holding `network`'s
    weights: its learned layers matched in order, kind and geometry, each a clear error naming
    the file and the layer's byte offset where they differ."""
    learned = [layer for layer in network.layers if layer.kind in ("con", "affine", "fc")]
    wanted = model.dlib_layers()
    if [k for k, _ in wanted] != [layer.kind for layer in learned]:
        raise DlibFormatError(
            f"{network.path}: its learned layers ({len(learned)}: "
            f"{[layer.kind for layer in learned][:4]}...) are not dlib's face descriptor "
            f"network's ({len(wanted)})"
        )
    names = {id(m): n for n, m in model.named_modules()}
    state = dict(model.state_dict())
    for (kind, module), layer in zip(wanted, learned):
        prefix, where = names[id(module)], f"{network.path}: {layer.version} at byte {layer.offset}"
        if kind == "con":
            geometry = (layer.attrs["nr"], layer.attrs["nc"], layer.attrs["stride"], layer.attrs["padding"])
            if geometry != (*module.kernel_size, module.stride, module.padding):
                raise DlibFormatError(
                    f"{where}: kernel, stride, padding {geometry} differ from the network's"
                )
            values = {"weight": layer.tensors["weight"], "bias": layer.tensors["bias"].reshape(-1)}
        elif kind == "affine":
            values = {"weight": layer.tensors["gamma"].reshape(-1), "bias": layer.tensors["beta"].reshape(-1)}
        else:  # dlib's fc computes x @ W with W (inputs x outputs); torch's Linear holds W^T
            values = {"weight": layer.tensors["weight"].reshape(layer.attrs["num_inputs"], -1).T}
        for name, value in values.items():
            key = f"{prefix}.{name}"
            if tuple(value.shape) != tuple(state[key].shape):
                raise DlibFormatError(
                    f"{where}: {name} has shape {tuple(value.shape)}, the network's "
                    f"{key} {tuple(state[key].shape)}"
                )
            state[key] = torch.from_numpy(np.ascontiguousarray(value))
    state["pixel_mean"] = torch.tensor([network.input[f"avg_{c}"] for c in ("red", "green", "blue")])
    return state
