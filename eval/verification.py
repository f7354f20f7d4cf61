"""1:1 verification on LFW-format `.bin` sets with the protocol of insightface arcface_torch.

Embeddings of pair members are interleaved (2i, 2i+1); distance is the squared L2 distance
of L2-normalised embeddings; accuracy is 10-fold cross-validated without shuffling (the best
threshold in [0, 4) step 0.01 on 9 folds, accuracy on the 10th); VAL is the true accept
rate at FAR = 1e-3 (thresholds step 0.001, as arcface_torch; the largest threshold whose
training-fold FAR is within 1e-3).
"""

from __future__ import annotations

import io
import os
import pickle
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from shardface.dataset.errors import DataError
from shardface.dataset.images import to_rgb
from shardface.faces.align import ARCFACE_112
from shardface.infer.embed import embed, l2_normalize
from shardface.infer.model import as_model
from shardface.infer.thresholds import Threshold, fitted_threshold
from shardface.utils.atomic import publishing


class VerificationDataError(DataError):
    """A .bin verification set that is missing, malformed or inconsistent."""


NFOLDS = 10  # the protocol's cross-validation folds


def _array_from_bytes(buffer, dtype, shape, order):
    """The array a protocol-5 pickle of a numpy array names as `numpy[._]core.numeric._frombuffer`
    (insightface's build_eval_pack pickles cv2.imencode's arrays with pickle.HIGHEST_PROTOCOL):
    its bytes read as `dtype` and laid out as `shape` in `order`. Rebuilt here, not by numpy's
    function, from checked arguments only: in-band bytes, a plain numeric dtype (no Python
    objects, no fields), whole dimensions that the bytes fill exactly, and order C or F."""
    if not isinstance(buffer, (bytes, bytearray)):
        raise pickle.UnpicklingError(f"an array's data is a {type(buffer).__name__}, not bytes")
    if (
        not isinstance(dtype, np.dtype)
        or dtype.hasobject
        or dtype.kind not in "biufc"
        or dtype.fields is not None
        or dtype.subdtype is not None
    ):  # the kind too: a pickled dtype's state can clear its object flag
        raise pickle.UnpicklingError(f"an array of dtype {dtype!r}: only plain numeric arrays are read")
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise pickle.UnpicklingError(f"an array of shape {shape!r}")
    if order not in ("C", "F"):
        raise pickle.UnpicklingError(f"an array of order {order!r}")
    if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(buffer):
        raise pickle.UnpicklingError(f"an array of shape {shape} and dtype {dtype} in {len(buffer)} bytes")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


