"""Your own photos: every Pillow format and mode decodes to RGB in one defined way, images that
are not 112x112 are refused at start (naming files) unless resized, pack_rec never loses an
earlier set, skip_bad_images works on folders, make_bin writes an insightface .bin."""

import io
import os
import pickle
import re

import numpy as np
import pytest
import torch
from PIL import Image

from shardface.dataset import DataError, ImageDecodeError, MXFaceDataset, build_dataset
from shardface.dataset.errors import ImageSizeError
from shardface.dataset.images import decode_chw, to_rgb
from shardface.dataset.pack import write_insightface_rec
from shardface.eval.verification import load_bin
from shardface.scripts.make_bin import main as make_bin
from shardface.scripts.pack_rec import main as pack_rec

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (112, 112, 3), dtype=np.uint8)
GRAY = RGB[..., 0].copy()
ALPHA = RNG.integers(0, 256, (112, 112), dtype=np.uint8)
WORDS = RNG.integers(0, 65536, (112, 112), dtype=np.uint16)


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def pixels(data: bytes) -> np.ndarray:
    return decode_chw(data, "test").permute(1, 2, 0).numpy().astype(np.int64)


def gray3(values) -> np.ndarray:
    return np.repeat(np.asarray(values, dtype=np.int64)[..., None], 3, axis=2)


def on_black(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    return np.rint(rgb.astype(np.float64) * alpha[..., None] / 255.0).astype(np.int64)


# (case, encoded bytes, expected HxWx3): the expectations written from the rule, not the code
LOSSLESS = [
    ("png-rgb", encoded(Image.fromarray(RGB), "PNG"), RGB),
    ("bmp-rgb", encoded(Image.fromarray(RGB), "BMP"), RGB),
    ("ppm-rgb", encoded(Image.fromarray(RGB), "PPM"), RGB),
    ("tiff-rgb", encoded(Image.fromarray(RGB), "TIFF"), RGB),
    ("webp-lossless", encoded(Image.fromarray(RGB), "WEBP", lossless=True), RGB),
    ("pgm-gray", encoded(Image.fromarray(GRAY), "PPM"), gray3(GRAY)),
    ("png-gray", encoded(Image.fromarray(GRAY), "PNG"), gray3(GRAY)),
    ("png-16bit", encoded(Image.fromarray(WORDS), "PNG"), gray3(np.rint(WORDS / 257.0))),
    ("tiff-16bit", encoded(Image.fromarray(WORDS), "TIFF"), gray3(np.rint(WORDS / 257.0))),
    ("pgm-16bit", encoded(Image.fromarray(WORDS), "PPM"), gray3(np.rint(WORDS / 257.0))),
    ("png-rgba", encoded(Image.fromarray(np.dstack([RGB, ALPHA])), "PNG"), on_black(RGB, ALPHA)),
    (
        "png-gray-alpha",
        encoded(Image.fromarray(np.dstack([GRAY, ALPHA])), "PNG"),
        gray3(on_black(gray3(GRAY), ALPHA)[..., 0]),
    ),
    ("png-1bit", encoded(Image.fromarray(GRAY > 127).convert("1"), "PNG"), gray3((GRAY > 127) * 255)),
    ("tiff-1bit", encoded(Image.fromarray(GRAY > 127).convert("1"), "TIFF"), gray3((GRAY > 127) * 255)),
]


@pytest.mark.parametrize("case,data,expected", LOSSLESS, ids=[c[0] for c in LOSSLESS])
def test_each_lossless_format_and_mode_decodes_to_its_defined_rgb(case, data, expected):
    assert pixels(data).shape == (112, 112, 3)
    np.testing.assert_array_equal(pixels(data), expected)


def test_sixteen_bit_white_is_white_and_mid_grey_is_mid_grey_not_saturated():
    words = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)
    out = np.asarray(to_rgb(Image.fromarray(words)))
    assert out[0, :, 0].tolist() == [0, 1, 128, 255]
    for mode in ("I;16B", "I"):  # big-endian 16-bit, and 32-bit I holding 16-bit values
        img = (
            Image.fromarray(words).convert(mode)
            if mode == "I"
            else Image.frombytes("I;16B", (4, 1), words.astype(">u2").tobytes())
        )
        assert np.asarray(to_rgb(img))[0, :, 0].tolist() == [0, 1, 128, 255], mode


