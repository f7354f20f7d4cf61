"""Checkpoint RNG states: each rank keeps its own CUDA generator state, so a run resumes on a
different number of GPUs per node, and a CPU-only host opens what a GPU host wrote."""

import random

import numpy as np
import pytest
import torch

from shardface.checkpoint.files import atomic_save, safe_load
from shardface.checkpoint.state import cuda_state_to_restore, rng_state, set_rng_state


def _draws() -> tuple:
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_only_this_ranks_cuda_state_is_picked_never_a_list_by_position():
    own = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(cuda_state_to_restore({"cuda": own}), own)
    # a per-node list (older checkpoints, 8 GPUs) on a node with 4: no entry is this device's
    assert cuda_state_to_restore({"cuda": [own] * 8}) is None
    assert cuda_state_to_restore({}) is None  # written on a CPU host


def test_save_and_restore_touch_only_the_current_device(monkeypatch):
    """With CUDA present, the saved entry is the current device's state and restoring sets
    that one state: resuming 1x8 as 2x4 cannot index past a node's device list."""
    saved_state = torch.full((16,), 7, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": saved_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))

    def no_lists(*args, **kwargs):
        raise AssertionError("the state of every visible GPU must not be saved or restored")

    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_lists)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", no_lists)
    state = rng_state()
    assert torch.equal(state["cuda"], saved_state)
    set_rng_state(state)
    assert len(restored) == 1 and torch.equal(restored[0], saved_state)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only host's side")
def test_cpu_host_restores_rng_file_written_on_a_gpu_host(tmp_path):
    state = rng_state()
    assert "cuda" not in state
    state["cuda"] = torch.arange(16, dtype=torch.uint8)  # as a GPU host saves it
    path = str(tmp_path / "rng-rank0.pt")
    atomic_save(state, path)
    expected = _draws()
    _draws()  # move every generator on
    set_rng_state(safe_load(path))  # weights_only, no map_location needed
    assert _draws() == expected
