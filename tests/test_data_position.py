"""A checkpoint's data position is kept only on the data set it was saved on: the fingerprints
that tell data sets apart, and the rule applied on resume (runs: tests/test_checkpoint.py)."""

import logging
import shutil

from shardface.checkpoint.data_position import follow_data
from shardface.checkpoint.state import TrainState
from shardface.dataset import build_dataset
from shardface.dataset.pack import write_insightface_rec
from tests.tool_files import jpeg


def _folders(root, counts):
    for i, count in enumerate(counts):
        (root / f"id{i}").mkdir(parents=True)
        for j in range(count):
            (root / f"id{i}" / f"{j}.jpg").write_bytes(jpeg((40 * i, 0, 0)))
    return str(root)


def test_folder_fingerprint_follows_the_file_list_not_the_location(tmp_path):
    first = build_dataset(_folders(tmp_path / "a", [2, 3]), 2).fingerprint()
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert build_dataset(str(tmp_path / "moved"), 2).fingerprint() == first
    (tmp_path / "moved" / "id0" / "9.jpg").write_bytes(jpeg((0, 0, 0)))  # one image more
    assert build_dataset(str(tmp_path / "moved"), 2).fingerprint() != first
    # same count, other files
    assert build_dataset(_folders(tmp_path / "b", [3, 2]), 2).fingerprint() != first


def test_recordio_fingerprint_follows_the_packed_set_not_the_location(tmp_path):
    def packed(name, colors):
        write_insightface_rec(
            str(tmp_path / name), [[jpeg(c)] * 2 for c in colors], 2 * len(colors), len(colors)
        )
        return build_dataset(str(tmp_path / name), len(colors)).fingerprint()

    first = packed("a", [(200, 0, 0), (0, 200, 0)])
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert build_dataset(str(tmp_path / "moved"), 2).fingerprint() == first
    assert packed("other", [(0, 0, 200), (0, 90, 200)]) != first  # same count, other images
    assert build_dataset("synthetic", 4).fingerprint() != build_dataset("synthetic", 5).fingerprint()


def test_checkpoint_without_a_recorded_data_set_restarts_only_past_the_epoch_end(caplog):
    # checkpoints written before data sets were recorded: only a position this data lacks is known to be wrong
    for batch, restarted in [(5, False), (6, True)]:
        state = TrainState(step=30, epoch=2, batch_in_epoch=batch)
        with caplog.at_level(logging.WARNING, logger="shardface"):
            caplog.clear()
            assert follow_data(state, {"step": 30}, 50, "f", "/data/x", batches_per_epoch=5) is restarted
        assert (state.batch_in_epoch, state.data_size, state.data_fingerprint) == (
            0 if restarted else batch,
            50,
            "f",
        )
        assert ("the saved batch 6 is past this data's 5 per epoch" in caplog.text) is restarted


def test_same_size_other_content_restarts_and_fresh_runs_only_record(caplog):
    state = TrainState(step=30, epoch=2, batch_in_epoch=3)
    assert follow_data(state, None, 50, "f", "/data/x", 5) is False and state.data_size == 50
    with caplog.at_level(logging.WARNING, logger="shardface"):
        assert follow_data(state, {"data_size": 50, "data_fingerprint": "f"}, 50, "f", "/data/x", 5) is False
        assert not caplog.records
        assert follow_data(state, {"data_size": 50, "data_fingerprint": "e"}, 50, "f", "/data/x", 5) is True
    assert "50 samples as before, but other ones or in another order" in caplog.text
    assert "its position (epoch 2, batch 3)" in caplog.text and state.batch_in_epoch == 0
