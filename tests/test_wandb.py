"""using_wandb with the real wandb, offline: the config, loss, lr, samples/s and verification are logged."""

import glob
import json
import os
import re

import pytest

from shardface import train
from tests.train_runs import train_argv

wandb = pytest.importorskip("wandb")


def _records(path):
    """Protobuf payloads of a .wandb file: a 7-byte header, then LevelDB-log records (crc32c, uint16
    length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks, a block's tail under 7 bytes unused."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield parts
            parts = b""


def _read_offline_run(wandb_dir):
    """History rows, config and artifacts of the one offline run under `wandb_dir`."""
    from wandb.proto import wandb_internal_pb2

    files = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    rows, config, artifacts = [], {}, []
    for data in _records(files[0]):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
        elif kind in ("config", "run"):  # the config comes with the run record, later changes as config
            update = record.config.update if kind == "config" else record.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in update})
        elif kind == "artifact":
            artifacts.append(record.artifact)
    return rows, config, artifacts


@pytest.mark.slow  # wandb starts and finishes its service process: ~9 s over the run itself
def test_wandb_offline_run_logs_config_loss_lr_rate_and_verification(drawn_faces, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path / "run")
    args = train_argv(
        drawn_faces,
        out,
        "--using_wandb",
        "true",
        "--suffix_run_name",
        "trial",
        "--save_artifacts",
        "true",
        "--val_targets",
        "['drawn_faces_val']",
        "--verbose",
        "6",
        "--max_steps",
        "6",
        "--ema",
        "false",
        "--dali",
        "true",
    )
    assert train.main(args) == 0
    rows, config, artifacts = _read_offline_run(str(tmp_path))
    logged_loss = [r["train/loss"] for r in rows if "train/loss" in r]
    log = open(os.path.join(out, "training.log")).read()
    assert len(logged_loss) == 6
    assert log.count("ShardFace runs its own loader") == 1  # dali: said once
    assert [round(v, 4) for v in logged_loss] == [float(v) for v in re.findall(r"loss ([0-9.]+)", log)]
    assert [r["_step"] for r in rows if "train/lr" in r] == list(range(1, 7))
    assert all(r["train/samples_per_second"] > 0 for r in rows if "train/samples_per_second" in r)
    assert any("val/drawn_faces_val" in r and 0.0 <= r["val/drawn_faces_val"] <= 1.0 for r in rows)
    assert config["num_classes"] == 16 and config["suffix_run_name"] == "trial"
    assert len(artifacts) == 1 and artifacts[0].type == "model"
    assert artifacts[0].name.endswith("_GPU0_trial_Final")


def test_wandb_runs_on_rank_0_or_every_rank_with_wandb_log_all(monkeypatch):
    from shardface.configs import get_config
    from shardface.utils.wandb_logging import start_wandb, tee_writer

    started = []
    monkeypatch.setattr(wandb, "init", lambda **kw: started.append(kw) or "run")
    cfg = get_config(
        "configs/demo", ["--using_wandb", "true", "--suffix_run_name", "x", "--wandb_resume", "true"]
    )
    assert start_wandb(cfg, 1) is None and started == []
    assert start_wandb(cfg, 0) == "run"
    assert started[0]["name"].endswith("_GPU0_x") and started[0]["resume"] is True
    assert started[0]["config"]["num_classes"] == cfg.num_classes
    cfg.wandb_log_all = True
    assert start_wandb(cfg, 1) == "run" and started[1]["name"].endswith("_GPU1_x")
    assert start_wandb(get_config("configs/demo"), 0) is None and len(started) == 2
    assert tee_writer("tb", None) == "tb"
