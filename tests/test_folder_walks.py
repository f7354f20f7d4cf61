"""Every tool walks image folders alike: symlinked folders are followed (a link up the tree is
no loop), hidden folders are skipped, and a hidden folder holding images is named, never
left out without a word."""

import logging
import os

import numpy as np
import pytest
from PIL import Image

from shardface.dataset.folders import image_files, list_identity_folders, list_images
from shardface.infer.enrolment import list_gallery
from shardface.scripts.align import photos_under


def _png(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(path)


def _walks(root):
    """Each walker's images under `root`, as paths relative to it."""
    rel = lambda paths: sorted(os.path.relpath(p, root) for p in paths)  # noqa: E731
    return {
        "align": sorted(photos_under(root)),
        "embed/identify queries": rel(image_files([root])),
        "gallery": sorted(f for _, files in list_gallery(root) for f in files),
        "training": rel(p for g in list_identity_folders(root)[1] for p in g),
        "label-free training": rel(list_images(root)),
    }


def test_symlinked_person_folders_are_followed_by_every_walker_and_a_link_up_the_tree_is_no_loop(tmp_path):
    root, elsewhere = tmp_path / "people", tmp_path / "elsewhere"
    _png(root / "ann" / "0.png")
    _png(elsewhere / "bob" / "0.png")
    _png(elsewhere / "bob" / "1.png")
    os.symlink(elsewhere / "bob", root / "bob")
    os.symlink(root, root / "ann" / "up")  # back up the tree
    want = ["ann/0.png", "bob/0.png", "bob/1.png"]
    for walker, found in _walks(str(root)).items():
        assert found == want, walker


def test_hidden_folders_are_skipped_and_those_holding_images_named_in_one_line(tmp_path, caplog):
    root = tmp_path / "people"
    _png(root / "obama" / "0.png")
    _png(root / ".biden" / "0.png")
    os.makedirs(root / ".git")
    (root / ".git" / "config").write_text("x")
    for walker, found in _walks(str(root)).items():
        assert found == ["obama/0.png"], walker
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5  # one line per walker
    for line in warnings:
        assert "\n" not in line and str(root / ".biden") in line and ".git" not in line


@pytest.mark.parametrize("depth", ["top", "nested"])
def test_a_hidden_folder_without_images_is_skipped_silently(tmp_path, caplog, depth):
    root = tmp_path / "people"
    _png(root / "obama" / "0.png")
    (root / ("obama" if depth == "nested" else "") / ".cache").mkdir(parents=True)
    (root / ("obama" if depth == "nested" else "") / ".cache" / "notes.txt").write_text("x")
    assert all(found == ["obama/0.png"] for found in _walks(str(root)).values())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
