"""One face stream drives every use of faces (docs/architecture.md, 'One face stream'): the
detector runs on photos only inside faces/stream.py, once per photo, whichever door (the API,
the tools) asked, which is counted on a fixture with every dlib search recorded; only
infer/stream.py runs a model's forward on them; the packages' imports have no circle; and the
API a face_recognition or insightface user expects (faces with embeddings, a verdict, matches
with boxes, a picture) are layers on it."""

import ast
import os
import threading

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = [
    "backbones",
    "checkpoint",
    "configs",
    "dataset",
    "distill",
    "eval",
    "faces",
    "heads",
    "infer",
    "losses",
    "parallel",
    "scripts",
    "utils",
]
MODULES = ["builders", "planner", "train"]


def _sources():
    for top in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.relpath(os.path.join(dirpath, f), ROOT)
                    yield path[:-3].replace(os.sep, ".").removesuffix(".__init__"), path
    for name in MODULES:
        yield name, f"{name}.py"


def _tree(path: str) -> ast.Module:
    with open(os.path.join(ROOT, path)) as f:
        return ast.parse(f.read(), path)


def _imported_names(tree: ast.Module, module: str) -> set[str]:
    return {
        a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == f"shardface.{module}"
        for a in n.names
    }


def test_only_infer_stream_runs_a_models_forward_on_photos():
    """infer.embed's forward (`embed`) is imported by infer/stream.py, and by
    eval/verification.py for the .bin sets' crops (no photos there)."""
    users = sorted(path for _, path in _sources() if "embed" in _imported_names(_tree(path), "infer.embed"))
    assert users == [os.path.join("eval", "verification.py"), os.path.join("infer", "stream.py")]


def _imports(tree: ast.Module, ours: set[str]) -> set[str]:
    """Our modules a module imports, at any depth of the file (function-level imports too)."""
    out = set()
    for node in ast.walk(tree):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            else []
        )
        out.update(n.removeprefix("shardface.") for n in names if n.removeprefix("shardface.") in ours)
    return out


def test_our_modules_import_one_another_without_a_circle():
    sources = dict(_sources())
    graph = {m: _imports(_tree(p), set(sources)) - {m} for m, p in sources.items()}
    # a package's __init__ importing its own modules is how a package exports: not a circle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    assert "faces.stream" in graph["infer.stream"]  # the scan sees the imports
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path + [m, d]
            if d not in state:
                found = visit(d, path + [m])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, f"import circle: {' -> '.join(cycle[cycle.index(cycle[-1]) :])}"


dlib = pytest.importorskip("dlib")


@pytest.fixture(scope="module")
def model():
    from shardface import load_model

    return load_model("dlib")


@pytest.fixture(scope="module")
def astronaut(tmp_path_factory) -> str:
    from skimage import data

    path = tmp_path_factory.mktemp("photos") / "astronaut.jpg"
    Image.fromarray(data.astronaut()).save(path, quality=95)
    return str(path)


def test_faces_come_with_their_embeddings_equal_to_embeds_row(model, astronaut):
    faces = model.faces(astronaut)
    assert faces and all(f.embedding.shape == (128,) for f in faces)
    np.testing.assert_allclose([np.linalg.norm(f.embedding) for f in faces], 1, atol=1e-5)
    np.testing.assert_allclose(faces[0].embedding, model.embed(astronaut), atol=1e-6)  # one photo: a row of D


def test_compare_gives_the_score_and_the_verdict_at_the_models_threshold(model, astronaut, tmp_path):
    from shardface.infer.model import Comparison

    mirrored = Image.open(astronaut).transpose(Image.FLIP_LEFT_RIGHT)
    same = model.compare(astronaut, mirrored)
    assert isinstance(same, Comparison) and same.same is True and same.threshold == model.threshold.value
    assert same.score >= same.threshold and "same person" in str(same)
    import dataclasses

    blind = dataclasses.replace(model, threshold=None)
    verdict = blind.compare(astronaut, mirrored)
    assert (
        verdict.same is None and verdict.score == pytest.approx(same.score) and "no verdict" in str(verdict)
    )


def test_embed_names_a_faceless_photo_or_gives_it_a_nan_row_as_asked(model, astronaut):
    wall = np.full((160, 160, 3), 128, np.uint8)
    with pytest.raises(Exception, match=r"photo 1 \(ndarray\): no face found"):
        model.embed([astronaut, wall])
    rows = model.embed([astronaut, wall], missing="nan")
    assert rows.shape == (2, 128) and np.isfinite(rows[0]).all() and np.isnan(rows[1]).all()
    assert model.embed([]).shape == (0, 128)
    with pytest.raises(Exception, match=r"photo 0 \(ndarray\): an empty \(0x0\) image"):
        model.embed([np.zeros((0, 0, 3), np.uint8)])


