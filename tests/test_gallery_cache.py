"""The gallery file of scripts.identify is trusted only as far as it is right: a path that is not
a gallery file is never replaced, images are known by their content, loaded arrays are checked,
the face options and the EMA choice are recorded, concurrent and killed enrolments keep their
saved work, and a collapsed model is named."""

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

import shardface.faces.stream as s
from shardface.dataset import DataError
from shardface.faces.align import ARCFACE_112
from shardface.faces.detect import Detection
from shardface.faces.stream import find_faces, usable
from shardface.infer.enrolment import enrol, mean_cross_cosine
from shardface.infer.model import Model, load_model
from tests.gallery_files import gallery_folder, noise_face, run_identify, seeded_model


def _enrolled(gallery, embedder, **kw):
    """(gallery, the images embedded) of one enrolment, counted as the face stream reads each crop."""
    real, seen = s.crop_pixels, []
    s.crop_pixels = lambda path, *a: seen.append(os.path.relpath(path, gallery)) or real(path, *a)
    try:
        return enrol(gallery, embedder, show_progress=False, **kw), seen
    finally:
        s.crop_pixels = real


@pytest.mark.parametrize("rebuild", [False, True])
def test_a_cache_path_that_is_not_a_gallery_file_is_refused_and_left_alone(tmp_path, capsys, rebuild):
    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    photo = tmp_path / "PHOTO.jpg"
    Image.new("RGB", (64, 48), (200, 10, 10)).save(photo)
    before = photo.read_bytes()
    flag = ["--rebuild"] if rebuild else []
    query = noise_face(tmp_path / "q.png", 5)
    code, out, err = run_identify(capsys, model, "--gallery", gallery, "--cache", str(photo), *flag, query)
    assert code == 2 and out == "" and err.count("\n") == 1 and str(photo) in err
    assert "not a ShardFace gallery file" in err and "delete" not in err
    assert photo.read_bytes() == before


def test_the_gallery_api_names_its_own_remedies_and_takes_them(tmp_path):
    """A gallery file of another model: the refusal names Gallery's `rebuild` and `cache` keywords,
    which the API takes (not the tools' --rebuild and --cache alone)."""
    from shardface import Gallery
    from shardface.infer.enrolment import GalleryError

    first, second = (load_model(seeded_model(tmp_path / f"m{seed}", seed)) for seed in (0, 1))
    gallery = gallery_folder(tmp_path / "g")
    Gallery(first, gallery, align=False, threshold=0.2)
    with pytest.raises(GalleryError, match=r"Gallery\(\.\.\., rebuild=True\).*Gallery\(\.\.\., cache=FILE\)"):
        Gallery(second, gallery, align=False, threshold=0.2)
    elsewhere = str(tmp_path / "elsewhere.npz")
    assert Gallery(second, gallery, align=False, threshold=0.2, cache=elsewhere).names == [
        "person0",
        "person1",
        "person2",
    ]
    assert os.path.isfile(elsewhere)
    assert Gallery(second, gallery, align=False, threshold=0.2, rebuild=True).names == [
        "person0",
        "person1",
        "person2",
    ]


def test_a_gallery_file_is_tied_to_the_weights_not_their_path(tmp_path, capsys):
    """Enrolled with one model.pt, used with a copy of it elsewhere, or with the folder moved: the
    same weights, the same gallery file, nothing enrolled again."""
    import shutil

    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    assert run_identify(capsys, model, "--gallery", gallery, query)[0] == 0
    shutil.copytree(tmp_path / "m", tmp_path / "copy")
    os.rename(tmp_path / "m", tmp_path / "moved")
    for spec in (tmp_path / "copy" / "model.pt", tmp_path / "moved" / "model.pt"):
        code, out, err = run_identify(capsys, str(spec), "--gallery", gallery, query)
        assert code == 0 and "enrolling" not in err and "changed since" not in err, err
    other = seeded_model(tmp_path / "other", 1)  # other weights: refused, naming both fingerprints
    code, out, err = run_identify(capsys, other, "--gallery", gallery, query)
    assert code == 2 and "enrolled with model" in err


