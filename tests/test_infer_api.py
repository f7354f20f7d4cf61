"""The Python API (infer/): a user's photos in any form give the same embeddings, MODEL `dlib`
embeds a photo as dlib (and so face_recognition) does, a Gallery answers as `identify` does, and
the README's example runs."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from shardface import Gallery, load_model
from shardface.errors import DataError
from tests.astronaut import astronaut_head, two_faces_photo
from tests.gallery_files import gallery_folder, noise_face, seeded_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
dlib = pytest.importorskip("dlib")


@pytest.fixture(scope="module")
def dlib_model():
    return load_model("dlib")


@pytest.fixture(scope="module")
def portrait(tmp_path_factory):
    """skimage's astronaut, as a file a user has."""
    from skimage import data

    path = tmp_path_factory.mktemp("portrait") / "astronaut.png"
    Image.fromarray(data.astronaut()).save(path)
    return str(path)


def _dlibs_own_descriptor(img: np.ndarray) -> np.ndarray:
    """face_recognition's `face_encodings(img)[0]`, written with dlib's calls: HOG at one
    upsampling, the 5-point shape of the largest face, dlib's descriptor of its chip."""
    from shardface.faces.models import model_file

    box = max(dlib.get_frontal_face_detector()(img, 1), key=lambda r: r.area())
    shape = dlib.shape_predictor(model_file("shape_predictor_5_face_landmarks.dat"))(img, box)
    net = dlib.face_recognition_model_v1(model_file("dlib_face_recognition_resnet_model_v1.dat"))
    return np.array(net.compute_face_descriptor(img, shape))


def test_dlib_embeds_a_photo_as_dlib_and_face_recognition_do(dlib_model, portrait):
    img = np.asarray(Image.open(portrait).convert("RGB"))
    ours = dlib_model.embed([portrait], flip=False)[0].astype(np.float64)
    theirs = _dlibs_own_descriptor(img)
    assert ours @ theirs / np.linalg.norm(theirs) >= 0.999


def test_paths_pil_images_and_arrays_give_the_same_embeddings(dlib_model, portrait):
    image = Image.open(portrait)
    emb = dlib_model.embed([portrait, image, np.asarray(image.convert("RGB"))])
    assert emb.shape == (3, 128) and emb.dtype == np.float32
    np.testing.assert_array_equal(emb[0], emb[1])
    np.testing.assert_array_equal(emb[0], emb[2])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-5)


def test_faces_come_largest_first_with_box_points_and_score(dlib_model):
    faces = dlib_model.faces(two_faces_photo(astronaut_head()))
    assert len(faces) == 2
    (x0, y0, x1, y1), (u0, v0, u1, v1) = faces[0].box, faces[1].box
    assert (x1 - x0) * (y1 - y0) > (u1 - u0) * (v1 - v0) and x0 < u0  # the full-size head is on the left
    assert faces[0].points.shape == (5, 2) and faces[0].score > 0
    assert all(x0 <= x <= x1 and y0 <= y <= y1 for x, y in faces[0].points)


def test_compare_takes_photos_faces_or_embeddings_alike_and_refuses_an_embedding_of_another_width(
    dlib_model, portrait
):
    flipped = Image.open(portrait).transpose(Image.FLIP_LEFT_RIGHT)
    photos = dlib_model.compare(portrait, flipped)
    face = dlib_model.faces(portrait)[0]
    row = dlib_model.embed(flipped)
    for a, b in (
        (face, flipped),
        (portrait, row),
        (face, row),
        (face.embedding.astype(np.float64), row * 3.0),
    ):
        got = dlib_model.compare(a, b)
        assert got.score == pytest.approx(photos.score, abs=1e-6) and got.same is photos.same is True
    with pytest.raises(DataError, match="an embedding of 512 values: .*have 128"):
        dlib_model.compare(face, np.ones(512, np.float32))


