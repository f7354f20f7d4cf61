"""ONNX export parity (r18, mbf) and clear errors for checkpoints of another network."""

import os
import subprocess
import sys

import pytest
import torch

from shardface import backbones
from shardface.checkpoint.files import CheckpointError
from shardface.infer.weights import load_backbone


# r18 (11 s) in make test-all: mbf covers the same export path in make test
@pytest.mark.parametrize("network", [pytest.param("r18", marks=pytest.mark.slow), "mbf"])
def test_export_runs_onnxruntime_within_tolerance(tmp_path, network):
    torch.manual_seed(0)
    model = backbones.get_model(network)
    # insightface-style plain state dict, as published model.pt files are
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.export_onnx",
            str(tmp_path / "model.pt"),
            str(tmp_path / "m.onnx"),
            "--network",
            network,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "batch 1: max |onnx - torch|" in out.stdout and "batch 8:" in out.stdout
    import onnx

    graph = onnx.load(str(tmp_path / "m.onnx")).graph
    assert [i.name for i in graph.input] == ["data"] and len(graph.output) == 1
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param  # dynamic batch


def test_checkpoint_of_another_network_is_a_clear_error(tmp_path):
    torch.save(backbones.get_model("mbf").state_dict(), tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match=r"model\.pt is not a 'r18' checkpoint"):
        load_backbone(str(tmp_path / "model.pt"), "r18")


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    data = (tmp_path / "model.pt").read_bytes()
    (tmp_path / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.pt: corrupt or unreadable"):
        load_backbone(str(tmp_path / "model.pt"), "tiny")


def test_corrupt_config_json_beside_model_is_named_and_network_gets_around_it(tmp_path, caplog):
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text('{"network": "ti')  # torn by a crash mid-write
    with caplog.at_level("WARNING", logger="shardface"):
        with pytest.raises(CheckpointError, match="pass --network"):
            load_backbone(str(tmp_path / "model.pt"))
    assert f"{tmp_path / 'config.json'} is unreadable (JSONDecodeError" in caplog.text
    assert load_backbone(str(tmp_path / "model.pt"), "tiny") is not None


def test_config_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    from shardface.checkpoint.files import atomic_write_text
    from shardface.configs import get_config, save_config

    cfg = get_config("configs/demo.py", [])
    save_config(cfg, str(tmp_path), atomic_write_text)
    before = (tmp_path / "config.json").read_text()
    cfg.lr = 0.5

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)  # the new text is written, never put in place
    with pytest.raises(CheckpointError, match="config.json: cannot write"):
        save_config(cfg, str(tmp_path), atomic_write_text)
    monkeypatch.undo()
    assert (tmp_path / "config.json").read_text() == before


def test_export_replaces_an_existing_out_only_with_overwrite_but_refreshes_the_runs_own_model_onnx(
    tmp_path, capsys
):
    """README: outputs are replaced only with --overwrite, except the run's own model.onnx that
    an earlier export wrote. A photo, a text file or another model's .onnx at OUT is the user's."""
    from shardface.scripts.export_onnx import main as export_onnx

    torch.manual_seed(0)
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    model = str(tmp_path / "model.pt")
    photo = tmp_path / "photo.png"
    photo.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    other = tmp_path / "other.onnx"
    assert export_onnx([model, str(other), "--network", "tiny"]) == 0  # another model's export
    other_bytes = other.read_bytes()
    for out, before in ((photo, photo.read_bytes()), (other, other_bytes)):
        capsys.readouterr()
        assert export_onnx([model, str(out), "--network", "tiny"]) == 2
        assert "exists; pass --overwrite" in capsys.readouterr().err
        assert out.read_bytes() == before
    assert export_onnx([model, str(photo), "--network", "tiny", "--overwrite"]) == 0
    assert photo.read_bytes() != b"\x89PNG\r\n\x1a\n not really"
    # the run's own model.onnx (beside model.pt): written, then refreshed by the next export
    own = tmp_path / "model.onnx"
    assert export_onnx([model, "--network", "tiny"]) == 0 and own.is_file()
    assert export_onnx([model, "--network", "tiny"]) == 0
    assert export_onnx([model, str(own), "--network", "tiny"]) == 0  # named explicitly: the same file
    # ... but not a text file that sits in its place
    own.write_text("my notes\n")
    assert export_onnx([model, "--network", "tiny"]) == 2
    assert own.read_text() == "my notes\n"


ARC = [[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655], [70.7299, 92.2041]]


@pytest.mark.parametrize(
    "points,why",
    [
        ([[56.0, 70.0]] * 5, "its five points coincide"),
        ([[10.0 + 20 * i, 20.0 + 15 * i] for i in range(5)], "its five points lie on one line"),
        ([p[:] for p in ARC[:4]] + [[70.7, 192.2]], "point 5 lies outside the 112x112 crop"),
        ([[-1.0, 51.7]] + ARC[1:], "point 1 lies outside"),
    ],
)
def test_onnx_whose_template_cannot_align_a_face_is_refused_naming_file_and_key(tmp_path, points, why):
    """Five coincident points made every crop black and two people cosine 1.0000: such a file is
    refused at load, by file and metadata key, as a non-finite one is."""
    import json

    import onnx

    from shardface.infer.model import load_module
    from shardface.infer.onnx import TEMPLATE_KEY
    from shardface.scripts.export_onnx import export

    path = str(tmp_path / "m.onnx")
    export(backbones.get_model("tiny").eval(), path)
    load_module(path)  # as exported: fine
    proto = onnx.load(path)
    entry = next(e for e in proto.metadata_props if e.key == TEMPLATE_KEY)
    entry.value = json.dumps({"name": "odd", "size": [112, 112], "points": points})
    onnx.save(proto, path)
    with pytest.raises(
        CheckpointError, match=rf"m.onnx: {TEMPLATE_KEY} metadata names no usable crop \({why}"
    ) as e:
        load_module(path)
    assert "\n" not in str(e.value)