def test_palette_with_transparency_is_composited_on_black():
    img = Image.fromarray(RGB).quantize(16)
    img.info["transparency"] = 0
    data = encoded(img, "PNG", transparency=0)
    opaque = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int64)
    index = np.asarray(Image.open(io.BytesIO(data)))
    expected = np.where((index == 0)[..., None], 0, opaque)
    np.testing.assert_array_equal(pixels(data), expected)


def test_float_tiff_with_nan_pixels_is_refused_naming_the_image_not_made_black(tmp_path):
    values = RNG.uniform(0, 255, (112, 112)).astype(np.float32)
    assert pixels(encoded(Image.fromarray(values), "TIFF"))[..., 0].tolist() == np.rint(values).tolist()
    values[3, 5] = np.nan
    path = str(tmp_path / "id0" / "0.tif")
    with pytest.raises(ImageDecodeError, match=r"id0/0.tif: float image with 1 NaN pixel\(s\) of 12544"):
        decode_chw(encoded(Image.fromarray(values), "TIFF"), path)


@pytest.mark.parametrize("mode", ["CMYK", "L"])
def test_cmyk_and_grayscale_jpeg_decode_as_pillows_conversion_on_both_decoders(mode):
    data = encoded(Image.fromarray(RGB).convert(mode), "JPEG", quality=95)
    reference = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int64)
    np.testing.assert_array_equal(pixels(data), reference)  # torchvision's libjpeg path


def _folder(root, sizes_per_identity, fmt="PNG", ext=".png"):
    for i, sizes in enumerate(sizes_per_identity):
        os.makedirs(os.path.join(root, f"id{i}"), exist_ok=True)
        for j, (h, w) in enumerate(sizes):
            img = Image.fromarray(RNG.integers(0, 256, (h, w, 3), dtype=np.uint8))
            img.save(os.path.join(root, f"id{i}", f"{j}{ext}"), format=fmt)
    return str(root)


def test_folder_with_wrong_sizes_is_refused_at_start_naming_files_count_and_fix(tmp_path):
    root = _folder(tmp_path / "f", [[(112, 112), (112, 92)], [(250, 250)] * 4])
    with pytest.raises(ImageSizeError) as err:
        build_dataset(root, 2)
    msg = str(err.value)
    assert "5 images are not 112x112" in msg and "read the headers of all 6 files" in msg
    assert "id0/1.png (92x112)" in msg and "id1/0.png (250x250)" in msg and "and 2 more" in msg
    assert "--resize" in msg and "align" in msg
    data = build_dataset(root, 2, resize=True, normalize=False)
    assert len(data) == 6 and all(data[i][0].shape == (3, 112, 112) for i in range(6))


def test_pack_rec_refuses_wrong_sizes_writing_nothing_and_resize_packs_112(tmp_path, capsys):
    root = _folder(tmp_path / "f", [[(112, 92)] * 2, [(112, 112)] * 2], fmt="PPM", ext=".pgm")
    out = str(tmp_path / "rec")
    assert pack_rec([root, out]) == 2  # a DataError: one line, exit code 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.match(
        r"error: 2 images are not 112x112 .*id0/0.pgm \(92x112\).*--resize", errors[0]
    )
    assert not os.path.exists(out)
    pack_rec([root, out, "--resize"])
    data = build_dataset(out, 2, normalize=False)
    assert [tuple(data[i][0].shape) for i in range(4)] == [(3, 112, 112)] * 4