def test_compare_is_the_cosine_of_the_two_embeddings_and_a_photo_without_a_face_is_named(
    dlib_model, portrait, tmp_path
):
    flipped = Image.open(portrait).transpose(Image.FLIP_LEFT_RIGHT)
    a, b = dlib_model.embed([portrait, flipped], flip=False).astype(np.float64)
    assert dlib_model.compare(portrait, flipped, flip=False).score == pytest.approx(float(a @ b), abs=1e-6)
    assert (
        dlib_model.threshold is not None
        and dlib_model.compare(portrait, flipped).score > dlib_model.threshold.value
    )
    wall = tmp_path / "wall.png"
    Image.new("RGB", (160, 160), (120, 140, 160)).save(wall)
    with pytest.raises(Exception, match=f"{wall}: no face found"):
        dlib_model.embed([portrait, str(wall)])
    with pytest.raises(Exception, match="photo 0 .*uint8"):
        dlib_model.embed([np.zeros((10, 10, 3), np.float32)])


def test_gallery_answers_as_identify_does(tmp_path, capsys):
    from shardface.scripts.identify import main as identify

    model = seeded_model(tmp_path / "m", 0)
    people = gallery_folder(tmp_path / "g")
    queries = [str(tmp_path / "g" / "person1" / "0.png"), noise_face(tmp_path / "q.png", 99)]
    assert identify([model, "--gallery", people, "--threshold", "0.2", "--top", "2", "--json", *queries]) == 0
    rows = json.loads(capsys.readouterr().out)["faces"]
    gallery = Gallery(load_model(model), people, align=False, threshold=0.2)
    assert gallery.names == ["person0", "person1", "person2"]
    for query, row in zip(queries, rows):
        (match,) = gallery.identify(query, top=2)
        expected = [(c["name"], c["score"]) for c in row["candidates"]]
        assert [n for n, _ in match.candidates] == [n for n, _ in expected]
        np.testing.assert_allclose([s for _, s in match.candidates], [s for _, s in expected], atol=1e-6)
        assert match.name == row["name"] and list(match.box) == row["box"]
        assert gallery.identify(query)[0].name == row["name"]


def test_the_readme_example_runs(tmp_path, portrait):
    people = tmp_path / "people" / "eileen"
    os.makedirs(people)
    astronaut_head().save(people / "one.jpg")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "use_a_model.py"),
            "dlib",
            str(tmp_path / "people"),
            portrait,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("face at (") and "embedding: 128 numbers" in lines
    answers = lines[[i for i, line in enumerate(lines) if line.startswith("cosine to ")][0] + 1 :]
    assert answers[0].startswith("eileen (")  # her face, the largest; the badge on her suit is nobody
    assert all(a.startswith("unknown (") for a in answers[1:])


def test_compare_names_every_faceless_photo_and_says_which_holds_several_faces(
    dlib_model, portrait, tmp_path
):
    group = tmp_path / "group.png"
    two_faces_photo(astronaut_head()).save(group)
    verdict = dlib_model.compare(str(group), portrait)
    assert verdict.several is not None and f"{group} (2 faces)" in verdict.several
    head = tmp_path / "head.png"
    astronaut_head().save(head)  # the portrait holds a second, smaller face: the head alone has one
    assert dlib_model.compare(str(head), str(head)).several is None
    walls = [tmp_path / f"wall{i}.png" for i in range(2)]
    for wall in walls:
        Image.new("RGB", (160, 160), (120, 140, 160)).save(wall)
    with pytest.raises(DataError, match=re.escape(f"no face found in 2 of 2 photos: {walls[0]}, {walls[1]}")):
        dlib_model.compare(str(walls[0]), str(walls[1]))


def test_compare_judges_at_a_threshold_given_as_a_cosine_or_a_threshold_and_refuses_a_non_cosine(
    dlib_model, portrait, drawn_faces
):
    from shardface import Threshold, fit_threshold
    from shardface.infer.thresholds import ThresholdError

    own = dlib_model.compare(portrait, portrait)
    assert own.threshold == dlib_model.threshold.value and own.source == dlib_model.threshold.source
    strict = dlib_model.compare(portrait, portrait, threshold=Threshold(1.0, "mine"))
    assert (strict.threshold, strict.source, strict.same) == (1.0, "mine", own.score >= 1.0)
    assert dlib_model.compare(portrait, portrait, threshold=-1.0).same is True
    with pytest.raises(ThresholdError, match="not a cosine"):
        dlib_model.compare(portrait, portrait, threshold=2.0)
    val = os.path.join(drawn_faces, "drawn_faces_val.bin")
    fitted = fit_threshold(dlib_model, val)
    assert fitted.source.startswith(f"from {val}: the best over all its 40 pairs")
    assert dlib_model.compare(portrait, portrait, threshold=fitted).threshold == fitted.value