def test_a_path_given_alone_is_one_photo_not_its_characters(model, astronaut):
    one = model.embed(astronaut)
    assert one.shape == (128,)
    np.testing.assert_array_equal(one, model.embed([astronaut])[0])


def test_identify_returns_matches_with_boxes_and_one_type_whatever_top(model, astronaut, tmp_path):
    from shardface import Gallery, Match

    people = tmp_path / "people"
    for name, photo in (("eileen", Image.open(astronaut)), ("unknown", Image.open(astronaut).rotate(3))):
        os.makedirs(people / name)
        photo.save(people / name / "1.png")
    gallery = Gallery(model, str(people))
    one, three = gallery.identify(astronaut), gallery.identify(astronaut, top=3)
    assert all(isinstance(m, Match) for m in one + three) and len(one) == len(three) >= 1
    assert one[0].name in ("eileen", "unknown") and one[0].score >= gallery.threshold.value
    assert one[0].box == model.faces(astronaut)[0].box
    assert [n for n, _ in three[0].candidates] and len(three[0].candidates) == 2  # both people, best first
    assert three[0].name == one[0].name


def test_draw_marks_each_face_box_on_a_copy_of_the_photo(model, astronaut):
    photo = Image.open(astronaut).convert("RGB")
    faces = model.faces(astronaut)
    picture = model.draw(astronaut, faces)
    assert picture.size == photo.size and picture is not photo
    x0, y0, x1, y1 = (round(v) for v in faces[0].box)
    drawn = np.asarray(picture, np.int16)
    changed = np.abs(drawn - np.asarray(photo, np.int16)).sum(2) > 0
    assert changed[y0, x0:x1].mean() > 0.9 and not changed[(y0 + y1) // 2, (x0 + x1) // 2 + 3]
    crop = photo.resize((150, 150))  # a photo taken as a crop (align=False): its face has no points
    (taken,) = model.analyse([np.asarray(crop)], align=False)
    assert model.draw(crop, taken.faces).size == (150, 150)


def test_the_api_is_safe_from_several_threads(model, astronaut):
    """dlib's detector is not thread-safe (a segfault without the lock): four threads calling
    `faces` at once get what one thread gets."""
    alone = [f.box for f in model.faces(astronaut)]
    got, errors = [], []

    def work():
        try:
            for _ in range(3):
                got.append([f.box for f in model.faces(astronaut)])
        except Exception as exc:  # reported below: a thread's exception would be lost
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 12 and all(boxes == alone for boxes in got)


@pytest.fixture
def searches(monkeypatch) -> list[list[str]]:
    """Each dlib face search run from now on: the source files of its call stack."""
    import traceback

    import shardface.faces.detect as detect

    out, real = [], detect._boxes

    def recorded(*args, **kwargs):
        out.append([os.path.realpath(frame.filename) for frame in traceback.extract_stack()])
        return real(*args, **kwargs)

    monkeypatch.setattr(detect, "_boxes", recorded)
    return out


def test_every_door_searches_each_photo_once_inside_the_face_stream(model, astronaut, tmp_path, searches):
    from shardface import Gallery
    from shardface.scripts.align import main as align
    from shardface.scripts.compare import main as compare
    from shardface.scripts.embed import main as embed

    os.makedirs(tmp_path / "people" / "eileen")
    Image.open(astronaut).rotate(3).save(tmp_path / "people" / "eileen" / "1.jpg", quality=95)
    doors = [
        ("Model.faces", lambda: model.faces(astronaut), 1),
        ("Model.embed", lambda: model.embed([astronaut, astronaut]), 2),
        ("Model.compare", lambda: model.compare(astronaut, astronaut), 2),
        ("Gallery.identify", lambda: Gallery(model, str(tmp_path / "people")).identify(astronaut), 2),
        ("align", lambda: align([str(tmp_path / "people"), str(tmp_path / "crops"), "--workers", "1"]), 1),
        ("embed --align", lambda: embed(["dlib", astronaut, "--align", "--out", str(tmp_path / "e.npy")]), 1),
        ("compare --align", lambda: compare(["dlib", astronaut, astronaut, "--align"]), 2),
    ]
    stream = os.path.realpath(os.path.join(ROOT, "faces", "stream.py"))
    for door, run, photos in doors:
        searches.clear()
        run()
        assert len(searches) == photos, (door, len(searches))
        outside = [files for files in searches if stream not in files]
        assert not outside, f"{door}: a face search outside faces/stream.py, from {outside[0][-4:]}"
