"""Faces in real photos (scikit-image's astronaut, a public-domain portrait): detection and
landmarks, alignment onto insightface's template checked by finding the landmarks again in the
crop, scripts.align's crops and report, and `--align` in pack_rec, make_bin, embed, compare and
image-folder training. Photos are small (detection on a CPU) and detected once per session."""

import csv
import json
import os
import socket

import numpy as np
import pytest
import torch
from PIL import Image, ImageEnhance

from shardface.faces.align import ARCFACE_112, align, similarity_transform
from shardface.faces.detect import Face, check_available, detect_faces
from shardface.faces.models import ModelFileError, model_file
from tests.astronaut import astronaut_head, two_faces_photo


@pytest.fixture(scope="session")
def head() -> Image.Image:
    return astronaut_head()


@pytest.fixture(scope="session")
def head_faces(head) -> list[Face]:
    return detect_faces(head)


@pytest.fixture(scope="session")
def photos(tmp_path_factory) -> str:
    """photos/eileen: four photos of her face (one with a second, smaller copy of it) and one
    without a face; photos/mirror: four mirrored photos; photos/nobody: one photo, no face."""
    root = tmp_path_factory.mktemp("photos")
    head = astronaut_head()
    variants = {
        "one.jpg": head,
        "two.png": two_faces_photo(head),
        "dark.png": ImageEnhance.Brightness(head).enhance(0.7),
        "turned.png": head.rotate(12, resample=Image.BILINEAR, fillcolor=(90, 90, 90)),
    }
    for person, flip in (("eileen", False), ("mirror", True)):
        os.makedirs(root / person)
        for name, img in variants.items():
            (img.transpose(Image.FLIP_LEFT_RIGHT) if flip else img).save(root / person / name)
    Image.new("RGB", (160, 160), (120, 140, 160)).save(root / "eileen" / "wall.png")
    os.makedirs(root / "nobody")
    Image.new("RGB", (160, 160), (200, 180, 160)).save(root / "nobody" / "floor.png")
    return str(root)


@pytest.fixture(scope="session")
def aligned(photos, tmp_path_factory) -> tuple[str, str]:
    """scripts.align run once on `photos`: (output folder, its stdout)."""
    import contextlib
    import io

    from shardface.scripts.align import main as align_tool

    dst = str(tmp_path_factory.mktemp("aligned") / "crops")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert align_tool([photos, dst]) == 0
    return dst, out.getvalue()


def _redetected_eyes(crop: Image.Image) -> np.ndarray:
    """The eye centres found again in a 112x112 crop (searched 4x upscaled, 68-point model)."""
    faces = detect_faces(crop.resize((448, 448), Image.BICUBIC), upsample=0, landmarks="68")
    assert faces, "no face found again in the crop"
    return faces[0].points[:2] / 4 + 0.375  # pixel centres at 448 -> at 112


def test_a_face_is_found_with_five_landmarks_in_insightface_order(head_faces):
    assert len(head_faces) == 1
    face = head_faces[0]
    x0, y0, x1, y1 = face.box
    left_eye, right_eye, nose, mouth_left, mouth_right = face.points
    assert face.score > 0 and 60 < x1 - x0 < 130
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in face.points)
    assert left_eye[0] < nose[0] < right_eye[0] and mouth_left[0] < nose[0] < mouth_right[0]
    assert max(left_eye[1], right_eye[1]) < nose[1] < min(mouth_left[1], mouth_right[1])
    # against the 68-point model's five points: the eyes agree; the mouth corners, which the
    # 5-point model does not see, differ most on this broad smile, yet the two alignments put
    # the 68-point model's points within a few pixels of each other at 112
    reference = detect_faces(astronaut_head(), landmarks="68")[0].points
    assert np.abs(face.points[:2] - reference[:2]).max() < 2
    h = np.c_[reference, np.ones(5)]
    by_5, by_68 = (similarity_transform(p, ARCFACE_112.points) for p in (face.points, reference))
    assert np.linalg.norm(h @ by_5.T - h @ by_68.T, axis=1).mean() < 4


