"""scripts.identify: enrolment (cache reuse, updates, resume, another model refused), search
results equal a direct computation, and every bad input is one error line naming it."""

import json
import os

import numpy as np
import pytest
from PIL import Image

from shardface.infer.enrolment import enrol
from shardface.infer.model import as_model, load_model, load_module
from shardface.scripts.identify import main as identify
from tests.gallery_files import gallery_folder, noise_face, run_identify, seeded_model


def test_search_results_equal_mean_templates_scored_directly(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    queries = [str(tmp_path / "g" / "person1" / "0.png"), noise_face(tmp_path / "q.png", 99)]
    code, out, _ = run_identify(capsys, model, "--gallery", gallery, "--top", "5", "--json", *queries)
    assert code == 0
    faces = json.loads(out)["faces"]
    # independently: scripts.embed's embeddings, mean per person, cosine, sorted by score
    emb = lambda files: as_model(load_module(model)).embed(files, align=False)  # noqa: E731
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
    code, out, _ = run_identify(capsys, model, "--gallery", gallery, "--threshold", "1", *queries)
    assert out.count("unknown (best") == 2 and code == 0


def test_cache_is_reused_updated_when_the_folder_changes_and_another_model_is_refused(tmp_path, capsys):
    model, other = seeded_model(tmp_path / "m", 0), seeded_model(tmp_path / "other", 1)
    gallery = gallery_folder(tmp_path / "g")
    embedder = load_model(model)
    first = enrol(gallery, embedder, show_progress=False)
    cache = os.path.join(gallery, ".shardface_gallery.sqlite")
    stamp = os.stat(cache).st_mtime_ns
    again = enrol(gallery, embedder, show_progress=False)
    # nothing re-embedded or written
    assert os.stat(cache).st_mtime_ns == stamp and first.names == again.names
    np.testing.assert_array_equal(first.templates, again.templates)
    noise_face(tmp_path / "g" / "person0" / "new.png", 77)
    os.remove(tmp_path / "g" / "person2" / "2.png")
    os.makedirs(tmp_path / "g" / "person3")
    noise_face(tmp_path / "g" / "person3" / "a.png", 78)
    updated = enrol(gallery, embedder, show_progress=False)
    fresh = enrol(gallery, embedder, cache=str(tmp_path / "fresh.sqlite"), show_progress=False)
    assert updated.names == fresh.names == ["person0", "person1", "person2", "person3"]
    np.testing.assert_allclose(updated.templates, fresh.templates, atol=1e-6)
    code, _, err = run_identify(
        capsys, other, "--gallery", gallery, str(tmp_path / "g" / "person3" / "a.png")
    )
    assert code == 2 and err.count("\n") == 1
    assert cache in err and os.path.realpath(model) in err and "--rebuild" in err
    code, out, _ = run_identify(
        capsys, other, "--gallery", gallery, "--rebuild", str(tmp_path / "g" / "person3" / "a.png")
    )
    assert code == 0 and "person3 1.0000" in out


@pytest.mark.parametrize(
    "case,named",
    [
        ("empty gallery", "empty gallery"),
        ("person without images", "person folder without images"),
        ("image outside a person folder", "outside a person folder"),
        ("query not an image", "cannot read image"),
        ("gallery image not an image", "cannot read image"),
        ("query missing", "no such image file or folder"),
        ("query of the wrong size", "pass --align"),
    ],
)
def test_bad_input_is_one_error_line_naming_it(tmp_path, capsys, case, named):
    model = seeded_model(tmp_path / "m", 0)
    g = tmp_path / "g"
    query = noise_face(tmp_path / "q.png", 1)
    if case == "empty gallery":
        os.makedirs(g)
        where = str(g)
    else:
        gallery_folder(g, (1,))
        where = str(g / "person0" / "0.png")
    if case == "person without images":
        os.makedirs(g / "nobody")
        (g / "nobody" / "notes.txt").write_text("x")
        where = str(g / "nobody")
    elif case == "image outside a person folder":
        where = noise_face(g / "loose.png", 3)
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
    code, out, err = run_identify(capsys, model, "--gallery", str(g), query)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1
    assert where in err and named in err


def test_identify_eval_split_and_rank1_equal_a_direct_computation(tmp_path, capsys):
    from shardface.scripts.identify_eval import main as identify_eval
    from shardface.scripts.identify_eval import split

    model = seeded_model(tmp_path / "m", 0)
    root = gallery_folder(tmp_path / "g", (3, 3, 2, 1, 3))
    png = str(tmp_path / "curves.png")
    assert (
        identify_eval([model, root, "--gallery_per_id", "2", "--unknown_ids", "1", "--json", "--plot", png])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    people = [
        (f"person{p}", sorted(f"person{p}/{i}.png" for i in range(n))) for p, n in enumerate((3, 3, 2, 1, 3))
    ]
    enrolled, mated, nonmated = split(people, 2, 1, 0)
    assert len(enrolled) == 4 and len(nonmated) in (1, 2, 3) and all(len(f) <= 2 for _, f in enrolled)
    emb = lambda fs: as_model(load_module(model)).embed([os.path.join(root, f) for f in fs], align=False)  # noqa
    templates = np.stack([e / np.linalg.norm(e) for e in (emb(fs).mean(0) for _, fs in enrolled)])
    best = np.argmax(emb([f for _, f in mated]) @ templates.T, axis=1)
    want = np.mean([enrolled[b][0] == name for b, (name, _) in zip(best, mated)])
    assert result["rank1"] == pytest.approx(want)
    assert result["mated_probes"] == len(mated) and result["nonmated_probes"] == len(nonmated)
    assert set(result["tpir_at_fpir"]) == {"0.1", "0.01"} and Image.open(png).size == (1280, 480)


@pytest.mark.parametrize("tool", ["identify", "compare"])
@pytest.mark.parametrize("value", ["nan", "inf", "2", "-5", "1.0001"])
def test_threshold_that_is_not_a_cosine_is_refused_in_one_line_before_any_work(tmp_path, capsys, tool, value):
    from shardface.scripts.compare import main as compare

    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    argv = [model, "--gallery", gallery, query] if tool == "identify" else [model, query, query]
    code = (identify if tool == "identify" else compare)([*argv, "--threshold", value])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and out.err.count("\n") == 1
    assert f"--threshold {float(value)}" in out.err and "[-1, 1]" in out.err
    assert not os.path.exists(os.path.join(gallery, ".shardface_gallery.sqlite"))  # nothing enrolled


def test_model_without_a_known_threshold_names_no_one_and_says_how_to_get_one(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    code = identify([model, "--gallery", gallery, query])
    out = capsys.readouterr()
    assert code == 2 and out.out == "" and out.err.count("\n") == 1
    assert model in out.err and "--threshold T" in out.err and "--threshold_from VAL.bin" in out.err
    assert not os.path.exists(os.path.join(gallery, ".shardface_gallery.sqlite"))


def test_identify_and_compare_print_the_threshold_they_used_and_where_it_came_from(tmp_path, capsys):
    from shardface.scripts.compare import main as compare

    model = seeded_model(tmp_path / "m", 0)
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    code, out, _ = run_identify(capsys, model, "--gallery", gallery, "--threshold", "0.25", query)
    assert code == 0 and out.splitlines()[0] == "threshold 0.2500: given by --threshold"
    code, out, _ = run_identify(capsys, model, "--gallery", gallery, "--threshold", "0.25", "--json", query)
    assert (
        json.loads(out)["threshold"] == 0.25 and json.loads(out)["threshold_source"] == "given by --threshold"
    )
    assert compare([model, query, query, "--threshold", "0.25"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["threshold 0.2500: given by --threshold", "same person (threshold 0.2500)"]
    assert compare([model, query, query]) == 0  # no threshold known: the cosine, and how to decide
    assert "no known threshold" in capsys.readouterr().out


def test_identify_eval_gives_no_figure_the_data_cannot_support(tmp_path, capsys):
    """4 people enrolled: rank-5 is 1 whatever the model, so n/a; 2 non-mated probes cannot
    measure FPIR 0.1 (needs 10) or 0.01 (needs 100)."""
    from shardface.scripts.identify_eval import main as identify_eval

    model = seeded_model(tmp_path / "m", 0)
    root = gallery_folder(tmp_path / "g", (3, 3, 2, 2, 3))
    args = [model, root, "--gallery_per_id", "1", "--unknown_ids", "1", "--seed", "1"]
    assert identify_eval([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["people_enrolled"] == 4 and result["nonmated_probes"] < 10
    assert result["rank1"] is not None and result["rank5"] is None
    assert result["tpir_at_fpir"] == {
        "0.1": {"tpir": None, "threshold": None, "needs_nonmated_probes": 10},
        "0.01": {"tpir": None, "threshold": None, "needs_nonmated_probes": 100},
    }
    assert identify_eval(args) == 0
    out = capsys.readouterr().out
    assert "rank-5 n/a (needs more than 5 people enrolled)" in out
    assert f"TPIR@FPIR 1e-01: n/a (needs >= 10 non-mated probes, has {result['nonmated_probes']})" in out


def test_identify_eval_negative_unknown_ids_is_one_error_line(tmp_path, capsys):
    from shardface.scripts.identify_eval import main as identify_eval

    model = seeded_model(tmp_path / "m", 0)
    root = gallery_folder(tmp_path / "g", (2, 2))
    assert identify_eval([model, root, "--unknown_ids", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--unknown_ids -1" in err


@pytest.mark.parametrize("seed", range(3))
def test_threshold_at_far_accepts_at_most_far_of_different_pairs_and_no_lower_threshold_does(seed):
    from shardface.infer.thresholds import threshold_at_far

    rng = np.random.default_rng(seed)
    n = [5, 40, 1500][seed]
    cos = np.round(rng.uniform(-1, 1, 2 * n), 2)  # ties
    same = np.arange(2 * n) % 2 == 0
    got = threshold_at_far(cos, same)
    if n < 10:
        assert got is None  # 5 different pairs cannot measure even FAR 0.1
        return
    far = got["far"]
    different = cos[~same]
    # the lowest FAR the pairs can measure, unless different pairs at cosine 1 make it unreachable
    assert far == min(f for f in (1e-3, 1e-2, 1e-1) if n >= round(1 / f) and (different >= 1.0).mean() <= f)
    assert (different >= got["threshold"]).mean() <= far
    lower = different[different < got["threshold"]].max()  # the next threshold down accepts too many
    assert (different >= lower).mean() > far
    assert got["tar"] == pytest.approx((cos[same] >= got["threshold"]).mean())


def test_trained_runs_threshold_is_saved_by_verification_used_by_identify_and_carried_into_onnx(
    tmp_path, capsys
):
    """The callback saves threshold.json beside the run's weights; identify and compare take it as
    the MODEL's own, stated; export_onnx writes it into the .onnx, whose tools state the same."""
    import io

    from shardface.eval.callback import VerificationCallback
    from shardface.eval.verification import write_bin
    from shardface.scripts.compare import main as compare
    from shardface.scripts.export_onnx import main as export_onnx

    model = seeded_model(tmp_path / "run", 0)
    images = []
    for i in range(80):  # 40 pairs, 20 of them different people: FAR 0.1 is measurable, 0.01 is not
        buf = io.BytesIO()
        Image.open(noise_face(tmp_path / "v.png", 1000 + i)).save(buf, format="PNG")
        images.append(buf.getvalue())
    write_bin(str(tmp_path / "v.bin"), images, [i % 2 == 0 for i in range(40)])
    backbone = load_module(model)
    VerificationCallback(["v"], str(tmp_path), 1, backbone, output=str(tmp_path / "run"))(7)
    saved = json.load(open(tmp_path / "run" / "threshold.json"))["raw"]
    assert (
        saved["far"] == 0.1
        and saved["different_pairs"] == 20
        and saved["step"] == 7
        and saved["val_target"] == "v"
    )
    gallery = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    stated = f"threshold {saved['threshold']:.4f}: the run's own, at FAR 0.1 on v (20 different-person pairs"
    assert identify([model, "--gallery", gallery, query]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(stated)
    onnx_path = str(tmp_path / "m.onnx")
    assert export_onnx([model, onnx_path]) == 0
    capsys.readouterr()
    assert compare([onnx_path, query, query]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith(stated)


def test_identify_eval_plot_is_checked_before_the_evaluation(tmp_path, capsys, monkeypatch):
    from shardface.scripts import identify_eval as tool

    model = seeded_model(tmp_path / "m", 0)
    root = gallery_folder(tmp_path / "g", (3, 3, 2, 1, 3))
    monkeypatch.setattr(tool, "model_from", lambda *a, **k: pytest.fail("evaluated before checking --plot"))
    (tmp_path / "curves.png").write_bytes(b"an earlier plot")
    (tmp_path / "plots").mkdir()
    for plot, said in (
        (tmp_path / "curves.png", "exists; pass --overwrite to replace it"),
        (tmp_path / "plots", "is a directory; name a file"),
        (tmp_path / "no" / "c.png", "does not exist"),
    ):
        assert tool.main([model, root, "--plot", str(plot)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --plot {plot}") and said in err and err.count("\n") == 1
    assert (tmp_path / "curves.png").read_bytes() == b"an earlier plot"


def test_identify_eval_embeds_batch_by_batch_with_progress_and_the_same_figures(tmp_path, capsys):
    """A folder larger than a batch: progress with an ETA on stderr, and batches of 4 give the
    figures one batch of all gives."""
    from shardface.scripts.identify_eval import main as identify_eval

    model = seeded_model(tmp_path / "m", 0)
    root = gallery_folder(tmp_path / "g", (3, 3, 2, 2, 3))
    args = [model, root, "--gallery_per_id", "1", "--unknown_ids", "1"]
    assert identify_eval([*args, "--batch_size", "64"]) == 0
    whole = capsys.readouterr()
    assert identify_eval([*args, "--batch_size", "4"]) == 0
    batched = capsys.readouterr()
    assert batched.out == whole.out and "rank-1" in whole.out
    assert "embedding: 100%" in batched.err and "13/13 [" in batched.err and "embedding" not in whole.err


def test_a_person_called_unknown_is_named_when_they_match_and_nobody_is_null_in_json(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    people = tmp_path / "g"
    os.makedirs(people / "unknown")
    face = noise_face(people / "unknown" / "0.png", 1)
    code, out, _ = run_identify(capsys, model, "--gallery", str(people), "--threshold", "0.5", face)
    assert code == 0 and out.splitlines()[-1].endswith("unknown 1.0000")  # a match, not "unknown (best ..."
    stranger = noise_face(tmp_path / "q.png", 2)
    code, out, _ = run_identify(
        capsys, model, "--gallery", str(people), "--threshold", "0.9999", "--json", stranger
    )
    assert json.loads(out)["faces"][0]["name"] is None


def test_a_persons_name_with_a_line_break_is_refused_before_any_work(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    people = tmp_path / "g"
    os.makedirs(people / "eve\nmallory  0.99")
    noise_face(people / "eve\nmallory  0.99" / "0.png", 1)
    code, out, err = run_identify(capsys, model, "--gallery", str(people), noise_face(tmp_path / "q.png", 2))
    assert code == 2 and out == "" and "a person's name with a line break" in err and err.count("\n") == 1


def test_a_query_named_twice_is_answered_once(tmp_path, capsys):
    model = seeded_model(tmp_path / "m", 0)
    people = gallery_folder(tmp_path / "g")
    query = noise_face(tmp_path / "q.png", 5)
    code, out, _ = run_identify(capsys, model, "--gallery", people, query, query)
    assert code == 0 and sum(line.startswith(query) for line in out.splitlines()) == 1


def test_a_person_without_a_face_stops_the_gallery_after_the_others_are_saved(tmp_path):
    from PIL import Image

    from shardface.infer.enrolment import GalleryError, default_cache

    model = load_model(seeded_model(tmp_path / "m", 0))
    people = tmp_path / "g"
    os.makedirs(people / "wall")
    Image.new("RGB", (160, 160), (120, 140, 160)).save(people / "wall" / "0.png")
    os.makedirs(people / "eve")
    Image.fromarray(np.zeros((160, 160, 3), np.uint8)).save(people / "eve" / "0.png")
    with pytest.raises(GalleryError, match="no face found in any of"):
        enrol(str(people), model, align=True, show_progress=False)
    # the searches are kept: a rerun with a photo added is quick
    assert os.path.isfile(default_cache(str(people)))