def test_a_directory_as_cache_is_refused_before_anything_is_enrolled(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    folder = tmp_path / "somewhere"
    os.makedirs(folder)
    real, seen = s.crop_pixels, []
    s.crop_pixels = lambda *a: seen.append(a) or real(*a)
    try:
        code, out, err = run_identify(
            capsys,
            model,
            "--gallery",
            gallery,
            "--cache",
            str(folder),
            "--rebuild",
            noise_face(tmp_path / "q.png", 5),
        )
    finally:
        s.crop_pixels = real
    assert code == 2 and err.count("\n") == 1 and str(folder) in err and "directory" in err
    assert seen == [] and os.listdir(folder) == []


def _uncompressed(path, seed):
    """A 112x112 PNG stored without compression: every such file has the same size."""
    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, compress_level=0)


def test_an_image_replaced_by_another_of_the_same_size_and_mtime_is_embedded_again(tmp_path):
    embedder = load_model(seeded_model(tmp_path / "m", 0))
    gallery = gallery_folder(tmp_path / "g")
    target = tmp_path / "g" / "person1" / "0.png"
    _uncompressed(target, 1)
    enrol(gallery, embedder, show_progress=False)
    st = os.stat(target)
    _uncompressed(target, 2)  # another face, same size, then the same mtime
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(target).st_size == st.st_size and os.stat(target).st_mtime_ns == st.st_mtime_ns
    again, seen = _enrolled(gallery, embedder)
    assert seen == [os.path.join("person1", "0.png")]
    fresh = enrol(gallery, embedder, cache=str(tmp_path / "fresh.sqlite"), show_progress=False)
    np.testing.assert_allclose(again.templates, fresh.templates, atol=1e-6)


def _damage(cache, how):
    """One of the gallery file's rows spoiled, as a bad disk or another program would."""
    import sqlite3

    with sqlite3.connect(cache) as db:
        key, dtype, blob = db.execute(
            "SELECT key, dtype, row FROM rows WHERE row IS NOT NULL LIMIT 1"
        ).fetchone()
        row = np.frombuffer(blob, np.dtype(dtype)).copy()
        if how == "a NaN row":
            row[1] = np.nan
        elif how == "too short a row":
            row = row[:-1]
        elif how == "too wide a row":
            row = np.concatenate([row, row]) / np.sqrt(2)
        elif how == "a row not of unit length":
            row *= 0.5
        db.execute("UPDATE rows SET row = ? WHERE key = ?", (row.tobytes(), key))


@pytest.mark.parametrize(
    "how", ["a NaN row", "too short a row", "too wide a row", "a row not of unit length"]
)
def test_a_damaged_cache_is_enrolled_again_saying_so(tmp_path, caplog, how):
    embedder = load_model(seeded_model(tmp_path / "m", 0))
    gallery = gallery_folder(tmp_path / "g")
    first = enrol(gallery, embedder, show_progress=False)
    cache = os.path.join(gallery, ".shardface_gallery.sqlite")
    _damage(cache, how)
    with caplog.at_level(logging.WARNING, "shardface"):
        again, seen = _enrolled(gallery, embedder)
    assert len(seen) == 6 and "damaged gallery file" in caplog.text and cache in caplog.text
    assert again.names == first.names
    np.testing.assert_allclose(again.templates, first.templates, atol=1e-6)
    _, seen = _enrolled(gallery, embedder)  # the file written again is whole
    assert seen == []


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import os, signal, sys, time
import shardface.faces.stream as s
import shardface.infer.enrolment as g
from shardface.infer.model import load_model
model, gallery, at, how, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
real, calls = s.crop_pixels, []  # called once per image read
def hook(*a):
    calls.append(a)
    if len(calls) == at and how == "kill":  # no `finally` runs, as in a real kill
        os.kill(os.getpid(), signal.SIGKILL)
    if len(calls) == at and how == "pause":  # until the flag file appears
        open(flag + ".ready", "w").close()
        while not os.path.exists(flag):
            time.sleep(0.05)
    return real(*a)
