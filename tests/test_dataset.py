"""Face datasets in the insightface and im2rec layouts, workers, sampler resume, bad input."""

import os

import pytest
import torch

from shardface.dataset import (
    DataLayoutError,
    ImageDecodeError,
    LabelError,
    MXFaceDataset,
    ResumableDistributedSampler,
    build_dataset,
    get_dataloader,
    normalize_images,
)
from shardface.dataset.pack import write_insightface_rec
from shardface.dataset.recordio import IRHeader, RecordWriter, pack
from shardface.errors import OutputError
from tests.tool_files import jpeg

COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200)]


def _insightface_set(root, per_id=4):
    ids = [[jpeg(c) for _ in range(per_id)] for c in COLORS]
    write_insightface_rec(str(root), ids, per_id * len(COLORS), len(COLORS))
    return str(root)


def test_insightface_layout_reads_images_and_labels(tmp_path):
    root = _insightface_set(tmp_path)
    ds = MXFaceDataset(root, train=False)
    assert len(ds) == 12 and ds.num_classes == 3
    img, label = ds[5]
    assert img.shape == (3, 112, 112) and img.dtype == torch.float32
    assert -1.0 <= img.min() and img.max() <= 1.0
    assert label.item() == 1
    # the red identity is red: channel 0 high
    assert ds[0][0][0].mean() > 0.5 and ds[0][0][2].mean() < -0.5


def test_uint8_images_normalised_on_device_equal_float_images(tmp_path):
    root = _insightface_set(tmp_path)
    floats, raw = MXFaceDataset(root), MXFaceDataset(root, normalize=False)
    assert raw[3][0].dtype == torch.uint8
    batch = torch.stack([raw[i][0] for i in range(6)])
    torch.testing.assert_close(normalize_images(batch), torch.stack([floats[i][0] for i in range(6)]))