class _BinUnpickler(pickle.Unpickler):
    """Unpickles only what a .bin holds (lists, tuples, bytes, bools, numpy arrays): any
    other global a crafted file names, the way to run code, is refused. Arrays come in two
    forms: protocol 2-4's `_reconstruct` with its state, and protocol 5's `_frombuffer` (numpy 1
    names it under numpy.core, numpy 2 under numpy._core), which `_array_from_bytes` rebuilds."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),
    }
    REBUILT = {
        ("numpy.core.numeric", "_frombuffer"): _array_from_bytes,
        ("numpy._core.numeric", "_frombuffer"): _array_from_bytes,
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.REBUILT:
            return self.REBUILT[module, name]
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global '{module}.{name}'")
        return super().find_class(module, name)


def _unpickle_bin(path: str):
    with open(path, "rb") as f:
        try:
            return _BinUnpickler(f).load()
        except UnicodeDecodeError:  # written by python 2
            f.seek(0)
            return _BinUnpickler(f, encoding="bytes").load()


def load_bin(path: str, image_size=(112, 112), min_pairs: int = 0, flag: str | None = None):
    """Returns ([images N x 3 x H x W uint8, their mirror images], issame_list). Loading
    executes nothing from the file; a wrong structure, or fewer than `min_pairs` pairs (pass
    NFOLDS before evaluating), is a VerificationDataError naming the file (and `flag`, the option
    that gave it)."""
    if os.path.isdir(path):
        raise VerificationDataError(
            f"{flag + ' ' if flag else ''}{path}: a folder; expected a verification .bin file (a pickled "
            "(bins, issame_list), as make_bin writes)"
        )
    try:
        data = _unpickle_bin(path)
    except FileNotFoundError:
        raise VerificationDataError(f"{path}: verification file not found") from None
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError, IndexError) as exc:
        raise VerificationDataError(f"{path}: not a (bins, issame_list) pickle ({exc})") from None
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise VerificationDataError(
            f"{path}: expected a pickled (bins, issame_list) pair, got {type(data).__name__}"
        )
    bins, issame = data
    if not isinstance(bins, (list, tuple, np.ndarray)) or not isinstance(issame, (list, tuple, np.ndarray)):
        raise VerificationDataError(
            f"{path}: expected (list of encoded images, list of bools), got "
            f"({type(bins).__name__}, {type(issame).__name__})"
        )
    bad = next((i for i, b in enumerate(bins) if not isinstance(b, (bytes, bytearray, np.ndarray))), None)
    if bad is not None:
        raise VerificationDataError(
            f"{path}: image {bad} is a {type(bins[bad]).__name__}, not encoded image bytes"
        )
    bad = next((i for i, v in enumerate(issame) if not isinstance(v, (bool, np.bool_))), None)
    if bad is not None:
        raise VerificationDataError(f"{path}: issame entry {bad} is {issame[bad]!r}, not a bool")
    if len(bins) % 2:
        raise VerificationDataError(f"{path}: odd number of images ({len(bins)}); pairs need an even count")
    if len(bins) != 2 * len(issame):
        raise VerificationDataError(
            f"{path}: {len(bins)} images but {len(issame)} issame entries (expected {len(bins) // 2})"
        )
    if len(issame) < min_pairs:
        raise VerificationDataError(
            f"{path}: {len(issame)} pairs, fewer than the {min_pairs} folds of the protocol"
        )
    h, w = image_size
    images = torch.empty((len(bins), 3, h, w), dtype=torch.uint8)
    for i, data in enumerate(bins):
        try:  # Pillow decodes lazily: the pixels are read here, inside the error handling
            img = to_rgb(
                Image.open(
                    io.BytesIO(
                        np.asarray(data, dtype=np.uint8).tobytes()
                        if isinstance(data, np.ndarray)
                        else bytes(data)
                    )
                )
            )
            if img.size != (w, h):
                img = img.resize((w, h), Image.BILINEAR)
            pixels = np.asarray(img).copy()
        except Exception as exc:
            raise VerificationDataError(
                f"{path}: image {i} (pair {i // 2}) cannot be decoded ({exc})"
            ) from None
        images[i] = torch.from_numpy(pixels).permute(2, 0, 1)
    return [images, torch.flip(images, dims=[3])], [bool(s) for s in issame]


def write_bin(path: str, encoded_images: list[bytes], issame: list[bool]) -> None:
    """Published atomically (utils.atomic): `path` holds its earlier file or the whole new one."""
    with publishing(path) as tmp, open(tmp, "wb") as f:
        pickle.dump((encoded_images, issame), f, protocol=pickle.HIGHEST_PROTOCOL)


def _accuracy(threshold, dist, actual):
    predict = dist < threshold
    tp = np.sum(predict & actual)
    fp = np.sum(predict & ~actual)
    tn = np.sum(~predict & ~actual)
    fn = np.sum(~predict & actual)
    tpr = 0.0 if tp + fn == 0 else tp / (tp + fn)
    fpr = 0.0 if fp + tn == 0 else fp / (fp + tn)
    return tpr, fpr, (tp + tn) / dist.size


def _val_far(threshold, dist, actual):
    accept = dist < threshold
    n_same, n_diff = np.sum(actual), np.sum(~actual)
    val = np.sum(accept & actual) / n_same if n_same else 0.0
    far = np.sum(accept & ~actual) / n_diff if n_diff else 0.0
    return val, far


def _folds(nrof_folds: int):
    """insightface's 10-fold split: consecutive pairs, not shuffled. sklearn is imported here, not
    with this module: it adds a second and a half to the start of every tool and training rank."""
    from sklearn.model_selection import KFold

    return KFold(n_splits=nrof_folds, shuffle=False)


def calculate_roc(thresholds, dist, actual, nrof_folds=10):
    folds = _folds(nrof_folds)
    tprs = np.zeros((nrof_folds, len(thresholds)))
    fprs = np.zeros((nrof_folds, len(thresholds)))
    accuracy = np.zeros(nrof_folds)
    for k, (train, test) in enumerate(folds.split(np.arange(len(actual)))):
        train_acc = [_accuracy(t, dist[train], actual[train])[2] for t in thresholds]
        best = int(np.argmax(train_acc))
        for i, t in enumerate(thresholds):
            tprs[k, i], fprs[k, i], _ = _accuracy(t, dist[test], actual[test])
        accuracy[k] = _accuracy(thresholds[best], dist[test], actual[test])[2]
    return tprs.mean(0), fprs.mean(0), accuracy


def calculate_val(thresholds, dist, actual, far_target=1e-3, nrof_folds=10):
    folds = _folds(nrof_folds)
    val, far = np.zeros(nrof_folds), np.zeros(nrof_folds)
    for k, (train, test) in enumerate(folds.split(np.arange(len(actual)))):
        far_train = np.array([_val_far(t, dist[train], actual[train])[1] for t in thresholds])
        # the largest threshold whose training FAR stays within the target (arcface_torch
        # interpolates between grid points instead; that can overshoot on tied distances)
        within = thresholds[far_train <= far_target]
        threshold = float(within.max()) if within.size else 0.0
        val[k], far[k] = _val_far(threshold, dist[test], actual[test])
    return val.mean(), val.std(), far.mean()


def evaluate(embeddings, actual_issame, nrof_folds: int = 10):
    """-> (tpr, fpr, accuracy per fold, val, val_std, far) for interleaved pair embeddings."""
    embeddings = np.asarray(embeddings, dtype=np.float64)
    actual = np.asarray(actual_issame, dtype=bool)
    if embeddings.shape[0] != 2 * actual.size:
        raise ValueError(f"{embeddings.shape[0]} embeddings for {actual.size} pairs")
    dist = np.sum(np.square(embeddings[0::2] - embeddings[1::2]), 1)
    tpr, fpr, accuracy = calculate_roc(np.arange(0, 4, 0.01), dist, actual, nrof_folds)
    val, val_std, far = calculate_val(np.arange(0, 4, 0.001), dist, actual, 1e-3, nrof_folds)
    return tpr, fpr, accuracy, val, val_std, far


@dataclass(frozen=True)
class VerificationResult:
    accuracy: float  # 10-fold accuracy with the images alone
    std: float
    accuracy_flip: float  # with each image's mirror embedding added before L2 normalisation
    std_flip: float
    xnorm: float  # mean L2 norm of the raw embeddings
    embeddings: np.ndarray  # N x D of the images
    embeddings_flip: np.ndarray  # N x D of their mirror images


def test(data_set, backbone: torch.nn.Module, batch_size: int, nfolds: int = NFOLDS) -> VerificationResult:
    """arcface_torch's verification test of `data_set` (as `load_bin` returns it)."""
    (images, mirrored), issame = data_set
    emb, emb_flip = embed(images, backbone, batch_size), embed(mirrored, backbone, batch_size)
    xnorm = float(np.mean([np.linalg.norm(e, axis=1).mean() for e in (emb, emb_flip)]))
    acc = evaluate(l2_normalize(emb), issame, nfolds)[2]
    acc_flip = evaluate(l2_normalize(emb + emb_flip), issame, nfolds)[2]
    return VerificationResult(
        float(np.mean(acc)),
        float(np.std(acc)),
        float(np.mean(acc_flip)),
        float(np.std(acc_flip)),
        xnorm,
        emb,
        emb_flip,
    )


