"""Your own photos: every Pillow format and mode decodes to RGB in one defined way, images that
are not 112x112 are refused at start (naming files) unless resized, pack_rec never loses an
earlier set, skip_bad_images works on folders, make_bin writes an insightface .bin."""
import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from dataset import DataError, ImageDecodeError, MXFaceDataset, build_dataset
from dataset.errors import ImageSizeError
from dataset.images import decode_chw, to_rgb
from dataset.pack import write_insightface_rec
from eval.verification import load_bin
from scripts.make_bin import main as make_bin
from scripts.pack_rec import main as pack_rec

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
    ("png-gray-alpha", encoded(Image.fromarray(np.dstack([GRAY, ALPHA])), "PNG"),
     gray3(on_black(gray3(GRAY), ALPHA)[..., 0])),
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
        img = Image.fromarray(words).convert(mode) if mode == "I" else Image.frombytes(
            "I;16B", (4, 1), words.astype(">u2").tobytes())
        assert np.asarray(to_rgb(img))[0, :, 0].tolist() == [0, 1, 128, 255], mode


def test_palette_with_transparency_is_composited_on_black():
    img = Image.fromarray(RGB).quantize(16)
    img.info["transparency"] = 0
    data = encoded(img, "PNG", transparency=0)
    opaque = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int64)
    index = np.asarray(Image.open(io.BytesIO(data)))
    expected = np.where((index == 0)[..., None], 0, opaque)
    np.testing.assert_array_equal(pixels(data), expected)


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
    with pytest.raises(SystemExit, match=r"2 images are not 112x112 .*id0/0.pgm \(92x112\).*--resize"):
        pack_rec([root, out])
    assert not os.path.exists(out)
    pack_rec([root, out, "--resize"])
    data = build_dataset(out, 2, normalize=False)
    assert [tuple(data[i][0].shape) for i in range(4)] == [(3, 112, 112)] * 4


def test_property_disagreeing_with_records_or_not_112_is_refused_at_start(tmp_path):
    small = encoded(Image.fromarray(RGB[:, :92]), "PNG")
    out = str(tmp_path / "rec")
    write_insightface_rec(out, [[small] * 3, [encoded(Image.fromarray(RGB), "PNG")] * 3], 6, 2)
    with pytest.raises(ImageSizeError, match=r"property says 112x112, but 3 of 6 sampled records .*key 1 \(92x112\)"):
        build_dataset(out, 2)
    with open(os.path.join(out, "property"), "w") as f:
        f.write("2,250,250\n")
    with pytest.raises(ImageSizeError, match=r"property: images are 250x250, not 112x112"):
        build_dataset(out, 2)


def test_a_wrong_size_record_missed_by_the_sample_is_named_when_read(tmp_path):
    good = encoded(Image.fromarray(RGB), "PNG")
    out = str(tmp_path / "rec")
    write_insightface_rec(out, [[good] * 20, [good] * 9 + [encoded(Image.fromarray(RGB[:, :92]), "PNG")] + [good] * 10],
                          40, 2)
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


def test_pack_list_naming_a_missing_image_is_refused_before_writing(tmp_path):
    out, before = _old_set(tmp_path)
    listing = tmp_path / "list.txt"
    listing.write_text("old/id0/0.png\t0\nold/id0/gone.png\t0\n")
    with pytest.raises(SystemExit, match=r"old/id0/gone.png: image file not found"):
        pack_rec([str(listing), out, "--overwrite"])
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
    files = {open(os.path.join(root, d, f), "rb").read(): d for d in os.listdir(root)
             for f in os.listdir(os.path.join(root, d))}
    assert [files[bins[2 * i]] == files[bins[2 * i + 1]] for i in range(20)] == issame
    assert len({(bins[2 * i], bins[2 * i + 1]) for i in range(20)}) == 20  # no pair twice
    (images, _), read_issame = load_bin(a, min_pairs=10)
    assert images.shape == (40, 3, 112, 112) and read_issame == issame


def test_make_bin_refusals_name_the_problem_and_write_nothing(tmp_path):
    root = _folder(tmp_path / "held", [[(112, 112)] * 2] * 3)
    out = str(tmp_path / "v.bin")
    with pytest.raises(SystemExit, match=r"3 same-identity pairs exist .* 10 needed: pass --pairs 6 or fewer"):
        make_bin([root, out, "--pairs", "20"])
    odd = _folder(tmp_path / "odd", [[(112, 92)] * 6] * 3)
    with pytest.raises(SystemExit, match=r"not 112x112 .*--resize"):
        make_bin([odd, out, "--pairs", "10"])
    assert not os.path.exists(out) and sorted(os.listdir(tmp_path)) == ["held", "odd"]
    make_bin([odd, out, "--pairs", "10", "--resize"])
    assert load_bin(out)[0][0].shape == (20, 3, 112, 112)
