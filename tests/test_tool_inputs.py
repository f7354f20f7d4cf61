"""What the command-line tools read: only regular files are opened (a FIFO never blocks them),
every packed image is decoded, a .bin image that does not decode is named with its pair, a
model with non-finite weights or embeddings is refused by every tool, ONNX models of the
wrong output shape are refused and fixed-batch ones work, and errors are one line, exit 2."""

import contextlib
import os
import re
import signal

import numpy as np
import pytest
import torch
from torch import nn

from shardface.checkpoint.files import CheckpointError
from shardface.dataset import DataError, build_dataset
from shardface.dataset.folders import image_files
from shardface.errors import ModelError
from shardface.eval.verification import VerificationDataError, load_bin, write_bin
from shardface.infer.model import as_model, load_module
from shardface.scripts.compare import main as compare
from shardface.scripts.embed import main as embed
from shardface.scripts.export_onnx import check_parity, export
from shardface.scripts.export_onnx import main as export_onnx
from shardface.scripts.make_bin import main as make_bin
from shardface.scripts.pack_rec import main as pack_rec
from shardface.scripts.verify import main as verify
from tests.tool_files import noise_jpeg, photos, tiny_model, truncated_jpeg


@contextlib.contextmanager
def _no_hang(seconds: int = 20):
    """A blocked open (a FIFO) fails the test instead of hanging it."""

    def expire(*_):
        raise TimeoutError(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _error(capsys) -> str:
    """The one error line (after any progress output on stderr), checked to be the only one."""
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("error: ") == 1 and "Traceback" not in err, err
    return "error: " + err.split("error: ")[1]


@pytest.mark.parametrize(
    "tool", ["pack_rec", "pack_rec_list", "make_bin", "embed", "embed_file", "compare", "train_folder"]
)
def test_a_fifo_named_like_an_image_is_named_and_never_opened(tmp_path, capsys, tool):
    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    fifo = os.path.join(faces, "id1", "x.jpg")
    os.mkfifo(fifo)
    good = os.path.join(faces, "id0", "0.jpg")
    with _no_hang():
        if tool == "train_folder":
            with pytest.raises(DataError, match=re.escape(fifo) + ": not a regular file"):
                build_dataset(faces, 3)
            return
        if tool == "pack_rec_list":
            (tmp_path / "list.txt").write_text("faces/id0/0.jpg\t0\nfaces/id1/x.jpg\t1\n")
        model = tiny_model(tmp_path / "m")
        argv = {
            "pack_rec": lambda: pack_rec([faces, str(tmp_path / "rec")]),
            "pack_rec_list": lambda: pack_rec([str(tmp_path / "list.txt"), str(tmp_path / "rec")]),
            "make_bin": lambda: make_bin([faces, str(tmp_path / "v.bin"), "--pairs", "10"]),
            "embed": lambda: embed([model, faces, "--out", str(tmp_path / "e.npy")]),
            "embed_file": lambda: embed([model, fifo, "--out", str(tmp_path / "e.npy")]),
            "compare": lambda: compare([model, good, fifo]),
        }[tool]
        assert argv() == 2
    assert f"{fifo}: not a regular file" in _error(capsys)


def _bin(path, bad_index: int | None = None) -> str:
    images = [noise_jpeg(i) for i in range(20)]
    if bad_index is not None:
        images[bad_index] = truncated_jpeg()
    write_bin(str(path), images, [i % 2 == 0 for i in range(10)])
    return str(path)


def test_non_finite_weights_are_refused_by_every_tool_naming_the_weight(tmp_path, capsys):
    pt = tiny_model(tmp_path / "m", nan_key="body.0.1.weight")
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    a, b = sorted(image_files([faces]))
    val = _bin(tmp_path / "v.bin")
    runs = [
        lambda: export_onnx([pt, str(tmp_path / "m.onnx")]),
        lambda: embed([pt, faces, "--out", str(tmp_path / "e.npy")]),
        lambda: compare([pt, a, b, "--threshold", "0.3"]),
        lambda: verify([pt, "--bin", val]),
    ]
    for run in runs:
        assert run() == 2
        assert f"{pt}: weight 'body.0.1.weight' has 1 non-finite (NaN or inf) values" in _error(capsys)
    assert sorted(os.listdir(tmp_path)) == ["faces", "m", "v.bin"]


def test_onnx_with_non_finite_weights_is_refused(tmp_path):
    import onnx
    from onnx import numpy_helper

    path = str(tmp_path / "m.onnx")
    export(load_module(tiny_model(tmp_path)), path)
    graph = onnx.load(path)
    init = next(i for i in graph.graph.initializer if numpy_helper.to_array(i).dtype == np.float32)
    w = numpy_helper.to_array(init).copy()
    w.reshape(-1)[0] = np.inf
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(graph, path)
    with pytest.raises(CheckpointError, match=rf"m.onnx: weight '{re.escape(init.name)}' has 1 non-finite"):
        load_module(path)


class NanOutput(nn.Module):
    """Finite weights, NaN embeddings (the log of a negative number)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.log(x.flatten(1)[:, :8] * self.scale - 2.0)


def test_export_parity_check_fails_on_nan_outputs(tmp_path):
    path = str(tmp_path / "nan.onnx")
    export(NanOutput(), path)
    with pytest.raises(CheckpointError, match=r"nan.onnx: torch's output is not finite"):
        check_parity(NanOutput(), path)


def test_a_folder_given_where_a_bin_is_expected_is_one_line_naming_the_option(tmp_path, capsys):
    model = tiny_model(tmp_path)
    folder = tmp_path / "a_folder"
    folder.mkdir()
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    a, b = sorted(image_files([faces]))
    assert verify([model, "--bin", str(folder)]) == 2
    assert _error(capsys).startswith(f"error: --bin {folder}: a folder; expected a verification .bin file")
    assert compare([model, a, b, "--threshold-from", str(folder)]) == 2
    assert _error(capsys).startswith(
        f"error: --threshold-from {folder}: a folder; expected a verification .bin"
    )


def test_a_pickled_module_in_place_of_weights_is_refused_in_one_plain_line_and_never_run(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.save(nn.Linear(4, 4), path)  # the module itself: torch.save(model)
    faces = photos(tmp_path / "faces", ids=1, per_id=1)
    assert embed([str(path), faces, "--out", str(tmp_path / "out.npy"), "--network", "tiny"]) == 2
    said = _error(capsys)
    assert said.startswith(
        f"error: {path}: a pickled Python object (torch.nn.modules.linear.Linear), not weights"
    )
    assert "torch.save(model.state_dict(), PATH)" in said
    assert "weights_only=False" not in said and "\x1b" not in said


def test_embeddings_that_are_not_finite_are_refused_naming_the_model(tmp_path, capsys):
    path = str(tmp_path / "nan.onnx")
    export(NanOutput(), path)
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    a, b = sorted(image_files([faces]))
    assert compare([path, a, b, "--threshold", "0.3"]) == 2
    assert f"{path}: 2 of 2 embeddings are not finite" in _error(capsys)
    with pytest.raises(ModelError, match="embeddings are not finite"):
        as_model(NanOutput()).embed([a, b], align=False)


def test_embed_refuses_a_file_name_with_a_line_break_writing_nothing(tmp_path, capsys):
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    os.rename(os.path.join(faces, "id0", "0.jpg"), os.path.join(faces, "id0", "a\nb.jpg"))
    assert embed([tiny_model(tmp_path / "m"), faces, "--out", str(tmp_path / "e.npy")]) == 2
    assert "a\\nb.jpg': a file name with a line break cannot be listed" in _error(capsys)
    assert sorted(os.listdir(tmp_path)) == ["faces", "m"]


class FeatureMap(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)

    def forward(self, x):
        return self.conv(x)


def test_onnx_whose_output_is_a_feature_map_is_refused_naming_the_shape(tmp_path):
    path = str(tmp_path / "fmap.onnx")
    export(FeatureMap(), path)
    with pytest.raises(
        CheckpointError,
        match=r"fmap.onnx: its output 'embedding' has shape \['batch', 4, 56, 56\], "
        r"not N x D",
    ):
        load_module(path)


def test_onnx_with_a_fixed_batch_of_one_embeds_as_the_dynamic_one(tmp_path):
    model = load_module(tiny_model(tmp_path))
    dynamic, fixed = str(tmp_path / "dynamic.onnx"), str(tmp_path / "fixed.onnx")
    export(model, dynamic)
    torch.onnx.export(
        model.cpu(),
        torch.zeros(1, 3, 112, 112),
        fixed,
        input_names=["data"],
        output_names=["embedding"],
        opset_version=17,
        dynamo=False,
    )
    files = image_files([photos(tmp_path / "faces", ids=2, per_id=3)])
    a = as_model(load_module(dynamic)).embed(files, align=False, batch_size=4)
    b = as_model(load_module(fixed)).embed(files, align=False, batch_size=4)
    assert a.shape == (6, 64) and np.abs(a - b).max() < 1e-5


def test_truncated_jpeg_stops_pack_rec_and_make_bin_naming_it_and_keeps_the_old_output(tmp_path, capsys):
    faces = photos(tmp_path / "faces", ids=3, per_id=4)
    out = str(tmp_path / "rec")
    assert pack_rec([faces, out]) == 0
    val = str(tmp_path / "v.bin")
    assert make_bin([faces, val, "--pairs", "10"]) == 0
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}, open(val, "rb").read()
    bad = os.path.join(faces, "id2", "3.jpg")
    open(bad, "wb").write(truncated_jpeg())
    capsys.readouterr()
    assert pack_rec([faces, out, "--overwrite"]) == 2
    assert f"{bad}: cannot decode image" in _error(capsys)
    assert make_bin([faces, val, "--overwrite", "--pairs", "24"]) == 2  # every image is in some pair
    assert f"{bad}: cannot decode image" in _error(capsys)
    assert (
        {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)},
        open(val, "rb").read(),
    ) == before


def test_truncated_image_in_a_bin_is_named_with_its_pair_by_every_reader(tmp_path, capsys):
    val = _bin(tmp_path / "v.bin", bad_index=5)
    with pytest.raises(VerificationDataError, match=r"v.bin: image 5 \(pair 2\) cannot be decoded"):
        load_bin(val)
    pt = tiny_model(tmp_path / "m")
    faces = photos(tmp_path / "faces", ids=1, per_id=2)
    a, b = sorted(image_files([faces]))
    assert verify([pt, "--bin", val]) == 2
    assert f"{val}: image 5 (pair 2) cannot be decoded" in _error(capsys)
    assert compare([pt, a, b, "--threshold-from", val]) == 2
    assert f"{val}: image 5 (pair 2) cannot be decoded" in _error(capsys)


def test_embed_compare_and_make_bin_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    pt = tiny_model(tmp_path / "m")
    missing = str(tmp_path / "nowhere.jpg")
    assert embed([pt, missing, "--out", str(tmp_path / "e.npy")]) == 2
    assert _error(capsys) == f"error: {missing}: no such image file or folder\n"
    assert compare([pt, missing, missing]) == 2
    assert _error(capsys) == f"error: {missing}: image file not found\n"
    assert make_bin([str(tmp_path), str(tmp_path / "v.bin"), "--pairs", "4"]) == 2
    assert _error(capsys) == "error: --pairs 4: verification needs at least 10 pairs (its folds)\n"


def test_a_torchvision_of_another_build_is_one_line_at_start(tmp_path):
    """torchvision built for another torch fails at import ("operator torchvision::nms does not
    exist"), once a 60-line torchrun traceback: here a stand-in package that fails as it does."""
    import subprocess
    import sys

    fake = tmp_path / "site" / "torchvision"
    (fake / "io").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "io" / "__init__.py").write_text(
        'raise RuntimeError("operator torchvision::nms does not exist")\n'
    )
    faces = photos(tmp_path / "faces", ids=2, per_id=2)  # JPEGs: packing decodes them with torchvision
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), root])}
    done = subprocess.run(
        [sys.executable, "-m", "scripts.pack_rec", faces, str(tmp_path / "rec")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert re.match(
        r"error: torch \S+ and torchvision \S+ are different builds \(operator torchvision::nms", line
    )
    assert line.endswith("install a matching pair (make setup)")
    assert not os.path.exists(tmp_path / "rec")
