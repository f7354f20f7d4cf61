"""Pair lists (eval.pairs, infer.pair_photos, make_bin and verify --pairs_list): both formats read
in order with their folds, bad lines named by line number, missing images refused in one line
before any work, no pair dropped (fallback faces counted and named, retries recovering faces),
a list-made .bin scored on the list's folds, verify from photos equal to verify from that .bin
for a 112 model, and the caches reused (a second model detects nothing, a second run embeds
nothing). Fixtures: scikit-image's astronaut head and variants, faceless images, tiny models."""

import os

import numpy as np
import pytest
from PIL import Image

import shardface.faces.detect
from shardface.eval.pairs import PairListError, contiguous_folds, read_pair_list
from shardface.eval.verification import _folds, load_bin
from shardface.faces.align import ARCFACE_112, align, similarity_transform
from shardface.faces.detect import Detection, Face, five_from_dlib5, load_photo
from shardface.faces.dlib_chip import chip_transform
from shardface.faces.fallback import Fallback
from shardface.infer.embed import embed
from shardface.infer.model import load_model
from shardface.infer.pair_photos import EmbeddingCache, FacesCache, cache_paths, pair_embeddings, pair_faces
from shardface.scripts.make_bin import main as make_bin
from shardface.scripts.verify import main as verify
from tests.gallery_files import seeded_model
from tests.lfw_folder import DIFF, SAME, lfw_folder, lfw_list


@pytest.fixture(scope="module")
def lfw(tmp_path_factory) -> str:
    return lfw_folder(tmp_path_factory.mktemp("lfw"))


@pytest.fixture
def counted(monkeypatch) -> list:
    """Every face search run (shardface.faces.detect.Detection.faces calls shardface.faces.detect.detect_faces)."""
    calls = []
    real = shardface.faces.detect.detect_faces

    def counting(img, *args, **kwargs):
        calls.append(args)
        return real(img, *args, **kwargs)

    monkeypatch.setattr(shardface.faces.detect, "detect_faces", counting)
    return calls


def _kfold(n: int) -> list[tuple[int, int]]:
    """verification's folds of n pairs, as [start, stop) of each test fold."""
    return [(int(t[0]), int(t[-1]) + 1) for _, t in _folds(10).split(np.arange(n))]


def test_lfw_pairs_txt_read_in_order_with_view2_folds(tmp_path):
    same = [f"A{i} 1 {i + 2}" for i in range(20)]
    diff = [f"A{i} {i + 1} B{i} 3" for i in range(20)]
    lines = ["10 2"] + [line for k in range(10) for line in same[2 * k : 2 * k + 2] + diff[2 * k : 2 * k + 2]]
    (tmp_path / "pairs.txt").write_text("\n".join(lines) + "\n")
    got = read_pair_list(str(tmp_path / "pairs.txt"), "F")
    assert got.format == "lfw" and len(got.pairs) == 40
    assert got.pairs[0] == (os.path.join("F", "A0", "A0_0001.jpg"), os.path.join("F", "A0", "A0_0002.jpg"))
    assert got.pairs[2] == (os.path.join("F", "A0", "A0_0001.jpg"), os.path.join("F", "B0", "B0_0003.jpg"))
    assert got.issame == [True, True, False, False] * 10
    assert got.lines == list(range(2, 42))
    assert got.folds == [(4 * k, 4 * k + 4) for k in range(10)] == _kfold(40)


def test_plain_list_read_in_order_with_verification_folds(tmp_path):
    lines = (
        ["# my pairs", ""]
        + [f"p{i}/a.jpg p{i}/b.png {i % 2}" for i in range(22)]
        + ["x y/1.jpg\tz w/2.jpg\t1"]
    )
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    got = read_pair_list(str(tmp_path / "list.txt"), "F")
    assert got.format == "plain" and len(got.pairs) == 23
    assert (
        got.pairs[5] == (os.path.join("F", "p5/a.jpg"), os.path.join("F", "p5/b.png")) and got.lines[5] == 8
    )
    assert got.pairs[-1] == (os.path.join("F", "x y/1.jpg"), os.path.join("F", "z w/2.jpg"))
    assert got.issame == [bool(i % 2) for i in range(22)] + [True]
    assert got.folds == contiguous_folds(23) == _kfold(23)
    assert got.photos[:3] == [os.path.join("F", p) for p in ("p0/a.jpg", "p0/b.png", "p1/a.jpg")]