def test_aligned_crop_puts_eyes_within_pixels_of_the_template_and_a_resize_misses_by_tens(head, head_faces):
    from skimage import data

    portrait = Image.fromarray(data.astronaut())  # the whole 512x512 portrait, as a user has it
    face = detect_faces(portrait, upsample=0)[0]
    for photo, landmarks in ((head, head_faces[0].points), (portrait, face.points)):
        crop = align(photo, landmarks, ARCFACE_112)
        assert crop.size == (112, 112)
        assert np.linalg.norm(_redetected_eyes(crop) - ARCFACE_112.points[:2], axis=1).max() < 4
    # --resize squeezes the portrait into 112x112: the eyes land where the resize maps them
    resized = (face.points[:2] + 0.5) * 112 / 512 - 0.5
    assert np.linalg.norm(resized - ARCFACE_112.points[:2], axis=1).min() > 20


def test_several_faces_come_largest_first(head):
    faces = detect_faces(two_faces_photo(head))
    assert len(faces) == 2 and faces[0].area > 2 * faces[1].area
    assert faces[0].box[2] < 220 <= faces[1].box[0]  # the large face is the left one


def test_no_face_is_an_empty_list_and_upsample_finds_small_faces(head):
    assert detect_faces(Image.new("RGB", (160, 160), (120, 140, 160))) == []
    small = head.resize((100, 110), Image.BILINEAR)  # a face of about 45 px
    assert detect_faces(small, upsample=0) == [] and len(detect_faces(small, upsample=1)) == 1


def test_a_missing_model_file_or_unknown_detector_fails_at_once():
    with pytest.raises(ModelFileError, match="not one of"):
        model_file("shape_predictor_194.dat")
    with pytest.raises(ValueError, match="one of hog, mmod"):
        check_available("haar")
    assert os.path.getsize(model_file("shape_predictor_5_face_landmarks.dat")) > 0


@pytest.mark.slow
def test_mmod_detector_finds_the_face_where_hog_does(head, head_faces):
    faces = detect_faces(head, detector="mmod", upsample=0)
    assert len(faces) == 1
    assert np.abs(faces[0].points - head_faces[0].points).max() < 6


# ----- scripts.align -------------------------------------------------------------------------------


def _report(dst: str) -> list[dict]:
    with open(os.path.join(dst, "align_report.csv")) as f:
        return list(csv.DictReader(f))


def test_align_writes_a_crop_per_face_keeping_folders_largest_by_its_name(aligned):
    dst, _ = aligned
    crops = sorted(
        os.path.relpath(os.path.join(d, f), dst)
        for d, _, fs in os.walk(dst)
        for f in fs
        if f.endswith(".png")
    )
    assert crops == [
        f"{p}/{n}"
        for p in ("eileen", "mirror")
        for n in ("dark.png", "one.png", "turned.png", "two.face2.png", "two.png")
    ]
    big, small = (
        Image.open(os.path.join(dst, "eileen/two.png")),
        Image.open(os.path.join(dst, "eileen/two.face2.png")),
    )
    assert big.size == small.size == (112, 112)
    # both crops are the same face aligned alike: the eyes found again agree with the template
    for crop in (big, small):
        assert np.linalg.norm(_redetected_eyes(crop) - ARCFACE_112.points[:2], axis=1).max() < 5


