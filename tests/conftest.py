"""Shared fixtures, found by pytest. It is never imported: helpers live in modules of their own
(tests/train_runs.py, tests/tool_files.py, ...; tests/test_test_modules.py holds this). Tests
marked `gpu` need CUDA: without it they are skipped (so `make test` needs no GPU); `make
test-gpu` selects only them."""

from __future__ import annotations

import pytest
import torch

from shardface.scripts.make_drawn_faces import main as make_drawn_faces


@pytest.fixture(scope="session")
def drawn_faces(tmp_path_factory) -> str:
    """A tiny drawn-faces RecordIO set: 16 identities x 8 images, and a verification .bin."""
    root = str(tmp_path_factory.mktemp("data") / "drawn_faces")
    make_drawn_faces(
        [
            "--output",
            root,
            "--num-ids",
            "16",
            "--per-id",
            "8",
            "--val-ids",
            "6",
            "--val-per-id",
            "4",
            "--val-pairs",
            "40",
            "--workers",
            "1",
        ]
    )
    return root


@pytest.fixture(scope="session")
def teacher_pt(tmp_path_factory) -> str:
    """A distillation teacher: a 64-D tiny network's model.pt (the demo student is 128-D, so the
    cosine loss trains a projection)."""
    from shardface.backbones import get_model

    torch.manual_seed(5)
    path = str(tmp_path_factory.mktemp("teacher") / "model.pt")
    torch.save(get_model("tiny", num_features=64).state_dict(), path)
    return path


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