LFW_HEAD = ["10\t1", "A\t1\t2", "A\t1\tB\t1"]


@pytest.mark.parametrize(
    "lines,where",
    [
        (LFW_HEAD + ["A\t1"], ":4:"),  # two fields
        (LFW_HEAD + ["A\tx\t2"], ":4:"),  # not a number
        (LFW_HEAD + ["A\t0\t2"], ":4:"),  # LFW counts from 1
        (["5\t2"] + LFW_HEAD[1:], ":1:"),  # folds verification does not score
        ([f"a{i} b{i} 1" for i in range(12)] + ["a b 2"], ":13:"),  # a label that is not 1 or 0
        ([f"a{i} b{i} 1" for i in range(3)] + ["a b"], ":4:"),  # two fields
    ],
)
def test_a_bad_line_is_one_error_naming_file_and_line(tmp_path, lines, where):
    path = tmp_path / "pairs.txt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PairListError) as err:
        read_pair_list(str(path), "F")
    message = str(err.value)
    assert f"{path}{where}" in message and "\n" not in message


def test_lfw_list_of_the_wrong_length_or_mix_is_refused(tmp_path):
    path = tmp_path / "pairs.txt"
    path.write_text("\n".join(LFW_HEAD * 1 + ["A\t1\t3"] * 18) + "\n")  # 20 pairs, fold 2 holds two same
    with pytest.raises(PairListError, match="fold 2 .* holds 2 same and 0 different"):
        read_pair_list(str(path), "F")
    path.write_text("\n".join(LFW_HEAD) + "\n")
    with pytest.raises(PairListError, match="20 in all; the file holds 2"):
        read_pair_list(str(path), "F")


