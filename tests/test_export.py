"""ONNX export parity (r18, mbf) and clear errors for checkpoints of another network."""
import subprocess
import sys

import pytest
import torch

import backbones
from eval.weights import load_backbone
from utils.checkpoint import CheckpointError


@pytest.mark.parametrize("network", ["r18", "mbf"])
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