def bin_path(val_dir: str, name: str) -> str:
    return os.path.join(val_dir, name if name.endswith(".bin") else f"{name}.bin")


def fit_threshold(model, path: str, *, batch_size: int = 64, flag: str | None = None) -> Threshold:
    """The `Threshold` that best separates the pairs of the verification .bin at `path` under
    `model` (`best_threshold`), its source naming the file and its best-threshold accuracy (fitted
    to those pairs: an upper bound, not a measure); a bad file is a VerificationDataError naming it
    (and `flag`)."""
    pairs = load_bin(path, flag=flag)
    return fitted_threshold(*best_threshold(pairs, model, batch_size), path, len(pairs[1]))


def best_threshold(data_set, model, batch_size: int = 64, flip: bool = True) -> tuple[float, float]:
    """(cosine threshold, accuracy): the threshold that best separates a verification set's
    pairs (as `load_bin` returns it: insightface 112x112 crops, re-framed onto the template of
    `model`, an infer Model or a bare 112x112 module), with flip-fused embeddings unless
    flip=False; `cos >= threshold` is "same"."""
    (images, _), issame = data_set
    emb = (
        as_model(model)
        .embed_crops(images, made_for=ARCFACE_112, flip=flip, batch_size=batch_size)
        .astype(np.float64)
    )
    cos = np.sum(emb[0::2] * emb[1::2], axis=1)
    same = np.asarray(issame, dtype=bool)
    candidates = np.unique(cos)
    accuracy = [np.mean((cos >= t) == same) for t in candidates]
    best = int(np.argmax(accuracy))
    return float(candidates[best]), float(accuracy[best])