def test_property_disagreeing_with_records_or_not_112_is_refused_at_start(tmp_path):
    small = encoded(Image.fromarray(RGB[:, :92]), "PNG")
    out = str(tmp_path / "rec")
    write_insightface_rec(out, [[small] * 3, [encoded(Image.fromarray(RGB), "PNG")] * 3], 6, 2)
    with pytest.raises(
        ImageSizeError, match=r"property says 112x112, but 3 of 6 sampled records .*key 1 \(92x112\)"
    ):
        build_dataset(out, 2)
    with open(os.path.join(out, "property"), "w") as f:
        f.write("2,250,250\n")
    with pytest.raises(ImageSizeError, match=r"property: images are 250x250, not 112x112"):
        build_dataset(out, 2)
    big = str(tmp_path / "big")  # a 250x250 set whose property says so: taken with resize
    write_insightface_rec(
        big, [[encoded(Image.fromarray(np.zeros((250, 250, 3), np.uint8)), "PNG")] * 2], 2, 1
    )
    with open(os.path.join(big, "property"), "w") as f:
        f.write("1,250,250\n")
    with pytest.raises(ImageSizeError, match=r"250x250"):
        build_dataset(big, 1)
    assert build_dataset(big, 1, resize=True)[0][0].shape == (3, 112, 112)


def test_a_wrong_size_record_missed_by_the_sample_is_named_when_read(tmp_path):
    good = encoded(Image.fromarray(RGB), "PNG")
    out = str(tmp_path / "rec")
    write_insightface_rec(
        out, [[good] * 20, [good] * 9 + [encoded(Image.fromarray(RGB[:, :92]), "PNG")] + [good] * 10], 40, 2
    )
    data = MXFaceDataset(out, skip_bad_images=True)
    with pytest.raises(ImageSizeError, match=r"train.rec key 30: image is 92x112"):
        data[29]


def test_sixteen_bit_png_in_recordio_reads_scaled(tmp_path):
    out = str(tmp_path / "rec")
    write_insightface_rec(out, [[encoded(Image.fromarray(WORDS), "PNG")]], 1, 1)
    image, _ = MXFaceDataset(out, train=False, normalize=False)[0]
    np.testing.assert_array_equal(image[0].numpy(), np.rint(WORDS / 257.0).astype(np.uint8))


def _old_set(tmp_path):
    root = _folder(tmp_path / "old", [[(112, 112)] * 2, [(112, 112)] * 2])
    out = str(tmp_path / "rec")
    pack_rec([root, out])
    return out, {n: open(os.path.join(out, n), "rb").read() for n in ("train.rec", "train.idx", "property")}


def test_pack_failing_partway_with_overwrite_keeps_the_old_set(tmp_path):
    out, before = _old_set(tmp_path)

    def identities():
        yield [encoded(Image.fromarray(RGB), "PNG")] * 50
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        write_insightface_rec(out, identities(), 100, 2, overwrite=True)
    assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before
    assert sorted(os.listdir(out)) == sorted(before)  # no partial files left