s.crop_pixels = hook
g.enrol(gallery, load_model(model), batch_size=1, save_every_s=0, show_progress=False)
"""


def _enrolling(model, gallery, at: int, how: str, flag: str = "-") -> subprocess.Popen:
    """enrol(gallery) in another process, saving after every image, SIGKILLed (`kill`) or paused
    until `flag` exists (`pause`) when it reads its `at`-th image."""
    return subprocess.Popen([sys.executable, "-c", CHILD, model, gallery, str(at), how, flag], cwd=ROOT)


def test_a_killed_enrolment_resumes_from_what_it_saved(tmp_path):
    model = seeded_model(tmp_path / "m", 0)
    embedder = load_model(model)
    gallery = gallery_folder(tmp_path / "g", (3, 3))
    proc = _enrolling(model, gallery, 5, "kill")  # four images embedded and saved
    assert proc.wait(timeout=120) == -signal.SIGKILL
    resumed, seen = _enrolled(gallery, embedder, batch_size=1, save_every_s=0)
    assert seen == [os.path.join("person1", "1.png"), os.path.join("person1", "2.png")]
    assert sorted(os.listdir(gallery)) == [".shardface_gallery.sqlite", "person0", "person1"]  # no parts
    fresh = enrol(gallery, embedder, cache=str(tmp_path / "fresh.sqlite"), show_progress=False)
    np.testing.assert_allclose(resumed.templates, fresh.templates, atol=1e-6)


def test_two_enrolments_of_one_gallery_keep_each_others_saved_parts(tmp_path):
    model = seeded_model(tmp_path / "m", 0)
    embedder = load_model(model)
    gallery = gallery_folder(tmp_path / "g", (3, 3))
    flag = str(tmp_path / "go")
    proc = _enrolling(model, gallery, 3, "pause", flag)  # paused after two images, saved
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag + ".ready") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.path.exists(flag + ".ready")
        parent = enrol(gallery, embedder, batch_size=1, save_every_s=0, show_progress=False)
    finally:
        open(flag, "w").close()
        code = proc.wait(timeout=120)
    assert code == 0  # it finished its enrolment
    assert sorted(os.listdir(gallery)) == [".shardface_gallery.sqlite", "person0", "person1"]  # no parts
    again, seen = _enrolled(gallery, embedder)
    assert seen == []
    np.testing.assert_allclose(again.templates, parent.templates, atol=1e-6)


def test_the_ema_choice_keeps_its_own_gallery_file_and_is_named_when_it_changes(tmp_path, caplog):
    path = seeded_model(tmp_path / "m", 0)
    ema = load_model(path)
    torch.manual_seed(5)
    with torch.no_grad():  # the raw weights of the same MODEL: other values
        raw_module = load_model(path).module
        for p in raw_module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    raw = Model(raw_module, ema.template, ema.name, "raw-weights", ema=False)
    gallery = gallery_folder(tmp_path / "g")
    enrol(gallery, ema, show_progress=False)
    with caplog.at_level(logging.WARNING, "shardface"):
        _, seen = _enrolled(gallery, raw)
        assert len(seen) == 6
        _, seen = _enrolled(gallery, ema)  # switching back re-enrols nothing
        assert seen == []
        _, seen = _enrolled(gallery, raw)
        assert seen == []
    assert "since enrolment" not in caplog.text
    assert sorted(f for f in os.listdir(gallery) if f.startswith(".")) == [
        ".shardface_gallery.no_ema.sqlite",
        ".shardface_gallery.sqlite",
    ]
    shared = str(tmp_path / "one.npz")  # one file named for both: the change is said as what it is
    enrol(gallery, ema, cache=shared, show_progress=False)
    with caplog.at_level(logging.WARNING, "shardface"):
        enrol(gallery, raw, cache=shared, show_progress=False)
    assert "the weights chosen (EMA, now raw (--no_ema))" in caplog.text and "fingerprint" not in caplog.text


class _Projection(torch.nn.Module):
    """A random projection of the pixels: noise images land far apart."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(
            torch.randn(3 * 112 * 112, 16, generator=torch.Generator().manual_seed(0))
        )

    def forward(self, x):
        return x.flatten(1) @ self.w


