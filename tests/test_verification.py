"""Verification protocol, .bin loading (py3 and py2 pickles) and the flip test."""

import io
import pickle
import pickletools
import struct

import numpy as np
import pytest
import torch

from shardface.eval import verification
from shardface.eval.verification import VerificationDataError, embed, evaluate, load_bin, write_bin
from tests.tool_files import jpeg


def _pairs(n_pairs, bad_same):
    """Same pairs identical (distance 0), different pairs orthogonal (distance 2); the first
    `bad_same` same-pairs are orthogonal too, so exactly they are misclassified."""
    emb, issame = [], []
    for i in range(n_pairs):
        same = i % 2 == 0
        a = np.zeros(4)
        a[0] = 1
        b = a.copy() if same and i // 2 >= bad_same else np.eye(4)[1]
        emb += [a, b]
        issame.append(same)
    return np.array(emb), issame


def test_evaluate_gives_exact_accuracy_of_constructed_pairs():
    emb, issame = _pairs(100, 0)
    _, _, acc, val, _, far = evaluate(emb, issame)
    assert acc.mean() == 1.0 and val == 1.0 and far == 0.0
    emb, issame = _pairs(100, 6)
    _, _, acc, _, _, _ = evaluate(emb, issame)
    assert acc.mean() == pytest.approx(0.94)


def _write_py2_pickle(path, images, issame):
    """What python 2's pickle.dump((list_of_str, list_of_bool), f, protocol=2) writes."""
    out = bytearray(b"\x80\x02](")
    for data in images:
        out += b"T" + struct.pack("<I", len(data)) + data  # BINSTRING: a py2 str
    out += b"e](" + b"".join(b"\x88" if s else b"\x89" for s in issame) + b"e\x86."
    path.write_bytes(bytes(out))


@pytest.mark.parametrize("py2", [False, True])
def test_load_bin_reads_images_and_mirrors(tmp_path, py2):
    images = [jpeg((250, 10, 10)), jpeg((10, 250, 10)), jpeg((10, 10, 250)), jpeg((10, 10, 250), size=96)]
    path = tmp_path / "set.bin"
    if py2:
        _write_py2_pickle(path, images, [False, True])
        with pytest.raises(UnicodeDecodeError):
            pickle.load(open(path, "rb"))
    else:
        write_bin(str(path), images, [False, True])
    (data, flipped), issame = load_bin(str(path))
    assert issame == [False, True]
    assert data.shape == (4, 3, 112, 112) and data.dtype == torch.uint8
    assert data[0, 0].float().mean() > 200 and data[2, 2].float().mean() > 200  # resized image kept
    assert torch.equal(flipped, torch.flip(data, dims=[3]))


def test_bad_bin_files_are_named(tmp_path):
    odd = tmp_path / "odd.bin"
    write_bin(str(odd), [jpeg((0, 0, 0))] * 3, [True])
    with pytest.raises(VerificationDataError, match=r"odd\.bin: odd number of images"):
        load_bin(str(odd))
    mismatch = tmp_path / "mismatch.bin"
    write_bin(str(mismatch), [jpeg((0, 0, 0))] * 4, [True, False, True])
    with pytest.raises(VerificationDataError, match=r"mismatch\.bin: 4 images but 3 issame"):
        load_bin(str(mismatch))