def test_pack_list_naming_a_missing_image_is_refused_before_writing(tmp_path, capsys):
    out, before = _old_set(tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("old/id0/0.png\t0\nold/id0/gone.png\t0\n")
    assert pack_rec([str(listing), out, "--overwrite"]) == 2  # a DataError: one line, exit code 2
    assert re.search(r"^error: .*old/id0/gone.png: image file not found", capsys.readouterr().err, flags=re.M)
    assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before


def test_folder_unreadable_images_are_data_errors_or_skipped_when_asked(tmp_path, caplog):
    root = _folder(tmp_path / "f", [[(112, 112)] * 3, [(112, 112)] * 3])
    open(os.path.join(root, "id0", "9.png"), "wb").write(b"not an image")
    with pytest.raises(ImageDecodeError, match=r"id0/9.png: cannot read image"):
        build_dataset(root, 2)
    data = build_dataset(root, 2, train=False, skip_bad_images=True, normalize=False)
    assert len(data) == 6 and "skipping 1 unreadable image" in caplog.text
    # a file that goes missing (or is damaged) after the start: a DataError, or skipped
    os.remove(data.samples[1][0])
    with pytest.raises(DataError, match=r"id0/1.png: cannot read image \(No such file"):
        data.load(1)
    image, label = data[1]  # skipped: the next image stands in
    assert data.bad_images == 1 and int(label) == 0 and torch.equal(image, data[2][0])


def test_make_bin_is_balanced_alternating_deterministic_and_reads_like_lfw(tmp_path):
    root = _folder(tmp_path / "held", [[(112, 112)] * 3] * 5)
    a, b, c = (str(tmp_path / n) for n in ("a.bin", "b.bin", "c.bin"))
    make_bin([root, a, "--pairs", "20", "--seed", "1"])
    make_bin([root, b, "--pairs", "20", "--seed", "1"])
    make_bin([root, c, "--pairs", "20", "--seed", "2"])
    assert open(a, "rb").read() == open(b, "rb").read() != open(c, "rb").read()
    bins, issame = pickle.load(open(a, "rb"))
    assert issame == [True, False] * 10 and len(bins) == 40
    files = {
        open(os.path.join(root, d, f), "rb").read(): d
        for d in os.listdir(root)
        for f in os.listdir(os.path.join(root, d))
    }
    assert [files[bins[2 * i]] == files[bins[2 * i + 1]] for i in range(20)] == issame
    assert len({(bins[2 * i], bins[2 * i + 1]) for i in range(20)}) == 20  # no pair twice
    (images, _), read_issame = load_bin(a, min_pairs=10)
    assert images.shape == (40, 3, 112, 112) and read_issame == issame


def test_make_bin_refusals_name_the_problem_and_write_nothing(tmp_path, capsys):
    root = _folder(tmp_path / "held", [[(112, 112)] * 2] * 3)
    out = str(tmp_path / "v.bin")
    assert make_bin([root, out, "--pairs", "20"]) == 2
    assert re.match(
        r"error: .*3 same-identity pairs exist .* 10 needed: pass --pairs 6 or fewer", capsys.readouterr().err
    )
    odd = _folder(tmp_path / "odd", [[(112, 92)] * 6] * 3)
    assert make_bin([odd, out, "--pairs", "10"]) == 2
    assert re.match(r"error: .*not 112x112 .*--resize", capsys.readouterr().err)
    assert not os.path.exists(out) and sorted(os.listdir(tmp_path)) == ["held", "odd"]
    make_bin([odd, out, "--pairs", "10", "--resize"])
    assert load_bin(out)[0][0].shape == (20, 3, 112, 112)
    three = _folder(tmp_path / "three", [[(112, 112)] * 3] * 3)
    make_bin([three, out, "--overwrite"])  # default: as many balanced pairs as 3 people of 3 allow
    assert load_bin(out)[1] == [True, False] * 9
    one = _folder(tmp_path / "one", [[(112, 112)] * 2] * 2)
    capsys.readouterr()
    assert make_bin([one, str(tmp_path / "w.bin")]) == 2
    assert re.match(
        r"error: .*only 4 balanced pairs can be drawn, fewer than the 10 folds", capsys.readouterr().err
    )
    assert not os.path.exists(tmp_path / "w.bin")


def _identities(root, ids, per_id, seed=5):
    """Drawn faces, one folder per identity; every third image re-saved as a 16-bit PGM or an
    RGBA PNG (the formats the decoder must take)."""
    from shardface.dataset.drawn_faces import identity_images

    for i in ids:
        folder = os.path.join(root, f"person{i:02d}")
        os.makedirs(folder)
        for j, data in enumerate(identity_images(i, per_id, seed)):
            img = Image.open(io.BytesIO(data))
            if j % 3 == 1:
                words = np.asarray(img.convert("L"), dtype=np.uint16) * 257
                Image.fromarray(words).save(os.path.join(folder, f"{j}.png"))
            elif j % 3 == 2:
                img.convert("RGBA").save(os.path.join(folder, f"{j}.webp"), lossless=True)
            else:
                open(os.path.join(folder, f"{j}.jpg"), "wb").write(data)
    return str(root)


@pytest.mark.slow  # ~25 s of CPU: a training run, an export and three embedding passes
def test_own_photos_end_to_end_pack_train_make_bin_verify_embed_compare(tmp_path, capsys):
    """folder -> pack_rec -> train (tiny, val_targets on the own .bin) -> verify (run and ONNX)
    -> embed with the run, model.pt and ONNX: the same embeddings to 1e-4."""
    from shardface import train
    from shardface.scripts.compare import main as compare
    from shardface.scripts.embed import main as embed
    from shardface.scripts.export_onnx import main as export_onnx
    from shardface.scripts.verify import main as verify

    photos = _identities(tmp_path / "photos", range(8), 8)
    held = _identities(tmp_path / "held_out", range(8, 12), 5)
    rec = str(tmp_path / "rec")
    pack_rec([photos, rec])
    make_bin([held, os.path.join(rec, "own_val.bin"), "--pairs", "20"])
    run = str(tmp_path / "run")
    assert (
        train.main(
            [
                "configs/demo.py",
                "--rec",
                rec,
                "--num_classes",
                "8",
                "--num_image",
                "64",
                "--batch_size",
                "8",
                "--num_workers",
                "0",
                "--max_steps",
                "4",
                "--warmup_epoch",
                "0",
                "--val_targets",
                "['own_val']",
                "--verbose",
                "4",
                "--frequent",
                "2",
                "--checkpoint_interval",
                "4",
                "--output",
                run,
            ]
        )
        == 0
    )
    assert "[own_val][4]" in open(os.path.join(run, "training.log")).read()
    onnx_path = str(tmp_path / "model.onnx")
    export_onnx([run, onnx_path])
    capsys.readouterr()
    for model in (run, onnx_path):
        verify([model, "--bin", os.path.join(rec, "own_val.bin")])
    table = capsys.readouterr().out.splitlines()
    # same accuracies, std, XNorm (each table then its legend)
    assert table[1].split()[1:] == table[4].split()[1:]
    assert table[2].startswith(
        "acc, acc-flip: 10-fold accuracy (insightface's protocol: each fold judged at the "
        "threshold best on the other 9); scripts.compare --threshold-from prints the "
        "best-threshold accuracy over all pairs"
    )

    outs = {}
    for name, model in (("run", run), ("pt", os.path.join(run, "model.pt")), ("onnx", onnx_path)):
        outs[name] = str(tmp_path / f"{name}.npy")
        embed([model, held, "--out", outs[name], "--batch-size", "7"])
    files = open(str(tmp_path / "run.txt")).read().splitlines()
    assert len(files) == 20 and files == sorted(files) and files[0].endswith("person08/0.jpg")
    emb = {k: np.load(v) for k, v in outs.items()}
    assert emb["run"].shape == (20, 128) and np.allclose(np.linalg.norm(emb["run"], axis=1), 1, atol=1e-5)
    assert np.abs(emb["run"] - emb["pt"]).max() == 0
    assert np.abs(emb["run"] - emb["onnx"]).max() < 1e-4

    capsys.readouterr()
    compare([onnx_path, files[0], files[1], "--threshold", "-1"])
    out = capsys.readouterr().out
    cosine = float(out.split("cosine similarity ")[1].split()[0])
    assert (
        abs(cosine - float(emb["run"][0] @ emb["run"][1])) < 1e-4 and "same person (threshold -1.0000)" in out
    )
    compare([run, files[0], files[1], "--threshold-from", os.path.join(rec, "own_val.bin")])
    assert "accuracy" in capsys.readouterr().out


def test_model_pt_and_its_onnx_export_embed_alike_and_verify_takes_onnx(tmp_path, capsys):
    """The fast variant of the end-to-end test: an untrained tiny backbone as model.pt (config
    beside it) and as .onnx gives the same embeddings, and verify reads the .onnx."""
    import json

    from shardface.backbones import get_model
    from shardface.dataset.folders import image_files
    from shardface.infer.model import as_model, load_module
    from shardface.scripts.export_onnx import export
    from shardface.scripts.verify import main as verify

    torch.manual_seed(0)
    model = get_model("tiny", num_features=64).eval()
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    pt, onnx_path = str(tmp_path / "model.pt"), str(tmp_path / "model.onnx")
    torch.save(model.state_dict(), pt)
    json.dump({"network": "tiny"}, open(tmp_path / "config.json", "w"))
    export(model, onnx_path)
    held = _identities(tmp_path / "held", range(3), 5)
    files = image_files([held])
    a = as_model(load_module(pt)).embed(files, align=False, batch_size=4)
    b = as_model(load_module(onnx_path)).embed(files, align=False, batch_size=6)
    assert a.shape == (15, 64) and np.abs(a - b).max() < 1e-4
    bare = tmp_path / "arcface_torch"  # an arcface_torch model.pt: "module." keys, no config, --network
    bare.mkdir()
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, bare / "model.pt")
    c = as_model(load_module(str(bare / "model.pt"), "tiny")).embed(files, align=False, batch_size=15)
    assert np.abs(a - c).max() < 1e-5
    val = str(tmp_path / "v.bin")
    make_bin([held, val, "--pairs", "10"])
    capsys.readouterr()
    verify([onnx_path, "--bin", val])  # equal embeddings above: equal results (the slow test compares)
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[0] == "v.bin" and 0 <= float(row[2]) <= 1 and float(row[4]) > 0