class _Collapsed(torch.nn.Module):
    """Every face lands on (nearly) the same embedding."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.w + 1e-4 * x.mean((1, 2, 3))[:, None]


def test_a_gallery_of_nearly_identical_templates_is_warned_about(tmp_path, caplog):
    gallery = gallery_folder(tmp_path / "g")
    collapsed = Model(_Collapsed().eval(), ARCFACE_112, "collapsed", "c0")
    with caplog.at_level(logging.WARNING, "shardface"):
        enrol(
            gallery,
            Model(_Projection().eval(), ARCFACE_112, "projection", "p0"),
            cache=str(tmp_path / "a.npz"),
            show_progress=False,
        )
        assert "nearly identical" not in caplog.text
        enrol(gallery, collapsed, cache=str(tmp_path / "b.npz"), show_progress=False)
    assert caplog.text.count("nearly identical") == 1 and "3 people" in caplog.text


def test_mean_cross_cosine_is_the_mean_over_pairs_of_different_people():
    t = np.random.default_rng(0).normal(size=(7, 5))
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    pairs = [t[i] @ t[j] for i in range(7) for j in range(7) if i != j]
    assert mean_cross_cosine(t) == pytest.approx(np.mean(pairs))


def astronaut_head(path):
    from skimage import data

    Image.fromarray(data.astronaut()).crop((120, 20, 320, 240)).save(path)  # 200x220, face about 90 px
    return str(path)


def test_face_options_are_recorded_and_a_change_enrols_again_saying_which(tmp_path, capsys, caplog):
    model = seeded_model(tmp_path / "m", 0)
    for person in ("a", "b"):
        os.makedirs(tmp_path / "g" / person)
        astronaut_head(tmp_path / "g" / person / "1.png")
    gallery, query = str(tmp_path / "g"), str(tmp_path / "g" / "a" / "1.png")
    code, out, _ = run_identify(capsys, model, "--gallery", gallery, "--align", query)
    assert code == 0 and "face 0" in out
    with caplog.at_level(logging.WARNING, "shardface"):
        code, out, _ = run_identify(
            capsys, model, "--gallery", gallery, "--align", "--upsample", "0", "--max_side", "900", query
        )
    assert code == 0 and "face 0" in out
    assert "the face options (--upsample 1, now 0, --max_side" in caplog.text
    assert "enrolling every image again" in caplog.text


@pytest.mark.parametrize("tool", ["identify", "embed"])
def test_a_min_score_that_is_not_finite_is_one_error_line(tmp_path, capsys, tool):
    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    if tool == "identify":
        argv = [model, "--gallery", gallery, "--align", "--min_score", "nan", query]
        code, out, err = run_identify(capsys, *argv)
    else:
        from shardface.scripts.embed import main as embed

        code = embed([model, query, "--out", str(tmp_path / "out"), "--align", "--min_score", "nan"])
        err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--min_score nan" in err and "finite" in err


def test_no_face_hint_suggests_only_what_was_not_tried(tmp_path):
    blank = str(tmp_path / "blank.png")
    Image.new("RGB", (80, 80), (128, 128, 128)).save(blank)
    hints = {}
    for upsample, detector in [(1, "hog"), (2, "hog"), (3, "hog")]:
        with pytest.raises(DataError) as exc:
            usable(find_faces([blank], Detection(detector, upsample)), strict=False)
        hints[upsample] = str(exc.value)
    assert "--upsample 2 " in hints[1] and "--upsample 3 " in hints[2] and "--upsample 2" not in hints[2]
    assert "--upsample" not in hints[3] and "--detector mmod" in hints[3]


def test_strict_refuses_a_query_photo_without_a_face(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    os.makedirs(tmp_path / "g" / "a")
    astronaut_head(tmp_path / "g" / "a" / "1.png")
    blank = str(tmp_path / "blank.png")
    Image.new("RGB", (80, 80), (128, 128, 128)).save(blank)
    code, out, _ = run_identify(capsys, model, "--gallery", str(tmp_path / "g"), "--align", blank)
    assert code == 0 and "no face found" in out
    code, out, err = run_identify(
        capsys, model, "--gallery", str(tmp_path / "g"), "--align", "--strict", blank
    )
    assert code == 2 and err.count("\n") == 1 and blank in err and "--strict" in err
