"""A checkpoint whose files hold something else than ShardFace writes is one error naming the file
(and the missing entry), never a traceback; a run folder whose checkpoints were deleted names the
model.pt it still holds (issue #54, items 24 and 30)."""

import json
import os

import pytest
import torch

from shardface.backbones import get_model
from shardface.checkpoint.files import CheckpointError, load_dict
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.checkpoint.load import read_backbone_weights
from shardface.infer.model import load_model


def _checkpoint(folder, meta=None, ema=None) -> str:
    """A checkpoint directory of the tiny network: meta.pt, backbone.pt and, with `ema`, ema.pt."""
    os.makedirs(folder)
    torch.manual_seed(0)
    weights = get_model("tiny", num_features=64).state_dict()
    torch.save(
        meta if meta is not None else {"step": 4, "config": {"network": "tiny", "embedding_size": 64}},
        os.path.join(folder, "meta.pt"),
    )
    torch.save(weights, os.path.join(folder, "backbone.pt"))
    if ema is not None:
        torch.save(ema, os.path.join(folder, "ema.pt"))
    return str(folder)


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and isinstance(exc_info.value, CheckpointError)
    return message


@pytest.mark.parametrize("meta", [[1, 2, 3], "a string", torch.zeros(3)], ids=["list", "str", "tensor"])
def test_a_meta_pt_that_is_not_a_dict_is_one_error_naming_it(tmp_path, meta):
    ckpt = _checkpoint(tmp_path / "checkpoint-00000004", meta=meta)
    meta_pt = os.path.join(ckpt, "meta.pt")
    for read in (lambda: read_backbone_weights(ckpt), lambda: load_model(ckpt, "tiny")):
        with pytest.raises(CheckpointError) as exc:
            read()
        message = _one_line(exc)
        assert message.startswith(
            f"{meta_pt}: holds a {type(meta).__name__}, not the dict a checkpoint file holds"
        )


@pytest.mark.parametrize(
    "ema,said",
    [
        ({"updates": 3}, "no 'state' entry in it"),
        ([1, 2], "holds a list, not the dict"),
        ({"state": [1, 2], "updates": 3}, "its 'state' is a list, not a state dict"),
    ],
)
def test_an_ema_pt_without_its_state_is_one_error_naming_it(tmp_path, ema, said):
    ckpt = _checkpoint(tmp_path / "checkpoint-00000004", ema=ema)
    with pytest.raises(CheckpointError) as exc:
        read_backbone_weights(ckpt)
    assert _one_line(exc).startswith(f"{os.path.join(ckpt, 'ema.pt')}: ") and said in str(exc.value)
    weights, _ = read_backbone_weights(ckpt, ema=False)  # the raw weights still read
    assert set(weights) == set(get_model("tiny", num_features=64).state_dict())


def test_load_dict_names_every_missing_entry(tmp_path):
    path = str(tmp_path / "x.pt")
    torch.save({"step": 1}, path)
    assert load_dict(path, "step") == {"step": 1}
    with pytest.raises(CheckpointError, match=r"x\.pt: no 'epoch', 'world_size' entry in it"):
        load_dict(path, "step", "epoch", "world_size")


def test_a_run_whose_checkpoints_were_deleted_names_its_model_pt(tmp_path):
    run = tmp_path / "run"
    os.makedirs(run)
    torch.save(get_model("tiny", num_features=64).state_dict(), run / "model.pt")
    json.dump({"network": "tiny", "embedding_size": 64}, open(run / "config.json", "w"))
    for read in (lambda: resolve_checkpoint(str(run)), lambda: read_backbone_weights(str(run))):
        with pytest.raises(CheckpointError) as exc:
            read()
        assert _one_line(exc).endswith(
            f"; its exported model.pt is there: pass {run / 'model.pt'} for its weights"
        )
    assert load_model(str(run / "model.pt")).name == str(run / "model.pt")  # and that loads