def test_unreadable_onnx_and_missing_inputs_are_one_line_errors(tmp_path, capsys):
    from shardface.checkpoint.files import CheckpointError
    from shardface.infer.model import load_module
    from shardface.scripts.embed import main as embed

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match=r"bad.onnx: not a readable ONNX model"):
        load_module(str(bad))
    with pytest.raises(CheckpointError, match=r"gone.onnx: ONNX model not found"):
        load_module(str(tmp_path / "gone.onnx"))
    out = str(tmp_path / "e.npy")
    assert embed([str(bad), str(tmp_path / "nowhere.jpg"), "--out", out]) == 2
    assert re.match(r"error: .*nowhere.jpg: no such image file or folder\n$", capsys.readouterr().err)
    assert embed([str(bad), str(bad), "--out", str(tmp_path / "no" / "e.npy")]) == 2
    assert re.match(r"error: --out .*e.npy: the directory .*no does not exist", capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["bad.onnx"]


def test_training_on_wrong_size_images_is_refused_before_any_step(tmp_path):
    from shardface import train

    root = _folder(tmp_path / "f", [[(112, 92)] * 4, [(112, 112)] * 4])
    out = str(tmp_path / "run")
    with pytest.raises(ImageSizeError, match=r"4 images are not 112x112 .*id0/0.png \(92x112\)"):
        train.main(
            [
                "configs/demo.py",
                "--rec",
                root,
                "--num_classes",
                "2",
                "--batch_size",
                "2",
                "--num_workers",
                "0",
                "--val_targets",
                "[]",
                "--output",
                out,
            ]
        )
    assert not os.path.exists(out)  # nothing is written before the data are accepted


def test_undecodable_sampled_record_fails_at_start_unless_skipped(tmp_path):
    good = encoded(Image.fromarray(RGB), "PNG")
    out = str(tmp_path / "rec")
    write_insightface_rec(out, [[b"not an image", good, good]], 3, 1)
    with pytest.raises(ImageDecodeError, match=r"train.rec key 1: cannot read image"):
        build_dataset(out, 1)
    assert len(build_dataset(out, 1, skip_bad_images=True)) == 3


def test_ijb_takes_an_onnx_model_and_finds_the_constructed_tar(tmp_path, capsys):
    from shardface.scripts.export_onnx import export
    from shardface.scripts.ijb import main as ijb
    from tests.ijb_fixture import MeanColour, make_ijb_fixture

    make_ijb_fixture(tmp_path)
    onnx_path = str(tmp_path / "mean_colour.onnx")
    export(MeanColour(), onnx_path)
    ijb([onnx_path, "--root", str(tmp_path), "--target", "IJBC", "--batch-size", "16"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1e-06: 0.7000" in line and "1e-01: 0.8000" in line
