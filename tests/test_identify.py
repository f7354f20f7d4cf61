"""scripts.identify: enrolment (cache reuse, updates, resume, another model refused), search
results equal a direct computation, and every bad input is one error line naming it."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from backbones import get_model
from eval.embedder import embed_files, load_embedder, load_model
from eval.gallery import enrol
from scripts.identify import main as identify


def _model(folder, seed):
    torch.manual_seed(seed)
    os.makedirs(folder, exist_ok=True)
    torch.save(get_model("tiny", num_features=32).eval().state_dict(), os.path.join(folder, "model.pt"))
    json.dump({"network": "tiny"}, open(os.path.join(folder, "config.json"), "w"))
    return os.path.join(folder, "model.pt")


def _face(path, seed):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)).save(path)
    return str(path)


def _gallery(root, per_person=(1, 2, 3)):
    for p, n in enumerate(per_person):
        os.makedirs(root / f"person{p}")
        for i in range(n):
            _face(root / f"person{p}" / f"{i}.png", 10 * p + i)
    return str(root)


def _run(capsys, *argv):
    code = identify(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_search_results_equal_mean_templates_scored_directly(tmp_path, capsys):
    model = _model(tmp_path / "m", 0)
    gallery = _gallery(tmp_path / "g")
    queries = [str(tmp_path / "g" / "person1" / "0.png"), _face(tmp_path / "q.png", 99)]
    code, out, _ = _run(capsys, model, "--gallery", gallery, "--top", "5", "--json", *queries)
    assert code == 0
    faces = json.loads(out)["faces"]
    # independently: scripts.embed's embeddings, mean per person, cosine, sorted by score
    emb = lambda files: embed_files(files, load_model(model), show_progress=False)  # noqa: E731
    templates = []
    for p in range(3):
        folder = os.path.join(gallery, f"person{p}")
        e = emb(sorted(os.path.join(folder, f) for f in os.listdir(folder))).mean(0)
        templates.append(e / np.linalg.norm(e))
    scores = emb(queries) @ np.stack(templates).T
    for face, row, path in zip(faces, scores, queries):
        order = sorted(range(3), key=lambda j: (-row[j], j))
        assert face["file"] == path and face["face"] == 0 and face["box"] == [0, 0, 112, 112]
        assert [c["name"] for c in face["candidates"]] == [f"person{j}" for j in order]  # K=5 > 3 people
        np.testing.assert_allclose([c["score"] for c in face["candidates"]], row[order], atol=1e-4)
        assert face["name"] == f"person{order[0]}"
    code, out, _ = _run(capsys, model, "--gallery", gallery, "--threshold", "1.01", *queries)
    assert out.count("unknown (best") == 2 and code == 0


def test_cache_is_reused_updated_when_the_folder_changes_and_another_model_is_refused(tmp_path, capsys):
    model, other = _model(tmp_path / "m", 0), _model(tmp_path / "other", 1)
    gallery = _gallery(tmp_path / "g")
    embedder = load_embedder(model)
    first = enrol(gallery, embedder, show_progress=False)
    cache = os.path.join(gallery, ".shardface_gallery.npz")
    stamp = os.stat(cache).st_mtime_ns
    again = enrol(gallery, embedder, show_progress=False)
    assert os.stat(cache).st_mtime_ns == stamp and first.names == again.names  # nothing re-embedded or written
    np.testing.assert_array_equal(first.templates, again.templates)
    _face(tmp_path / "g" / "person0" / "new.png", 77)
    os.remove(tmp_path / "g" / "person2" / "2.png")
    os.makedirs(tmp_path / "g" / "person3")
    _face(tmp_path / "g" / "person3" / "a.png", 78)
    updated = enrol(gallery, embedder, show_progress=False)
    fresh = enrol(gallery, embedder, cache=str(tmp_path / "fresh.npz"), show_progress=False)
    assert updated.names == fresh.names == ["person0", "person1", "person2", "person3"]
    np.testing.assert_allclose(updated.templates, fresh.templates, atol=1e-6)
    code, _, err = _run(capsys, other, "--gallery", gallery, str(tmp_path / "g" / "person3" / "a.png"))
    assert code == 2 and err.count("\n") == 1
    assert cache in err and os.path.realpath(model) in err and "--rebuild" in err
    code, out, _ = _run(capsys, other, "--gallery", gallery, "--rebuild", str(tmp_path / "g" / "person3" / "a.png"))
    assert code == 0 and "person3 1.0000" in out


@pytest.mark.parametrize("case,named", [
    ("empty gallery", "empty gallery"),
    ("person without images", "person folder without images"),
    ("image outside a person folder", "outside a person folder"),
    ("query not an image", "cannot read image"),
    ("gallery image not an image", "cannot read image"),
    ("query missing", "no such image file or folder"),
    ("query of the wrong size", "pass --align"),
])
def test_bad_input_is_one_error_line_naming_it(tmp_path, capsys, case, named):
    model = _model(tmp_path / "m", 0)
    g = tmp_path / "g"
    query = _face(tmp_path / "q.png", 1)
    if case == "empty gallery":
        os.makedirs(g)
        where = str(g)
    else:
        _gallery(g, (1,))
        where = str(g / "person0" / "0.png")
    if case == "person without images":
        os.makedirs(g / "nobody")
        (g / "nobody" / "notes.txt").write_text("x")
        where = str(g / "nobody")
    elif case == "image outside a person folder":
        where = _face(g / "loose.png", 3)
    elif case == "query not an image":
        where = query = str(tmp_path / "q.jpg")
        open(query, "w").write("text")
    elif case == "gallery image not an image":
        where = str(g / "person0" / "bad.png")
        open(where, "w").write("text")
    elif case == "query missing":
        where = query = str(tmp_path / "missing.png")
    elif case == "query of the wrong size":
        where = query
        Image.new("RGB", (90, 60)).save(query)
    code, out, err = _run(capsys, model, "--gallery", str(g), query)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert where in err and named in err


def test_identify_eval_split_and_rank1_equal_a_direct_computation(tmp_path, capsys):
    from scripts.identify_eval import main as identify_eval
    from scripts.identify_eval import split
    model = _model(tmp_path / "m", 0)
    root = _gallery(tmp_path / "g", (3, 3, 2, 1, 3))
    png = str(tmp_path / "curves.png")
    assert identify_eval([model, root, "--gallery_per_id", "2", "--unknown_ids", "1", "--json", "--plot", png]) == 0
    result = json.loads(capsys.readouterr().out)
    people = [(f"person{p}", sorted(f"person{p}/{i}.png" for i in range(n))) for p, n in enumerate((3, 3, 2, 1, 3))]
    enrolled, mated, nonmated = split(people, 2, 1, 0)
    assert len(enrolled) == 4 and len(nonmated) in (1, 2, 3) and all(len(f) <= 2 for _, f in enrolled)
    emb = lambda fs: embed_files([os.path.join(root, f) for f in fs], load_model(model), show_progress=False)  # noqa
    templates = np.stack([e / np.linalg.norm(e) for e in (emb(fs).mean(0) for _, fs in enrolled)])
    best = np.argmax(emb([f for _, f in mated]) @ templates.T, axis=1)
    want = np.mean([enrolled[b][0] == name for b, (name, _) in zip(best, mated)])
    assert result["rank1"] == pytest.approx(want)
    assert result["mated_probes"] == len(mated) and result["nonmated_probes"] == len(nonmated)
    assert set(result["tpir_at_fpir"]) == {"0.1", "0.01"} and Image.open(png).size == (1280, 480)