def test_missing_images_are_one_error_line_before_any_work(lfw, tmp_path, capsys, counted):
    pairs = lfw_list(
        tmp_path / "pairs.txt", same=["Eileen 1 9"] + SAME[1:], diff=DIFF[:4] + ["Nobody 1 Wall 1"] + DIFF[5:]
    )
    out = str(tmp_path / "v.bin")
    assert make_bin([lfw, out, "--pairs_list", pairs, "--align"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "2 of the 11 images" in err
    assert os.path.join(lfw, "Eileen", "Eileen_0009.jpg") in err and "(line 2)" in err
    assert not os.path.exists(out) and not counted
    assert not [f for f in os.listdir(tmp_path) if f != "pairs.txt"]  # no cache either
    model = seeded_model(str(tmp_path / "m"), 0)
    assert verify([model, "--pairs_list", pairs, "--images", lfw]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Eileen_0009.jpg" in err and not counted


def test_fallback_of_a_one_face_set_cuts_that_face_s_chip_alike_in_any_photo_size(lfw):
    """dlib cuts its chip through the similarity that best maps its reference onto the shape: the
    fallback of a set of one face is that similarity's image of the reference, so the same chip."""
    photo = load_photo(os.path.join(lfw, "Eileen", "Eileen_0001.jpg"))
    face = Detection().faces(photo)[0]
    (w, h), fallback = photo.size, Fallback.of([(face, photo.size)])
    same = fallback.face(photo.size)
    assert np.allclose(chip_transform(same.shape), chip_transform(face.shape), atol=1e-6)
    assert np.allclose(same.points, five_from_dlib5(same.shape)) and same.score == 0.0
    bigger = fallback.face((2 * w, 2 * h))  # relative to the photo: twice the size, about the centre
    centre, centre2 = np.array([(w - 1) / 2, (h - 1) / 2]), np.array([(2 * w - 1) / 2, (2 * h - 1) / 2])
    assert np.allclose(bigger.shape, (same.shape - centre) * 2 + centre2, atol=1e-6)
    no_shape = Fallback.of([(Face(face.box, face.points, face.score, None), photo.size)]).face(photo.size)
    to_112 = [similarity_transform(ARCFACE_112.points, f.points) for f in (no_shape, face)]
    # fitted to the five points: within 0.1 px
    assert no_shape.shape is None and np.allclose(*to_112, atol=0.1)


def test_make_bin_writes_every_pair_in_list_order_and_names_the_fallbacks(lfw, tmp_path, capsys, monkeypatch):
    import shardface.scripts.make_bin

    pairs = lfw_list(tmp_path / "pairs.txt")
    out = str(tmp_path / "v.bin")
    aligned = []
    real = shardface.scripts.make_bin.aligned_pngs
    monkeypatch.setattr(
        shardface.scripts.make_bin,
        "aligned_pngs",
        lambda ps, *a, **k: aligned.extend(ps) or real(ps, *a, **k),
    )
    assert make_bin([lfw, out, "--pairs_list", pairs, "--align"]) == 0
    said = capsys.readouterr().out
    faceless = [
        os.path.join(lfw, n) for n in ("Wall/Wall_0001.jpg", "Tiny/Tiny_0001.jpg", "Wall/Wall_0002.jpg")
    ]
    assert "no face found in 3 of 9 photos (in 8 of 20 pairs)" in said
    assert all(p in said for p in faceless)
    pair_list = read_pair_list(pairs, lfw)
    assert sorted(aligned) == sorted(pair_list.photos)  # each photo aligned once
    (images, _), issame = load_bin(out)
    assert issame == pair_list.issame and len(images) == 40
    assert _kfold(len(issame)) == pair_list.folds  # verify's folds are the list's
    found = pair_faces(pair_list.photos, Detection(), show_progress=False)
    assert sorted(found.fallbacks) == sorted(faceless)
    for i in (0, 5, 13):  # pairs in the list's order, each image the crop of its photo's face (or fallback)
        for j, path in enumerate(pair_list.pairs[i]):
            crop = np.asarray(align(load_photo(path), found.faces[path].points, ARCFACE_112))
            assert np.array_equal(images[2 * i + j].permute(1, 2, 0).numpy(), crop)
    assert make_bin([lfw, out, "--pairs_list", pairs, "--align", "--strict", "--overwrite"]) == 2
    assert "--strict refuses them" in capsys.readouterr().err


def test_make_bin_from_a_plain_list_of_crops_stores_them_in_list_order(tmp_path):
    rng = np.random.default_rng(0)
    os.makedirs(tmp_path / "crops")
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(
            tmp_path / "crops" / f"{i}.png"
        )
    order = [(i % 4, (i * 3 + 1) % 4, i % 2) for i in range(11)]
    (tmp_path / "list.txt").write_text("".join(f"{a}.png {b}.png {s}\n" for a, b, s in order))
    out = str(tmp_path / "v.bin")
    assert make_bin([str(tmp_path / "crops"), out, "--pairs_list", str(tmp_path / "list.txt")]) == 0
    (images, _), issame = load_bin(out)
    assert issame == [bool(s) for _, _, s in order]
    for i, (a, b, _) in enumerate(order):
        for j, name in enumerate((a, b)):
            expected = np.asarray(Image.open(tmp_path / "crops" / f"{name}.png"))
            assert np.array_equal(images[2 * i + j].permute(1, 2, 0).numpy(), expected)
    assert (
        make_bin(
            [
                str(tmp_path / "crops"),
                out,
                "--pairs_list",
                str(tmp_path / "list.txt"),
                "--overwrite",
                "--seed",
                "1",
            ]
        )
        == 2
    )


def test_retries_recover_faces_and_say_how_many(lfw, tmp_path, capsys):
    pairs = lfw_list(tmp_path / "pairs.txt")
    out = str(tmp_path / "v.bin")
    assert make_bin([lfw, out, "--pairs_list", pairs, "--align", "--retry_upsample", "2"]) == 0
    said = capsys.readouterr().out
    assert "--retry_upsample 2: a face found in 1 of the 3 photos searched again" in said
    assert "no face found in 2 of 9 photos" in said and "Tiny_0001" not in said.split("no face found")[1]
    plain = tmp_path / "masked.txt"
    names = [
        "Eileen/Eileen_0001.jpg",
        "Masked/Masked_0001.jpg",
        "Mirror/Mirror_0001.jpg",
        "Wall/Wall_0001.jpg",
    ]
    plain.write_text("".join(f"{names[i % 4]} {names[(i + 1) % 4]} 0\n" for i in range(10)))
    assert (
        make_bin(
            [
                lfw,
                out,
                "--pairs_list",
                str(plain),
                "--align",
                "--upsample",
                "0",
                "--retry_mmod",
                "--overwrite",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "--retry_mmod: a face found in 1 of the 2 photos searched again" in said
    assert "no face found in 1 of 4 photos" in said


def test_verify_from_photos_equals_verify_from_the_list_bin_for_a_112_model(lfw, tmp_path, capsys):
    pairs = lfw_list(tmp_path / "pairs.txt")
    out = str(tmp_path / "v.bin")
    model_path = seeded_model(str(tmp_path / "m"), 1)
    assert make_bin([lfw, out, "--pairs_list", pairs, "--align"]) == 0
    capsys.readouterr()
    before = sorted(os.listdir(tmp_path))
    assert (
        verify([model_path, "--bin", out, "--pairs_list", pairs, "--images", lfw, "--batch_size", "8"]) == 0
    )
    table = capsys.readouterr().out

    def row(name):
        return next(line for line in table.splitlines() if line.startswith(name)).split()[1:]

    assert row("pairs.txt") == row("v.bin")  # acc, acc-flip, std, XNorm
    # no .bin written
    assert not [f for f in os.listdir(tmp_path) if f not in before and not f.endswith(".sqlite")]
    model = load_model(model_path)
    (images, mirrored), _ = load_bin(out)
    pair_list = read_pair_list(pairs, lfw)
    emb = pair_embeddings(
        model, pair_list.photos, pair_faces(pair_list.photos, show_progress=False), batch_size=8
    )
    rows = pair_list.rows()
    assert np.allclose(emb.emb[rows], embed(images, model.module, 8), atol=1e-5)
    assert np.allclose(emb.emb_flip[rows], embed(mirrored, model.module, 8), atol=1e-5)


def test_a_second_model_reuses_the_detections_and_a_second_run_the_embeddings(lfw, tmp_path, capsys, counted):
    pairs = lfw_list(tmp_path / "pairs.txt")
    cache = tmp_path / "cache"
    os.makedirs(cache)
    # searched in this process, where `counted` sees them
    assert (
        make_bin(
            [
                lfw,
                str(tmp_path / "v.bin"),
                "--pairs_list",
                pairs,
                "--align",
                "--cache_dir",
                str(cache),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert (
        len(counted) == 9
        and "faces: 9 photo searches run, 0 answered by the cache" in capsys.readouterr().out
    )
    a, b = seeded_model(str(tmp_path / "a"), 2), seeded_model(str(tmp_path / "b"), 3)
    assert (
        verify([a, "--pairs_list", pairs, "--images", lfw, "--cache_dir", str(cache), "--workers", "1"]) == 0
    )
    said = capsys.readouterr().out
    assert len(counted) == 9 and "faces: 0 photo searches run, 9 answered by the cache" in said
    assert "embeddings: 9 photos embedded, 0 from the cache" in said
    faces_file, b_file = cache_paths(pairs, load_model(b).fingerprint, str(cache))
    model_b, photos = load_model(b), read_pair_list(pairs, lfw).photos
    # what verify runs for model b
    found = pair_faces(photos, cache=FacesCache(faces_file), show_progress=False)
    assert len(counted) == 9 and found.searched == 0 and len(found.fallbacks) == 3
    first = pair_embeddings(model_b, photos, found, EmbeddingCache(b_file, model_b), show_progress=False)
    again = pair_embeddings(model_b, photos, found, EmbeddingCache(b_file, model_b), show_progress=False)
    assert (first.embedded, again.embedded) == (9, 0) and np.array_equal(first.emb, again.emb)
    assert sorted(os.listdir(cache)) == sorted(
        [
            "pairs.txt.shardface_faces.sqlite",
            os.path.basename(b_file),
            f"pairs.txt.shardface_pairs.{load_model(a).fingerprint}.sqlite",
        ]
    )
    (cache / "pairs.txt.shardface_faces.sqlite").write_text("cut short")  # one of ours, damaged
    assert verify([a, "--pairs_list", pairs, "--images", lfw, "--cache_dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert (
        "a damaged ShardFace pair-list cache file" in err
        and "delete it (it is made again) or pass --cache_dir" in err
    )
    assert (cache / "pairs.txt.shardface_faces.sqlite").read_text() == "cut short"


@pytest.mark.parametrize(
    "lines,where",
    [
        (["10\t\u00b3"] + LFW_HEAD[1:], ":1:"),  # a superscript three: isdigit() says yes, int() no
        (LFW_HEAD + ["A\t\u00b3\t2"], ":4:"),
        (LFW_HEAD + ["A\t1\tB\t\u00b2"], ":4:"),
    ],
)
def test_unicode_digits_int_refuses_are_a_bad_line_not_a_traceback(tmp_path, lines, where):
    path = tmp_path / "pairs.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(PairListError) as err:
        read_pair_list(str(path), "F")
    assert f"{path}{where}" in str(err.value) and "\n" not in str(err.value)


def test_lfw_pairs_txt_with_a_utf8_bom_is_still_lfw(tmp_path):
    """An editor's byte-order mark is not part of the header: the list stays LFW's, not a plain list."""
    same = [f"A{i} 1 {i + 2}" for i in range(10)]
    diff = [f"A{i} {i + 1} B{i} 3" for i in range(10)]
    path = tmp_path / "pairs.txt"
    path.write_bytes(
        b"\xef\xbb\xbf" + "\n".join(["10 1"] + [x for s, d in zip(same, diff) for x in (s, d)]).encode()
    )
    got = read_pair_list(str(path), "F")
    assert (
        got.format == "lfw" and len(got.pairs) == 20 and got.folds == [(2 * k, 2 * k + 2) for k in range(10)]
    )


def test_verify_of_a_list_from_a_pipe_refuses_its_cache_place_before_searching_any_photo(
    lfw, tmp_path, capsys, counted
):
    """verify --pairs_list <(...): the list is /dev/fd/N, where no cache can be saved, not even by
    root (os.access says yes to root there): refused before the photos are searched, saying how."""
    model = seeded_model(str(tmp_path / "m"), 0)
    text = open(lfw_list(tmp_path / "pairs.txt")).read().encode()
    r, w = os.pipe()
    try:
        os.write(w, text)
        os.close(w)
        capsys.readouterr()
        assert verify([model, "--pairs_list", f"/dev/fd/{r}", "--images", lfw]) == 2
    finally:
        os.close(r)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"/dev/fd/{r}.shardface_faces.sqlite" in err and "--cache_dir" in err
    assert not counted


def test_absolute_paths_of_a_plain_list_are_read_where_they_point_and_the_help_says_so(tmp_path, capsys):
    outside = str(tmp_path / "elsewhere" / "a.jpg")
    lines = [f"{outside} p{i}/b.jpg {i % 2}" for i in range(10)]
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    got = read_pair_list(str(tmp_path / "list.txt"), str(tmp_path / "images"))
    assert got.pairs[0] == (outside, str(tmp_path / "images" / "p0/b.jpg"))
    for tool in (verify, make_bin):
        with pytest.raises(SystemExit):
            tool(["--help"])
        assert "absolute path is read where it points, even outside" in " ".join(
            capsys.readouterr().out.split()
        )