def test_align_reports_every_photo_and_counts_and_names_those_without_a_face(aligned):
    dst, out = aligned
    rows = _report(dst)
    assert sorted({r["photo"] for r in rows}) == sorted(
        [f"{p}/{n}" for p in ("eileen", "mirror") for n in ("dark.png", "one.jpg", "turned.png", "two.png")]
        + ["eileen/wall.png", "nobody/floor.png"]
    )
    two = [r for r in rows if r["photo"] == "eileen/two.png"]
    assert [(r["faces"], r["face"], r["crop"]) for r in two] == [
        ("2", "1", "eileen/two.png"),
        ("2", "2", "eileen/two.face2.png"),
    ]
    assert float(two[0]["x1"]) - float(two[0]["x0"]) > float(two[1]["x1"]) - float(two[1]["x0"])
    assert float(two[0]["left_eye_x"]) < float(two[0]["right_eye_x"]) and float(two[0]["score"]) > 0
    empty = [r for r in rows if r["faces"] == "0"]
    assert sorted(r["photo"] for r in empty) == ["eileen/wall.png", "nobody/floor.png"]
    assert all(r["crop"] == "" and r["x0"] == "" for r in empty)
    assert "no face found in 2 of 10 photos" in out and "wall.png" in out and "floor.png" in out