def test_fast_jpeg_decoder_matches_pil_and_rejects_truncation():
    import io

    import numpy as np
    from PIL import Image

    from shardface.dataset.images import decode_chw, decode_image

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    pil = torch.from_numpy(decode_image(data, "x")).permute(2, 0, 1)
    assert torch.equal(decode_chw(data, "x"), pil)
    assert torch.equal(decode_chw(data, "x", mirror=True), torch.flip(pil, dims=[2]))
    with pytest.raises(ImageDecodeError, match="cut.jpg: cannot decode image"):
        decode_chw(data[: len(data) // 2], "cut.jpg")


def test_damaged_jpeg_body_is_reported_with_its_key(caplog, capfd):
    """libjpeg decodes a JPEG whose scan data holds stray markers and says only "Corrupt JPEG
    data" on stderr: the warning must name the image, and the bare line must not appear."""
    import io

    import numpy as np
    from PIL import Image

    from shardface.dataset.images import decode_chw

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    data = bytearray(buf.getvalue())
    middle = len(data) // 2
    data[middle : middle + 40] = b"\xff\xd3" * 20
    capfd.readouterr()
    with caplog.at_level("WARNING", logger="shardface"):
        assert decode_chw(bytes(buf.getvalue()), "good.rec key 1").shape == (3, 112, 112)
        assert not caplog.records
        assert decode_chw(bytes(data), "train.rec key 7").shape == (3, 112, 112)
    assert [r.getMessage() for r in caplog.records] == [
        "train.rec key 7: damaged JPEG data, decoded anyway (Corrupt JPEG data: premature end of data segment)"
    ]
    assert "Corrupt JPEG" not in capfd.readouterr().err


def test_im2rec_layout_uses_every_key(tmp_path):
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")) as w:
        for key in range(5):
            w.write(key, pack(IRHeader(0, float(key % 2), key, 0), jpeg(COLORS[key % 2])))
    ds = MXFaceDataset(str(tmp_path), num_classes=2, train=False)
    assert len(ds) == 5 and [ds[i][1].item() for i in range(5)] == [0, 1, 0, 1, 0]


def test_training_flip_mirrors_the_image(tmp_path):
    root = _insightface_set(tmp_path)
    train, plain = MXFaceDataset(root, train=True), MXFaceDataset(root, train=False)
    flipped = [i for i in range(len(train)) if train.mirror(i)]
    assert 0 < len(flipped) < len(train)
    i = flipped[0]
    torch.testing.assert_close(train[i][0], torch.flip(plain[i][0], dims=[2]))


def test_label_beyond_num_classes_names_file_and_key(tmp_path):
    root = _insightface_set(tmp_path)
    # (a property of 2 classes disagrees with the header: test_layout)
    ds = MXFaceDataset(root, num_classes=2)
    with pytest.raises(LabelError, match=r"train\.rec key 9: label 2 outside \[0, 2\)"):
        ds[8]


def test_undecodable_image_raises_or_is_skipped_when_configured(tmp_path):
    ids = [[jpeg(COLORS[0]), b"not a jpeg", jpeg(COLORS[0])]]
    write_insightface_rec(str(tmp_path), ids, 3, 1)
    with pytest.raises(ImageDecodeError, match=r"train\.rec key 2: cannot decode image"):
        MXFaceDataset(str(tmp_path))[1]
    ds = MXFaceDataset(str(tmp_path), skip_bad_images=True)
    img, label = ds[1]
    assert img.shape == (3, 112, 112) and ds.bad_images == 1


def test_missing_property_of_an_insightface_set_is_read_from_its_header(tmp_path):
    root = _insightface_set(tmp_path)
    os.remove(os.path.join(root, "property"))
    ds = MXFaceDataset(root)  # as arcface_torch: record 0's identity range (an im2rec set: test_layout)
    assert (ds.num_classes, ds.classes_from) == (3, f"{root}/train.rec header (key 0; no {root}/property)")


def test_two_workers_read_the_same_items_as_none(tmp_path):
    root = _insightface_set(tmp_path, per_id=6)
    ds = MXFaceDataset(root)
    batches = {}
    for workers in (0, 2):
        sampler = ResumableDistributedSampler(len(ds), 1, 0, batch_size=4, seed=3)
        batches[workers] = list(get_dataloader(ds, sampler, num_workers=workers))
    assert len(batches[0]) == len(batches[2]) == 4
    for (x0, y0), (x2, y2) in zip(batches[0], batches[2]):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)


def test_sampler_ranks_are_disjoint_and_resume_skips_what_was_seen():
    n, world, bs = 50, 2, 4
    per_rank = [ResumableDistributedSampler(n, world, r, bs, seed=1) for r in range(world)]
    for s in per_rank:
        s.set_epoch(3)
    seen = [list(s) for s in per_rank]
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == (n // (world * bs)) * bs
    resumed = ResumableDistributedSampler(n, world, 1, bs, seed=1)
    resumed.set_epoch(3, start_batch=2)
    assert list(resumed) == seen[1][2 * bs :]
    other_epoch = ResumableDistributedSampler(n, world, 1, bs, seed=1)
    other_epoch.set_epoch(4)
    assert list(other_epoch) != seen[1]


def _old_definition(n, world, rank, bs, seed, epoch, start_batch=0):
    """The sampler's order as first written: the full permutation as a list on every rank."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    used = (n // (world * bs)) * bs * world
    return order[rank:used:world][start_batch * bs :]


@pytest.mark.parametrize("n,world,bs,start", [(50, 2, 4, 0), (1000, 3, 7, 5), (100_003, 8, 128, 60)])
def test_sampler_order_equals_the_rank_slice_of_the_seeded_permutation(n, world, bs, start):
    for rank in range(world):
        s = ResumableDistributedSampler(n, world, rank, bs, seed=11)
        s.set_epoch(4, start_batch=start)
        assert list(s) == _old_definition(n, world, rank, bs, 11, 4, start)
    plain = ResumableDistributedSampler(n, world, 1, bs, shuffle=False)
    assert list(plain)[:3] == [1, 1 + world, 1 + 2 * world]


def test_ranks_partition_the_epoch_exactly():
    n, world, bs = 1001, 4, 10
    parts = []
    for rank in range(world):
        s = ResumableDistributedSampler(n, world, rank, bs, seed=5)
        s.set_epoch(2)
        parts.append(s.epoch_indices())
    every = torch.cat(parts)
    used = (n // (world * bs)) * bs * world
    assert every.numel() == used and every.unique().numel() == used
    assert set(every.tolist()) == set(
        torch.randperm(n, generator=torch.Generator().manual_seed(7))[:used].tolist()
    )


def test_sampler_memory_per_rank_is_its_own_indices_not_the_data_set():
    """A rank holds an int64 tensor of n/W indices and a bounded slice of Python ints; the
    old list of all n indices would take ~36 bytes * n of Python objects on every rank."""
    import tracemalloc

    n, world, bs = 2_000_000, 8, 128
    s = ResumableDistributedSampler(n, world, 3, bs, seed=1)
    held = s.epoch_indices()
    assert held.dtype == torch.int64 and held.numel() == (n // (world * bs)) * bs
    assert held.untyped_storage().nbytes() == 8 * held.numel()  # not a view into all n
    tracemalloc.start()
    try:
        it = iter(s)
        first = [next(it) for _ in range(bs)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == held[:bs].tolist()
    assert peak < 2_000_000, f"{peak} bytes of Python objects for the first batch"  # old: ~72 MB


def test_persistent_workers_follow_each_epochs_order_mirroring_and_resume(tmp_path):
    """One loader, two workers kept across epochs, equals a fresh single-process loader per
    epoch: the epoch (mirroring) reaches workers that were started in epoch 0."""
    root = _insightface_set(tmp_path, per_id=6)
    ds, reference_ds = MXFaceDataset(root), MXFaceDataset(root)
    sampler = ResumableDistributedSampler(len(ds), 1, 0, batch_size=3, seed=9)
    loader = get_dataloader(ds, sampler, num_workers=2, seed=9)
    pids = None
    for epoch, start in [(0, 0), (1, 0), (2, 4)]:
        sampler.set_epoch(epoch, start)
        ds.set_epoch(epoch, 9)
        got = list(loader)
        ref_sampler = ResumableDistributedSampler(len(ds), 1, 0, batch_size=3, seed=9)
        ref_sampler.set_epoch(epoch, start)
        reference_ds.set_epoch(epoch, 9)
        want = list(get_dataloader(reference_ds, ref_sampler, num_workers=0))
        assert len(got) == len(want) == 6 - start
        for (x, y), (xr, yr) in zip(got, want):
            assert torch.equal(x, xr) and torch.equal(y, yr)
        now = [w.pid for w in loader._iterator._workers]
        assert pids is None or now == pids  # the same worker processes every epoch
        pids = now
    flips = []
    for epoch in (0, 1):
        reference_ds.set_epoch(epoch, 9)
        flips.append([reference_ds.mirror(i) for i in range(len(reference_ds))])
    assert flips[0] != flips[1]  # the epochs differ in mirroring, so the checks above can fail


def test_build_dataset_checks_num_classes(tmp_path):
    root = _insightface_set(tmp_path)
    with pytest.raises(DataLayoutError, match="3 classes, config num_classes is 5"):
        build_dataset(root, 5)
    assert len(build_dataset("synthetic", 10)) > 0


def test_pack_rec_refuses_to_overwrite(tmp_path):
    root = _insightface_set(tmp_path)
    with pytest.raises(OutputError, match="--overwrite"):
        _insightface_set(root)


def test_pack_rec_script_packs_an_image_folder(tmp_path):
    import subprocess
    import sys

    for i, color in enumerate(COLORS):
        d = tmp_path / "faces" / f"id{i}"
        d.mkdir(parents=True)
        for j in range(2):
            (d / f"{j}.jpg").write_bytes(jpeg(color))
    out = tmp_path / "rec"
    subprocess.run(
        [sys.executable, "-m", "scripts.pack_rec", str(tmp_path / "faces"), str(out)],
        check=True,
        capture_output=True,
    )
    ds = MXFaceDataset(str(out), train=False)
    assert len(ds) == 6 and [ds[i][1].item() for i in range(6)] == [0, 0, 1, 1, 2, 2]
    again = subprocess.run(
        [sys.executable, "-m", "scripts.pack_rec", str(tmp_path / "faces"), str(out)],
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "--overwrite" in again.stderr


def test_empty_record_file_is_named(tmp_path):
    with RecordWriter(str(tmp_path / "train.idx"), str(tmp_path / "train.rec")):
        pass
    with pytest.raises(DataLayoutError, match=r"train\.idx: no records; the data set is empty"):
        MXFaceDataset(str(tmp_path), num_classes=2)


def test_identity_folder_without_images_is_an_error(tmp_path):
    for name, count in [("a", 2), ("b", 0), ("c", 1)]:
        (tmp_path / name).mkdir()
        for j in range(count):
            (tmp_path / name / f"{j}.jpg").write_bytes(jpeg(COLORS[0]))
    with pytest.raises(DataLayoutError, match=r"/b: identity folder without images"):
        build_dataset(str(tmp_path), 3)


def test_skipped_images_are_counted_across_loader_workers(tmp_path):
    images = [jpeg(COLORS[i % 3]) for i in range(12)]
    images[1] = images[6] = b"not a jpeg"
    write_insightface_rec(str(tmp_path), [images[:4], images[4:8], images[8:]], 12, 3)
    ds = MXFaceDataset(str(tmp_path), skip_bad_images=True)
    sampler = ResumableDistributedSampler(len(ds), 1, 0, batch_size=4, seed=0)
    assert sum(len(y) for _, y in get_dataloader(ds, sampler, num_workers=2)) == 12
    assert ds.bad_images == 2  # each bad index read once, its neighbour taken instead


def test_property_file_with_a_utf8_bom_reads_as_without(tmp_path):
    from shardface.dataset.faces import read_property

    (tmp_path / "property").write_bytes(b"\xef\xbb\xbf93431,112,112\n")
    assert read_property(str(tmp_path)) == (93431, 112, 112)
