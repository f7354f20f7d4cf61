"""ONNX export parity (r18, mbf) and clear errors for checkpoints of another network."""
import os
import subprocess
import sys

import pytest
import torch

import backbones
from checkpoint.files import CheckpointError
from infer.weights import load_backbone


# r18 (11 s) in make test-all: mbf covers the same export path in make test
@pytest.mark.parametrize("network", [pytest.param("r18", marks=pytest.mark.slow), "mbf"])
def test_export_runs_onnxruntime_within_tolerance(tmp_path, network):
    torch.manual_seed(0)
    model = backbones.get_model(network)
    # insightface-style plain state dict, as published model.pt files are
    torch.save(model.state_dict(), tmp_path / "model.pt")
    out = subprocess.run([sys.executable, "-m", "scripts.export_onnx", str(tmp_path / "model.pt"),
                          str(tmp_path / "m.onnx"), "--network", network],
                         capture_output=True, text=True, timeout=300)
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
    from checkpoint.files import atomic_write_text
    from configs import get_config, save_config
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