def test_align_refusals_write_nothing(photos, tmp_path, capsys):
    from shardface.scripts.align import main as align_tool

    inside = os.path.join(photos, "eileen", "out")
    for argv, message in (
        ([photos, inside], "is inside"),
        ([photos, str(tmp_path / "no" / "out")], "does not exist; create it first"),
        ([str(tmp_path / "gone"), str(tmp_path / "out")], "photo folder not found"),
        ([photos, str(tmp_path / "out"), "--detector", "mmod", "--upsample", "-1"], "--upsample"),
    ):
        assert align_tool(argv) == 2
        assert message in capsys.readouterr().err
    assert not os.path.exists(inside) and os.listdir(tmp_path) == []
    bad = tmp_path / "bad" / "p"
    os.makedirs(bad)
    Image.new("RGB", (50, 50)).save(bad / "ok.png")
    (bad / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    assert align_tool([str(tmp_path / "bad"), str(tmp_path / "out")]) == 2
    assert "broken.jpg" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["bad"]
    os.makedirs(tmp_path / "out")
    (tmp_path / "out" / "kept").write_text("x")
    assert align_tool([str(tmp_path / "bad"), str(tmp_path / "out")]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == ["kept"]


# ----- --align in the tools and in training --------------------------------------------------------


def _people(photos: str, tmp_path, names=("eileen", "mirror")):
    """A photo folder of some of `photos`' people (links)."""
    src = tmp_path / "src"
    os.makedirs(src)
    for person in names:
        os.symlink(os.path.join(photos, person), src / person)
    return src


def test_pack_rec_align_packs_largest_faces_leaves_out_and_names_the_rest_strict_refuses(
    photos, tmp_path, caplog, capsys
):
    from shardface.dataset import MXFaceDataset
    from shardface.scripts.pack_rec import main as pack_rec

    src = _people(photos, tmp_path)  # the two people with faces (nobody has none: refused, below)
    assert pack_rec([str(src), str(tmp_path / "strict"), "--align", "--strict"]) == 2
    err = capsys.readouterr().err
    assert "no face found in 1 of 9 photos" in err and "eileen/wall.png" in err and "--strict" in err
    assert pack_rec([photos, str(tmp_path / "with_nobody"), "--align"]) == 2
    assert "nobody: no face found in any of its 1 photos" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]
    out = str(tmp_path / "rec")
    assert pack_rec([str(src), out, "--align"]) == 0
    assert "wall.png" in caplog.text and "2 further faces" in caplog.text  # two.png's second face, twice
    data = MXFaceDataset(out, train=False, normalize=False)
    assert (
        len(data) == 8
        and data.num_classes == 2
        and open(os.path.join(out, "property")).read().strip() == "2,112,112"
    )
    image, label = data.load(0)
    assert tuple(image.shape) == (3, 112, 112) and label == 0


def test_align_options_refuse_resize_with_align(photos, tmp_path, capsys):
    from shardface.scripts.pack_rec import main as pack_rec

    assert pack_rec([photos, str(tmp_path / "rec"), "--align", "--resize"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from shardface.backbones import get_model

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("model")
    torch.save(get_model("tiny", num_features=32).eval().state_dict(), root / "model.pt")
    json.dump({"network": "tiny"}, open(root / "config.json", "w"))
    return str(root / "model.pt")


def test_embed_align_equals_embedding_the_align_tools_crops_and_leaves_out_faceless(
    photos, aligned, tiny_model, tmp_path, caplog, capsys
):
    from shardface.scripts.embed import main as embed

    dst, _ = aligned
    eileen = os.path.join(photos, "eileen")
    out = str(tmp_path / "e.npy")
    assert embed([tiny_model, eileen, "--out", out, "--align", "--batch_size", "3"]) == 0  # read in 2 batches
    listed = open(str(tmp_path / "e.txt")).read().splitlines()
    assert [os.path.basename(p) for p in listed] == ["dark.png", "one.jpg", "turned.png", "two.png"]
    assert "wall.png" in caplog.text
    crops = [os.path.join(dst, "eileen", n) for n in ("dark.png", "one.png", "turned.png", "two.png")]
    assert embed([tiny_model, *crops, "--out", str(tmp_path / "c.npy")]) == 0
    assert np.abs(np.load(out) - np.load(str(tmp_path / "c.npy"))).max() < 1e-5
    assert embed([tiny_model, eileen, "--out", str(tmp_path / "s.npy"), "--align", "--strict"]) == 2
    assert "wall.png" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["c.npy", "c.txt", "e.npy", "e.txt"]


def test_compare_align_compares_faces_and_refuses_a_photo_without_one(photos, tiny_model, capsys):
    from shardface.scripts.compare import main as compare

    one, two = os.path.join(photos, "eileen", "one.jpg"), os.path.join(photos, "eileen", "two.png")
    assert compare([tiny_model, one, two, "--align", "--threshold", "0.5"]) == 0
    cosine = float(capsys.readouterr().out.split("cosine similarity ")[1].split()[0])
    assert cosine > 0.999  # the same face (two.png's largest is one.jpg's head, pasted unscaled)
    assert compare([tiny_model, one, os.path.join(photos, "nobody", "floor.png"), "--align"]) == 2
    assert "floor.png" in capsys.readouterr().err


def test_make_bin_align_draws_pairs_of_aligned_faces(photos, tmp_path, capsys):
    from shardface.eval.verification import load_bin
    from shardface.scripts.make_bin import main as make_bin

    src = _people(photos, tmp_path)
    out = str(tmp_path / "v.bin")
    assert make_bin([str(src), out, "--pairs", "10", "--align", "--strict"]) == 2
    assert "wall.png" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert make_bin([str(src), out, "--pairs", "10", "--align"]) == 0
    (images, _), issame = load_bin(out)
    assert tuple(images.shape[1:]) == (3, 112, 112) and len(issame) == 10 and sum(issame) == 5


def test_training_set_align_true_yields_aligned_faces_of_photos_with_one(photos, tmp_path):
    from shardface.builders import build_train_dataset
    from shardface.configs import get_config

    src = _people(photos, tmp_path)
    cfg = get_config("configs/demo.py", ["--rec", str(src), "--num_classes", "2", "--align", "true"])
    data = build_train_dataset(cfg)
    assert len(data) == 8 and data.num_classes == 2
    image, label = data[0]
    assert image.dtype == torch.uint8 and tuple(image.shape) == (3, 112, 112)
    path = data.samples[0][0]
    expected = np.asarray(align(Image.open(path).convert("RGB"), data.faces[path].points, ARCFACE_112))
    got = image.permute(1, 2, 0).numpy()
    assert np.array_equal(got, expected) or np.array_equal(got, expected[:, ::-1])  # mirrored half the time
    cfg.resize = True
    with pytest.raises(Exception, match="choose one"):
        build_train_dataset(cfg)


def test_training_set_align_true_label_free_takes_every_photo_with_a_face_under_the_folder(photos):
    """num_classes 0 (docs/distillation.md): the sub-folders are not people; a folder whose one
    photo has no face ('nobody') is no error, as an identity without a photo would be."""
    from shardface.builders import build_train_dataset
    from shardface.configs import get_config

    cfg = get_config(
        "configs/demo.py",
        ["--rec", photos, "--num_classes", "0", "--teacher", "t.teacher", "--align", "true"],
    )
    data = build_train_dataset(cfg)
    assert len(data) == 8 and {label for _, label in data.samples} == {0}  # wall.png, floor.png: no face
    assert all(os.path.basename(os.path.dirname(p)) in ("eileen", "mirror") for p, _ in data.samples)


def test_teach_align_makes_the_rows_of_an_align_true_runs_faces_and_a_resize_file_is_refused(
    photos, tiny_model, tmp_path
):
    """scripts.teach reads the data as the run does (builders.build_train_dataset): with --align,
    row i is the teacher's embedding of the run's aligned face i; a file made from the same photos
    resized is refused by the align true run, naming both readings."""
    from shardface.builders import build_train_dataset
    from shardface.configs import get_config
    from shardface.distill.run import Distillation
    from shardface.distill.teacher import OnlineTeacher
    from shardface.distill.teacher_file import TeacherFile
    from shardface.errors import ConfigError
    from shardface.infer.model import load_model
    from shardface.scripts.teach import main as teach

    aligned_file, resized_file = str(tmp_path / "aligned.teacher"), str(tmp_path / "resized.teacher")
    assert teach([tiny_model, photos, aligned_file, "--align", "--num_workers", "0"]) == 0
    assert teach([tiny_model, photos, resized_file, "--resize", "--num_workers", "0"]) == 0
    cfg = get_config(
        "configs/demo.py",
        ["--rec", photos, "--num_classes", "0", "--teacher", aligned_file, "--align", "true"],
    )
    data = build_train_dataset(cfg, train=False)
    rows = TeacherFile(aligned_file)
    Distillation(rows, None).check_data(cfg, data)
    teacher = OnlineTeacher(load_model(tiny_model), torch.device("cpu"))
    face = data[0][0][None]
    want = torch.nn.functional.normalize(teacher.targets(face, None) + teacher.targets(face.flip(3), None))
    torch.testing.assert_close(rows.targets(face, rows.read([0])), want, rtol=0, atol=2e-3)
    with pytest.raises(
        ConfigError,
        match=f"made from {photos} read with align false, resize true; this run reads "
        f"{photos} with align true \\(detector hog\\)",
    ):
        Distillation(TeacherFile(resized_file), None).check_data(cfg, data)


def test_crop_names_keep_folders_and_tell_apart_photos_sharing_a_name():
    from shardface.scripts.align import crop_stems

    assert crop_stems(["a/p1.jpg", "a/p1.png", "a/p2.jpg", "b/p1.jpg"]) == {
        "a/p1.jpg": "a/p1.jpg",
        "a/p1.png": "a/p1.png",
        "a/p2.jpg": "a/p2",
        "b/p1.jpg": "b/p1",
    }
    # names that met before: a_jpg.png beside a.jpg + a.png; a.jpg.png beside a.jpg; k.face2.jpg beside k.jpg
    photos = ["a/a.jpg", "a/a.png", "a/a_jpg.png", "a/a.jpg.png", "k/k.jpg", "k/k.face2.jpg", "k/k.face3.png"]
    stems = crop_stems(photos)
    crops = [
        stems[p] + suffix for p in photos for suffix in [".png"] + [f".face{n}.png" for n in range(2, 5)]
    ]
    assert len(set(crops)) == len(crops), stems
    assert stems["a/a_jpg.png"] == "a/a_jpg" and stems["k/k.jpg"] == "k/k"


def test_align_writes_one_crop_file_per_reported_face_whatever_the_names(head, tmp_path):
    """a.jpg, a.png and a_jpg.png in one folder, and a two-face k.jpg beside k.face2.jpg: every
    face the report lists has its own crop file."""
    from shardface.scripts.align import main as align_tool

    os.makedirs(tmp_path / "src" / "p")
    for name in ("a.jpg", "a.png", "a_jpg.png", "k.face2.jpg"):
        head.save(tmp_path / "src" / "p" / name)
    two_faces_photo(head).save(tmp_path / "src" / "p" / "k.jpg")
    dst = str(tmp_path / "dst")
    assert align_tool([str(tmp_path / "src"), dst]) == 0
    rows = [r for r in _report(dst) if r["crop"]]
    assert len(rows) == 6 and len({r["crop"] for r in rows}) == 6
    files = sorted(
        os.path.relpath(os.path.join(d, f), dst)
        for d, _, fs in os.walk(dst)
        for f in fs
        if f.endswith(".png")
    )
    assert files == sorted(r["crop"] for r in rows)


def test_align_overwrite_swaps_folders_and_cleans_what_killed_runs_left(photos, tmp_path, capsys):
    import shutil

    from shardface.scripts.align import main as align_tool
    from tests.tool_files import dead_pid

    src = tmp_path / "src"
    shutil.copytree(os.path.join(photos, "nobody"), src / "nobody")
    (tmp_path / "out").write_text("a file")  # --overwrite onto a regular file: refused before the work
    assert align_tool([str(src), str(tmp_path / "out"), "--overwrite"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("is a file, not a directory; name a directory")
    assert (tmp_path / "out").read_text() == "a file" and sorted(os.listdir(tmp_path)) == ["out", "src"]
    dst = tmp_path / "dst"
    os.makedirs(dst)
    (dst / "earlier").write_text("x")
    pid, host = dead_pid(), socket.gethostname()
    for litter in (
        f".dst.partial-{host}-{pid}",
        f"dst.partial-{pid}",
        f"dst.old-{pid}",
    ):  # utils.atomic's, older align's
        os.makedirs(tmp_path / litter / "p")
    assert align_tool([str(src), str(dst), "--overwrite"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "out", "src"] and os.listdir(dst) == ["align_report.csv"]


def test_align_killed_between_moving_the_earlier_folder_aside_and_the_new_one_in_keeps_it(photos, tmp_path):
    """A kill after the earlier DST was moved to its journaled backup leaves no DST; the next
    run puts the earlier one back before it starts."""
    from shardface.utils import atomic
    from tests.tool_files import dead_pid

    dst, backup = tmp_path / "dst", tmp_path / f".dst.old-{socket.gethostname()}-{dead_pid()}"
    os.makedirs(backup)
    (backup / "earlier").write_text("x")
    assert atomic.recover([str(dst)]) and os.listdir(dst) == ["earlier"] and os.listdir(tmp_path) == ["dst"]


def test_a_photo_stored_sideways_with_exif_orientation_is_turned_upright(head, head_faces, tmp_path):
    from shardface.faces.detect import Detection
    from shardface.faces.stream import stream

    path = str(tmp_path / "sideways.jpg")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view": the pixels lie turned left
    head.rotate(90, expand=True).save(path, quality=95, exif=exif)
    (found,) = stream([path], Detection())
    assert len(found.faces) == 1
    assert np.abs(found.faces[0].points - head_faces[0].points).max() < 3


def test_train_py_align_true_trains_on_a_folder_of_raw_photos(photos, tmp_path):
    from shardface import train

    src = _people(photos, tmp_path)
    run = str(tmp_path / "run")
    assert (
        train.main(
            [
                "configs/demo.py",
                "--rec",
                str(src),
                "--num_classes",
                "2",
                "--align",
                "true",
                "--batch_size",
                "4",
                "--num_workers",
                "0",
                "--max_steps",
                "2",
                "--warmup_epoch",
                "0",
                "--val_targets",
                "[]",
                "--frequent",
                "1",
                "--output",
                run,
            ]
        )
        == 0
    )
    log = open(os.path.join(run, "training.log")).read()
    assert "step 2/2" in log
    assert "eileen/wall.png" in log and "left out" in log  # what building the data set said is in the log too


def test_a_missing_model_file_stops_the_tool_at_start_in_one_line(photos, tmp_path, monkeypatch, capsys):
    import shardface.faces.models
    from shardface.faces.detect import face_detector, landmark_predictor
    from shardface.scripts.align import main as align_tool

    empty = tmp_path / "models"
    os.makedirs(empty)
    monkeypatch.setattr(shardface.faces.models, "models_dir", lambda: str(empty))
    face_detector.cache_clear(), landmark_predictor.cache_clear()
    try:
        assert align_tool([photos, str(tmp_path / "out"), "--detector", "mmod"]) == 2
    finally:
        face_detector.cache_clear(), landmark_predictor.cache_clear()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mmod_human_face_detector.dat" in err and "not found" in err
    assert sorted(os.listdir(tmp_path)) == ["models"]


def test_identify_align_names_each_face_of_a_photo_largest_first(photos, tiny_model, tmp_path, capsys):
    """A query photo that is a gallery photo finds its person at cosine 1; a photo of two faces
    gives one row per face, largest first, each with its box."""
    import shutil

    from shardface.scripts.identify import main as identify

    gallery = tmp_path / "people"
    for person, photo in (("eileen", "one.jpg"), ("other", "turned.png")):
        os.makedirs(gallery / person)
        shutil.copy(os.path.join(photos, "eileen", photo), gallery / person / photo)
    one, two = os.path.join(photos, "eileen", "one.jpg"), os.path.join(photos, "eileen", "two.png")
    assert (
        identify(
            [
                tiny_model,
                "--gallery",
                str(gallery),
                "--align",
                "--top",
                "2",
                "--json",
                "--threshold",
                "-1",
                one,
                two,
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["faces"]
    assert [(r["file"], r["face"]) for r in rows] == [(one, 0), (two, 0), (two, 1)]
    assert rows[0]["name"] == "eileen" and abs(rows[0]["score"] - 1) < 1e-5
    assert [c["name"] for c in rows[0]["candidates"]] == ["eileen", "other"]
    area = [(r["box"][2] - r["box"][0]) * (r["box"][3] - r["box"][1]) for r in rows[1:]]
    assert area[0] > area[1]
    nobody = os.path.join(photos, "nobody", "floor.png")
    assert identify([tiny_model, "--gallery", str(gallery), "--align", "--threshold", "-1", nobody]) == 0
    assert capsys.readouterr().out.strip().endswith(f"{nobody}  no face found")


def _eval_folder(photos, root, people: dict[str, int], faceless, per_id=1, unknown=0):
    """A folder for identify_eval: people[name] images each, named 0.png, 1.png ...; split() as
    identify_eval draws it (seed 0) decides which are enrolled, and faceless(name, role) says
    whether that image is a photo without a face (role: 'enrolled', 'mated' or 'nonmated')."""
    import shutil

    from shardface.scripts.identify_eval import split

    layout = [(name, [f"{name}/{i}.png" for i in range(n)]) for name, n in sorted(people.items())]
    enrolled, mated, nonmated = split(layout, per_id, unknown, 0)
    roles = {f: "enrolled" for _, fs in enrolled for f in fs}
    roles.update({f: "mated" for _, f in mated}, **{f: "nonmated" for _, f in nonmated})
    face, floor = os.path.join(photos, "eileen", "one.jpg"), os.path.join(photos, "nobody", "floor.png")
    for f, role in roles.items():
        os.makedirs(os.path.dirname(os.path.join(root, f)), exist_ok=True)
        shutil.copy(floor if faceless(f.split("/")[0], role) else face, os.path.join(root, f))
    return str(root), roles


def test_identify_eval_counts_and_names_faceless_images_and_leaves_out_probes_of_people_not_enrolled(
    photos, tiny_model, tmp_path, capsys
):
    from shardface.scripts.identify_eval import main as identify_eval

    # blank's enrolment image has no face, its probe has one: counted as non-mated it would be
    # an impostor in a test that holds no one out
    folder, roles = _eval_folder(
        photos,
        tmp_path / "people",
        {"ann": 2, "bob": 3, "blank": 2},
        lambda name, role: (name, role) in {("blank", "enrolled"), ("bob", "mated")},
    )
    args = [tiny_model, folder, "--align", "--unknown_ids", "0"]
    assert identify_eval([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    faceless_enrolled = sorted(f for f, r in roles.items() if r == "enrolled" and f.startswith("blank"))
    faceless_probes = sorted(f for f, r in roles.items() if r == "mated" and f.startswith("bob"))
    assert result["no_face"] == {"enrolment": faceless_enrolled, "probes": faceless_probes}
    assert result["not_enrolled"] == {
        "people": ["blank"],
        "probes_left_out": [f for f, r in roles.items() if r == "mated" and f.startswith("blank")],
    }
    assert result["nonmated_probes"] == 0 and result["people_enrolled"] == 2
    assert result["mated_probes"] == 1  # ann's one probe; bob's two have no face
    assert identify_eval(args) == 0
    out = capsys.readouterr().out
    assert (
        f"no face found in 1 enrolment image(s), left out: {os.path.join(folder, faceless_enrolled[0])}"
        in out
    )
    assert (
        "no face found in 2 probe image(s), left out: " in out
        and os.path.join(folder, faceless_probes[1]) in out
    )
    assert "not enrolled, no enrolment image with a face: blank; their 1 probe(s) left out" in out


def test_identify_eval_with_every_mated_probe_faceless_is_one_error_line(
    photos, tiny_model, tmp_path, capsys
):
    from shardface.scripts.identify_eval import main as identify_eval

    folder, _ = _eval_folder(
        photos, tmp_path / "people", {"ann": 2, "bob": 2}, lambda name, role: role == "mated"
    )
    assert identify_eval([tiny_model, folder, "--align", "--unknown_ids", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and folder in err and "no mated probe has a face" in err


def test_compare_align_counts_a_photos_further_faces_and_refuses_a_faceless_one_without_naming_strict(
    photos, tiny_model, capsys
):
    from shardface.scripts.compare import main as compare

    one, two = os.path.join(photos, "eileen", "one.jpg"), os.path.join(photos, "eileen", "two.png")
    assert compare([tiny_model, one, two, "--align", "--threshold", "0.5"]) == 0
    assert (
        f"1 of 2 photos hold several faces, the largest of each used: {two} (2 faces)"
        in capsys.readouterr().out
    )
    floor = os.path.join(photos, "nobody", "floor.png")
    assert compare([tiny_model, one, floor, "--align", "--threshold", "0.5"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and floor in err
        and "compare needs a face in each" in err
        and "--strict" not in err
    )
    with pytest.raises(SystemExit):  # --strict would change nothing: compare refuses a faceless photo anyway
        compare([tiny_model, one, two, "--align", "--strict"])
    assert "unrecognized arguments: --strict" in capsys.readouterr().err


def test_embed_align_counts_each_photos_further_faces(photos, tiny_model, tmp_path, caplog):
    from shardface.scripts.embed import main as embed

    assert (
        embed([tiny_model, os.path.join(photos, "eileen"), "--out", str(tmp_path / "e.npy"), "--align"]) == 0
    )
    assert (
        f"1 of 5 photos hold several faces, the largest of each used: "
        f"{os.path.join(photos, 'eileen', 'two.png')} (2 faces)" in caplog.text
    )


def test_a_face_goes_to_json_and_back_bit_for_bit():
    import json

    from shardface.faces.detect import Face

    rng = np.random.default_rng(0)
    face = Face(
        (1.0 / 3, 2.5, 90.125, 101.0),
        rng.random((5, 2)) * 100,
        0.1 + 1e-12,
        rng.random((68, 2)) * 100,
        rng.random(128).astype(np.float32),
    )
    back = Face.from_dict(json.loads(json.dumps(face.to_dict())))
    assert back.box == face.box and back.score == face.score
    for a, b in ((back.points, face.points), (back.shape, face.shape), (back.embedding, face.embedding)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    bare = Face.from_dict(json.loads(json.dumps(Face((0.0, 0.0, 1.0, 1.0), np.zeros((5, 2)), 1.0).to_dict())))
    assert bare.shape is None and bare.embedding is None
