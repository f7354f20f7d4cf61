"""The RecordIO layout is read from the header's agreement with the index and `property`,
never from record 0's flag alone: packed-label im2rec sets train every image, insightface
sets only their images, and what fits both or neither is refused naming the file."""

import os

import pytest

from shardface.dataset import MXFaceDataset, RecordIOError, ResumableDistributedSampler, get_dataloader
from shardface.dataset.pack import write_insightface_rec
from shardface.dataset.recordio import IRHeader, RecordWriter, pack
from tests.log_capture import shardface_messages
from tests.tool_files import jpeg

IMAGE = jpeg((120, 60, 30))


def _im2rec_set(root, labels_of, n, num_classes, image_of=lambda key: IMAGE):
    """An im2rec-layout set: keys 0..n-1, each an image whose packed labels are `labels_of(key)`."""
    with RecordWriter(str(root / "train.idx"), str(root / "train.rec")) as w:
        for key in range(n):
            w.write(key, pack(IRHeader(0, labels_of(key), key, 0), image_of(key)))
    (root / "property").write_text(f"{num_classes},112,112\n")
    return str(root)


@pytest.mark.parametrize("packed", [1, 2], ids=["label", "label-and-index"])
def test_packed_label_im2rec_set_trains_all_400_images(tmp_path, packed):
    # the reported set: 400 images of 40 identities, flag > 0 on every record, key 0 of class 38
    classes = [(38 + key) % 40 for key in range(400)]
    root = _im2rec_set(tmp_path, lambda key: [classes[key], key][:packed], 400, 40)
    ds = MXFaceDataset(root, normalize=False)
    assert ds.keys == list(range(400))
    sampler = ResumableDistributedSampler(len(ds), 1, 0, batch_size=50, seed=0)
    seen = [y for _, labels in get_dataloader(ds, sampler, num_workers=0) for y in labels.tolist()]
    assert sorted(seen) == sorted(classes)  # every image once, with its own label


def test_insightface_set_trains_only_its_images(tmp_path):
    ids = [[jpeg(c) for _ in range(3)] for c in [(200, 0, 0), (0, 200, 0)]]
    write_insightface_rec(str(tmp_path), ids, 6, 2)
    ds = MXFaceDataset(str(tmp_path), train=False)
    assert ds.keys == [1, 2, 3, 4, 5, 6] and [ds[i][1].item() for i in range(6)] == [0, 0, 0, 1, 1, 1]


def test_insightface_set_without_identity_records_reads_its_images(tmp_path):
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as w:
        w.write(0, pack(IRHeader(0, [5, 7], 0, 0), b""))
        for key in range(1, 5):
            w.write(key, pack(IRHeader(0, float(key % 2), key, 0), IMAGE))
    (tmp_path / "property").write_text("2,112,112\n")
    assert MXFaceDataset(str(tmp_path)).keys == [1, 2, 3, 4]


def test_image_whose_labels_also_describe_the_index_is_refused_as_ambiguous(tmp_path):
    # key 0 holds an image, yet its labels (4, 12) read as a header of this very index: images
    # 1..3, identity records 4..11 whose labels run from 1 to 4, and property's 8 classes
    special = {0: [4, 12], 4: [1, 2], 11: [3, 4]}
    root = _im2rec_set(tmp_path, lambda key: special.get(key, [key % 8, 0]), 12, 8)
    with pytest.raises(
        RecordIOError,
        match=r"train\.rec: ambiguous layout: key 0 holds an image, and its labels "
        r"\[4\.0, 12\.0\].*scripts\.pack_rec",
    ):
        MXFaceDataset(root)
    special[11] = [3, 5]  # the same labels, but the last identity record does not end at key 4
    root = _im2rec_set(tmp_path, lambda key: special.get(key, [key % 8, 0]), 12, 8)
    assert len(MXFaceDataset(root)) == 12


def _insightface(tmp_path):
    ids = [[IMAGE] * 3 for _ in range(4)]
    write_insightface_rec(str(tmp_path), ids, 12, 4)
    return tmp_path


def test_header_that_does_not_match_a_truncated_index_is_refused(tmp_path):
    root = _insightface(tmp_path)
    lines = (root / "train.idx").read_text().splitlines(keepends=True)
    (root / "train.idx").write_text("".join(lines[:9]))  # header and 8 of the 12 images
    with pytest.raises(
        RecordIOError,
        match=r"train\.rec: key 0 is a header record \(labels \[13\.0, 17\.0\], no "
        r"image\) that does not match .*train\.idx: it puts images at keys "
        r"1\.\.12 .* but the index holds 9 keys from 0 to 8",
    ):
        MXFaceDataset(str(root))


def test_header_counting_other_identities_than_property_is_refused(tmp_path):
    root = _insightface(tmp_path)
    (root / "property").write_text("5,112,112\n")
    with pytest.raises(RecordIOError, match=r"it counts 4 identities, .*property says 5 classes"):
        MXFaceDataset(str(root))
    os.remove(root / "property")  # num_classes from the config and no property: the index decides
    assert len(MXFaceDataset(str(root), num_classes=4)) == 12


def test_insightface_set_without_property_counts_its_classes_from_the_header(tmp_path):
    from shardface.dataset import DataLayoutError, build_dataset

    root = _insightface(tmp_path)  # 4 identities of 3 images; header labels (13, 17)
    os.remove(root / "property")
    said = shardface_messages(lambda: build_dataset(str(root), 4, train=False))
    assert said[-1] == f"{root}: 4 classes, from the {root}/train.rec header (key 0; no {root}/property)"
    assert len(build_dataset(str(root), 4, train=False)) == 12
    with pytest.raises(
        DataLayoutError,
        match=rf"{root}/train\.rec header \(key 0; no .*property\): 4 classes, "
        r"config num_classes is 5",
    ):
        build_dataset(str(root), 5)


def test_im2rec_set_without_property_takes_its_class_count_from_the_config(tmp_path):
    from shardface.dataset import DataLayoutError, build_dataset

    root = _im2rec_set(tmp_path, lambda key: [key % 4], 8, 4)
    os.remove(os.path.join(root, "property"))
    said = shardface_messages(lambda: build_dataset(root, 4, train=False))
    assert said[-1] == f"{root}: 4 classes, from the config num_classes"
    ds = build_dataset(root, 4, train=False)
    assert ds.keys == list(range(8)) and [ds[i][1].item() for i in range(8)] == [k % 4 for k in range(8)]
    with pytest.raises(
        Exception, match=r"key 3: label 3 outside \[0, 3\) \(num_classes from config num_classes\)"
    ):
        build_dataset(root, 3, train=False)[3]
    with pytest.raises(
        DataLayoutError, match=r"property file not found, and .*train\.rec has no insightface header"
    ):
        MXFaceDataset(root)