class LeftHalfMean(torch.nn.Module):
    """An embedding that changes under mirroring: channel means of the left half."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3, bias=False)
        torch.nn.init.eye_(self.proj.weight)

    def forward(self, x):
        return self.proj(x[..., : x.shape[-1] // 2].mean(dim=(2, 3)))


def test_flip_test_sums_mirror_embeddings_and_is_batch_size_independent(tmp_path):
    rng = np.random.default_rng(0)
    images = []
    for _ in range(40):
        arr = rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)
        buf = io.BytesIO()
        from PIL import Image

        Image.fromarray(arr).save(buf, format="PNG")
        images.append(buf.getvalue())
    path = tmp_path / "v.bin"
    write_bin(str(path), images, [i % 2 == 0 for i in range(20)])
    data = load_bin(str(path))
    model = LeftHalfMean()
    a = verification.test(data, model, batch_size=7, nfolds=10)
    b = verification.test(data, model, batch_size=64, nfolds=10)
    fields = ("accuracy", "std", "accuracy_flip", "std_flip", "xnorm")
    assert [getattr(a, f) for f in fields] == pytest.approx([getattr(b, f) for f in fields])
    np.testing.assert_allclose(
        a.embeddings_flip, embed(torch.flip(data[0][0], dims=[3]), model, 64), rtol=1e-6
    )
    summed = a.embeddings + a.embeddings_flip
    summed /= np.linalg.norm(summed, axis=1, keepdims=True)
    assert a.accuracy_flip == pytest.approx(evaluate(summed, data[1])[2].mean())


class _RunsCode:
    """Unpickling this calls os.system: what a crafted .bin does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_crafted_bin_cannot_run_code(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.bin"
    path.write_bytes(pickle.dumps(([_RunsCode(marker)], [True])))
    with pytest.raises(
        VerificationDataError, match=r"evil\.bin: .*refusing to load global '(posix|os)\.system'"
    ):
        load_bin(str(path))
    assert not marker.exists()


@pytest.mark.parametrize(
    "content,message",
    [
        (7, "expected a pickled \\(bins, issame_list\\) pair, got int"),
        ({"bins": [], "issame": []}, "expected a pickled .* pair, got dict"),
        (([b"x", 3], [True]), "image 1 is a int"),
        (([b"x", b"y"], ["yes"]), "issame entry 0 is 'yes', not a bool"),
    ],
)
def test_wrong_bin_structures_are_named(tmp_path, content, message):
    path = tmp_path / "wrong.bin"
    path.write_bytes(pickle.dumps(content))
    with pytest.raises(VerificationDataError, match=r"wrong\.bin: " + message):
        load_bin(str(path))


def test_fewer_pairs_than_folds_is_named(tmp_path):
    path = tmp_path / "small.bin"
    write_bin(str(path), [jpeg((0, 0, 0))] * 8, [True, False, True, False])
    with pytest.raises(VerificationDataError, match=r"small\.bin: 4 pairs, fewer than the 10 folds"):
        load_bin(str(path), min_pairs=verification.NFOLDS)


# insightface's build_eval_pack.py (Python 3) pickles cv2.imencode's arrays (uint8, N x 1) with
# pickle.HIGHEST_PROTOCOL: protocol 5 names `_frombuffer` in numpy.core.numeric (numpy 1) or
# numpy._core.numeric (numpy 2). The bytes of both forms are made here from the installed numpy's
# pickle, frames removed (they are optional) so a global's name can be rewritten to the other's.
NUMERIC = {1: "numpy.core.numeric", 2: "numpy._core.numeric"}


def _frameless(data: bytes) -> bytes:
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    return b"".join(data[pos:end] for (op, _, pos), end in zip(ops, ends) if op.name != "FRAME")


def _renamed(data: bytes, old: str, new: str) -> bytes:
    """`data` with the SHORT_BINUNICODE string `old` (once) replaced by `new`."""
    a, b = old.encode(), new.encode()
    assert data.count(b"\x8c" + bytes([len(a)]) + a) == 1, old
    return data.replace(b"\x8c" + bytes([len(a)]) + a, b"\x8c" + bytes([len(b)]) + b)


def _protocol5_bin(images: list[bytes], issame: list[bool], numpy_major: int) -> bytes:
    """A .bin as build_eval_pack writes it under numpy `numpy_major`: arrays of the encoded bytes."""
    arrays = [np.frombuffer(b, np.uint8).copy().reshape(-1, 1) for b in images]  # cv2.imencode's shape
    data = _frameless(pickle.dumps((arrays, issame), protocol=5))
    installed = next(m for m, name in NUMERIC.items() if name.encode() in data)
    globals_named = [arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"]
    assert NUMERIC[installed] in globals_named and "_frombuffer" in globals_named
    return data if installed == numpy_major else _renamed(data, NUMERIC[installed], NUMERIC[numpy_major])


@pytest.mark.parametrize("numpy_major", [1, 2])
def test_bin_of_protocol5_numpy_arrays_from_build_eval_pack_loads_as_its_bytes(tmp_path, numpy_major):
    images = [jpeg((250, 10, 10)), jpeg((10, 250, 10)), jpeg((10, 10, 250)), jpeg((10, 10, 250), size=96)]
    path = tmp_path / "insightface.bin"
    path.write_bytes(_protocol5_bin(images, [False, True], numpy_major))
    assert NUMERIC[numpy_major].encode() in path.read_bytes()
    write_bin(str(tmp_path / "ours.bin"), images, [False, True])  # the same images as bytes
    (data, flipped), issame = load_bin(str(path))
    (want, _), _ = load_bin(str(tmp_path / "ours.bin"))
    assert (
        issame == [False, True]
        and torch.equal(data, want)
        and torch.equal(flipped, torch.flip(want, dims=[3]))
    )


@pytest.mark.parametrize(
    "damage,message",
    [
        (
            lambda d: _renamed(d, "_frombuffer", "frombuffer"),
            r"refusing to load global 'numpy\._core\.numeric\.frombuffer'",
        ),
        (
            lambda d: _renamed(_renamed(d, "numpy._core.numeric", "builtins"), "_frombuffer", "eval"),
            r"refusing to load global 'builtins\.eval'",
        ),
        (
            lambda d: _renamed(_renamed(d, "numpy._core.numeric", "numpy"), "_frombuffer", "load"),
            r"refusing to load global 'numpy\.load'",
        ),
        (lambda d: _renamed(d, "u1", "O8"), r"an array of dtype dtype\('O'\): only plain numeric arrays"),
        (lambda d: _renamed(d, "u1", "u2"), r"an array of shape \(6, 1\) and dtype uint16 in 6 bytes"),
    ],
)
def test_bin_with_any_other_global_or_array_form_is_still_refused(tmp_path, damage, message):
    """Only the two `_frombuffer` names are taken, and rebuilt from checked arguments: every other
    global (numpy's own loaders included) is refused, and so is an object array."""
    data = _protocol5_bin([b"\x00\x01\x02\x03\x04\x05"], [True], 2)
    path = tmp_path / "odd.bin"
    path.write_bytes(damage(data))
    with pytest.raises(
        VerificationDataError, match=r"odd\.bin: not a \(bins, issame_list\) pickle \(" + message
    ):
        load_bin(str(path))
