"""MODEL `dlib`: the torch port of dlib's face descriptor equals dlib's own (dlib is the
reference here and only here), on dlib's own chip; its file reader refuses damaged files by
offset; the 112 front is the embedder's re-framing; ONNX export agrees and records the chip;
init_backbone `dlib` fine-tunes on 112 crops."""

import json
import math
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image

from shardface.backbones import get_model
from shardface.backbones.dlib_resnet import DlibResNet, add_prev
from shardface.checkpoint.dlib_format import DlibFormatError, read_network, state_dict_for
from shardface.faces.align import ARCFACE_112, align
from shardface.faces.dlib_chip import DLIB_150, DLIB_150_SHAPE5, chip_transform, dlib_chip
from shardface.faces.models import model_file
from shardface.infer.model import Model, load_model
from shardface.infer.weights import DLIB_FILE, dlib_state

dlib = pytest.importorskip("dlib")


@pytest.fixture(scope="module")
def astronaut():
    """skimage's astronaut photo, dlib's 5-point shape of its face and dlib's descriptor of it."""
    from skimage import data

    img = data.astronaut()
    box = max(dlib.get_frontal_face_detector()(img, 0), key=lambda r: r.area())
    shape = dlib.shape_predictor(model_file("shape_predictor_5_face_landmarks.dat"))(img, box)
    descriptor = dlib.face_recognition_model_v1(model_file(DLIB_FILE)).compute_face_descriptor(img, shape)
    points = np.array([[p.x, p.y] for p in shape.parts()], np.float64)
    return {"img": img, "shape": shape, "points": points, "descriptor": np.array(descriptor)}


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def embed_chip(embedder: Model, chip: Image.Image) -> np.ndarray:
    x = torch.from_numpy(np.asarray(chip).copy()).permute(2, 0, 1)[None]
    with torch.no_grad():
        return embedder.module(embedder.reframe(x, embedder.template)).cpu().numpy()[0]


@pytest.mark.parametrize("zoom", [1, 3])
def test_dlib_chip_is_dlibs_own_chip_pixel_for_pixel(astronaut, zoom):
    """At 3x the face is over twice the chip's size: dlib halves the photo with its pyramid first."""
    img, points = astronaut["img"], astronaut["points"] * zoom + (zoom - 1) / 2
    if zoom != 1:
        img = np.asarray(Image.fromarray(img).resize((512 * zoom,) * 2, Image.BICUBIC))
    shape = dlib.full_object_detection(
        dlib.rectangle(0, 0, img.shape[1] - 1, img.shape[0] - 1),
        [dlib.point(int(round(x)), int(round(y))) for x, y in points],
    )
    points = np.array([[p.x, p.y] for p in shape.parts()], np.float64)
    ours = np.asarray(dlib_chip(Image.fromarray(img), points)).astype(int)
    theirs = np.asarray(dlib.get_face_chip(img, shape, 150, 0.25)).astype(int)
    assert np.abs(ours - theirs).max() <= 1


def test_torch_port_gives_dlibs_descriptor_on_the_astronaut_photo(astronaut):
    embedder = load_model("dlib")
    assert embedder.template is DLIB_150 and embedder.name == "dlib"
    out = embed_chip(embedder, dlib_chip(Image.fromarray(astronaut["img"]), astronaut["points"]))
    assert out.shape == (128,)
    assert cosine(out, astronaut["descriptor"]) >= 0.9999
    # dlib's scale too, not only its direction
    np.testing.assert_allclose(out, astronaut["descriptor"], atol=1e-4)


@pytest.mark.slow
def test_chip_of_the_insightface_points_template_is_close_to_dlibs(astronaut):
    """DLIB_150 places insightface's five points where dlib's mean face has them: aligning by
    them (any detector's landmarks) gives nearly dlib's chip. Here the five points are read off
    dlib's own chip transform, so the residual is the two templates' disagreement alone."""
    to_photo = chip_transform(astronaut["points"])
    landmarks = DLIB_150.points @ to_photo[:, :2].T + to_photo[:, 2]
    embedder = load_model("dlib")
    photo = Image.fromarray(astronaut["img"])
    by_five = embed_chip(embedder, align(photo, landmarks, DLIB_150))
    by_shape = embed_chip(embedder, align(photo, astronaut["points"], DLIB_150_SHAPE5))
    assert cosine(by_five, astronaut["descriptor"]) >= 0.995
    assert cosine(by_shape, astronaut["descriptor"]) >= 0.995


def test_reframed_112_crop_costs_dlib_little_against_its_own_chip(astronaut):
    """What verify does with a .bin set's insightface 112x112 crop: re-frame it onto dlib's chip
    (forehead and chin fall outside it: black). The crop here is cut with the chip's own
    geometry, so only the framing is measured: 0.995 cosine, 0.14 in dlib's distance units
    (its same-person threshold is 0.6) on this photo."""
    embedder = load_model("dlib")
    photo = Image.fromarray(astronaut["img"])
    to_photo = chip_transform(astronaut["points"])
    crop = align(photo, DLIB_150.points @ to_photo[:, :2].T + to_photo[:, 2], ARCFACE_112)
    x = torch.from_numpy(np.asarray(crop).copy()).permute(2, 0, 1)[None]
    with torch.no_grad():
        reframed = embedder.module_for(ARCFACE_112)(x.float().sub(127.5).div(127.5)).cpu().numpy()[0]
    assert cosine(reframed, astronaut["descriptor"]) >= 0.99
    assert np.linalg.norm(reframed - astronaut["descriptor"]) < 0.2


@pytest.mark.slow
def test_verify_runs_dlib_on_a_bin_set_reframing_its_112_crops(drawn_faces, capsys):
    from shardface.scripts.make_drawn_faces import VAL_NAME
    from shardface.scripts.verify import main as verify

    assert verify(["dlib", "--bin", os.path.join(drawn_faces, f"{VAL_NAME}.bin")]) == 0
    out = capsys.readouterr().out
    assert "dlib takes dlib-150 crops: the sets' arcface-112 crops are re-framed onto it" in out
    assert f"{VAL_NAME}.bin" in out


def test_embed_no_flip_of_a_dlib_chip_is_dlibs_descriptor(astronaut, tmp_path):
    from shardface.scripts.embed import main as embed

    chip = tmp_path / "chip.png"
    dlib_chip(Image.fromarray(astronaut["img"]), astronaut["points"]).save(chip)
    out = tmp_path / "e.npy"
    assert embed(["dlib", str(chip), "--out", str(out), "--no_flip"]) == 0
    row = np.load(out)[0]
    assert math.isclose(float(np.linalg.norm(row)), 1.0, rel_tol=1e-5)
    assert cosine(row, astronaut["descriptor"]) >= 0.9999
    assert embed(["dlib", str(chip), "--out", str(tmp_path / "f.npy")]) == 0  # flip-fused: another vector
    assert cosine(np.load(tmp_path / "f.npy")[0], row) < 0.9999


def test_dlib_file_reader_reads_the_network_dlib_defines():
    net = read_network(model_file(DLIB_FILE))
    kinds = [layer.kind for layer in net.layers]
    assert net.loss == "loss_metric_2" and (net.input["rows"], net.input["cols"]) == (150, 150)
    assert kinds.count("con") == kinds.count("affine") == 29 and kinds.count("add_prev") == 14
    assert kinds[-1] == "fc" and net.layers[-1].attrs["num_outputs"] == 128


@pytest.mark.parametrize("cut", [3, 400, 5_000_000, -1])
def test_truncated_dlib_file_is_refused_naming_file_and_offset(tmp_path, cut):
    data = open(model_file(DLIB_FILE), "rb").read()
    bad = tmp_path / "cut.dat"
    bad.write_bytes(data[:cut])
    with pytest.raises(DlibFormatError, match=rf"{bad}: .* at byte \d+ of {len(data[:cut])}"):
        read_network(str(bad))


def test_damaged_or_foreign_dlib_files_are_refused_by_name(tmp_path):
    data = bytearray(open(model_file(DLIB_FILE), "rb").read())
    extra = tmp_path / "extra.dat"
    extra.write_bytes(bytes(data) + b"\x00")
    with pytest.raises(DlibFormatError, match=r"1 bytes left after the network"):
        read_network(str(extra))
    foreign = tmp_path / "shape.dat"  # another dlib file: a landmark predictor
    foreign.write_bytes(open(model_file("shape_predictor_5_face_landmarks.dat"), "rb").read())
    with pytest.raises(DlibFormatError, match=r"shape\.dat: "):
        read_network(str(foreign))
    renamed = bytes(data).replace(b"con_4", b"con_9", 1)
    (tmp_path / "v.dat").write_bytes(renamed)
    with pytest.raises(DlibFormatError, match=r"unsupported layer 'con_9' at byte \d+"):
        read_network(str(tmp_path / "v.dat"))


def test_weights_of_another_geometry_are_refused_naming_the_layer():
    net = read_network(model_file(DLIB_FILE))
    wider = DlibResNet(num_features=64)
    with pytest.raises(
        DlibFormatError, match=r"fc_2 at byte \d+: weight has shape \(128, 256\), .*fc.weight \(64, 256\)"
    ):
        state_dict_for(wider, net)


def test_add_prev_sums_top_left_aligned_with_zeros_outside_the_smaller():
    a, b = torch.ones(1, 2, 3, 3), torch.full((1, 4, 4, 4), 10.0)
    out = add_prev(a, b)
    assert out.shape == (1, 4, 4, 4)
    assert torch.equal(out[:, :2, :3, :3], torch.full((1, 2, 3, 3), 11.0))
    assert out[:, 2:].eq(10).all() and out[:, :, 3].eq(10).all() and out[:, :, :, 3].eq(10).all()


def test_112_front_is_the_embedders_reframing_of_insightface_crops():
    chip_net, crop_net = DlibResNet(input_size=150), get_model("dlib_resnet")
    embedder = Model(chip_net, DLIB_150, "test", "")
    crops = torch.randint(
        0, 256, (2, 3, 112, 112), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    expected = chip_net.chip(embedder.reframe(crops, ARCFACE_112))
    torch.testing.assert_close(
        crop_net.chip(crops.float().sub(127.5).div(127.5)), expected, rtol=0, atol=1e-5
    )


@pytest.mark.slow
def test_export_onnx_of_dlib_agrees_with_torch_and_records_its_chip(tmp_path):
    from shardface.scripts.export_onnx import main as export_onnx

    out = tmp_path / "dlib.onnx"
    assert export_onnx(["dlib", str(out)]) == 0
    onnx_embedder, torch_embedder = load_model(str(out)), load_model("dlib")
    assert onnx_embedder.template.name == DLIB_150.name and onnx_embedder.template.size == (150, 150)
    np.testing.assert_allclose(onnx_embedder.template.points, DLIB_150.points)
    x = torch.rand(4, 3, 150, 150, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        diff = (
            (onnx_embedder.module(x) - torch_embedder.module(x.to(torch_embedder.device)).cpu()).abs().max()
        )
    assert float(diff) <= 1e-4


def test_export_onnx_refusals_write_nothing(tmp_path, monkeypatch):
    from shardface.scripts.export_onnx import main as export_onnx

    monkeypatch.chdir(tmp_path)
    assert export_onnx(["dlib"]) == 2  # no run directory to write model.onnx into
    fake = tmp_path / "m.onnx"
    fake.write_bytes(b"not onnx")
    assert export_onnx([str(fake), str(tmp_path / "again.onnx")]) == 2
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]


def test_onnx_template_metadata_is_checked(tmp_path):
    from shardface.checkpoint.files import CheckpointError
    from shardface.infer.onnx import TEMPLATE_KEY, OnnxBackbone

    with pytest.raises(CheckpointError, match=rf"x.onnx: unreadable {TEMPLATE_KEY} metadata"):
        OnnxBackbone._template(str(tmp_path / "x.onnx"), json.dumps({"name": "t", "size": [150]}))
    assert OnnxBackbone._template("x.onnx", None) is ARCFACE_112


@pytest.mark.slow
def test_init_backbone_dlib_fine_tunes_dlibs_network_on_112_crops(drawn_faces, tmp_path):
    from shardface import builders, train
    from tests.train_runs import train_argv

    seen = []
    real = builders.build_backbone

    def spied(cfg):
        model = real(cfg)
        model.register_forward_hook(
            lambda m, args, out: (
                seen.append((args[0].detach().clone(), out.detach().clone())) if not seen else None
            )
        )
        return model

    out = str(tmp_path / "ft")
    mp = pytest.MonkeyPatch()
    mp.setattr(builders, "build_backbone", spied)
    try:
        assert (
            train.main(
                train_argv(
                    drawn_faces,
                    out,
                    "--network",
                    "dlib_resnet",
                    "--embedding_size",
                    "128",
                    "--init_backbone",
                    "dlib",
                    "--max_steps",
                    "2",
                    "--checkpoint_interval",
                    "2",
                    "--ema",
                    "false",
                )
            )
            == 0
        )
    finally:
        mp.undo()
    images, first = seen[0]
    pretrained = get_model("dlib_resnet")
    pretrained.load_state_dict(dlib_state())
    with torch.no_grad():
        expected = pretrained.to(images.device).train()(images)
    torch.testing.assert_close(first, expected, rtol=1e-4, atol=1e-5)
    log = open(os.path.join(out, "training.log")).read()
    # the progress lines ("step 1/2  epoch 0  loss 4.85 ..."); the config dump has keys ending in "loss"
    losses = [float(v) for v in re.findall(r"step \d+/\d+\s+epoch \d+\s+loss (\S+)", log)]
    assert losses and all(math.isfinite(v) for v in losses), log[-2000:]


@pytest.mark.slow
def test_export_onnx_of_dlib_resnet_on_112_crops_keeps_the_batch_dynamic(tmp_path):
    """A fine-tuned `dlib_resnet` (its 112 front a grid_sample) exports with any batch size."""
    from shardface.scripts.export_onnx import check_parity, export

    model = get_model("dlib_resnet").eval()
    export(model, str(tmp_path / "ft.onnx"))
    assert check_parity(model, str(tmp_path / "ft.onnx"), batches=(1, 3)) <= 1e-4
    template = load_model(str(tmp_path / "ft.onnx")).template
    assert template.name == ARCFACE_112.name and template.size == (112, 112)
    np.testing.assert_allclose(template.points, ARCFACE_112.points)


def _lfw_chips(count: int) -> list[np.ndarray]:
    """skimage's LFW faces (25x25, centred like a chip) upscaled to dlib's 150x150: real faces,
    other people than the astronaut."""
    from skimage import data

    return [
        np.asarray(
            Image.fromarray((f * 255).astype(np.uint8)).resize((150, 150), Image.BICUBIC).convert("RGB")
        )
        for f in data.lfw_subset()[:count]
    ]


def test_dlib_threshold_says_what_dlibs_distance_rule_says_on_a_small_fixture(astronaut):
    """MODEL dlib's verdicts at its threshold beside dlib's own rule (distance 0.6 between raw
    descriptors), with the flip test and without: the astronaut's chip, its mirror image and two
    turned copies are one person by both; each of them and each of ten of skimage's LFW faces
    (upscaled) are two people by both. The threshold itself was measured on real photos
    (benchmarks/dlib_verdict.py)."""
    from shardface.infer.thresholds import DLIB_DISTANCE, DLIB_THRESHOLD

    rec = dlib.face_recognition_model_v1(model_file(DLIB_FILE))
    chip = dlib_chip(Image.fromarray(astronaut["img"]), astronaut["points"])
    her = [chip, chip.transpose(Image.FLIP_LEFT_RIGHT), chip.rotate(4), chip.rotate(-4)]
    others = [Image.fromarray(c) for c in _lfw_chips(10)]
    raw = np.array([np.array(rec.compute_face_descriptor(np.asarray(c))) for c in her + others])
    rows, cols = np.triu_indices(len(her), 1)  # her pairs
    theirs = [(i, j) for i in range(len(her)) for j in range(len(her), len(raw))]  # hers with others'
    dist = np.linalg.norm(raw[:, None] - raw[None], axis=2)
    assert (dist[rows, cols] <= DLIB_DISTANCE).all() and all(dist[i, j] > DLIB_DISTANCE for i, j in theirs)
    model = load_model("dlib")
    assert model.threshold.value == DLIB_THRESHOLD
    for flip in (True, False):
        emb = model.embed(her + others, align=False, flip=flip).astype(np.float64)
        cos = emb @ emb.T
        assert (cos[rows, cols] >= DLIB_THRESHOLD).all(), (flip, cos[rows, cols])
        assert all(cos[i, j] < DLIB_THRESHOLD for i, j in theirs), flip


def test_export_onnx_of_dlib_carries_its_threshold_into_the_onnx(tmp_path, capsys):
    from shardface.infer.thresholds import DLIB_THRESHOLD
    from shardface.scripts.export_onnx import main as export_onnx

    out = str(tmp_path / "dlib.onnx")
    assert export_onnx(["dlib", out]) == 0
    assert f"with the model's threshold {DLIB_THRESHOLD:.4f} (dlib's own rule)" in capsys.readouterr().out
    exported = load_model(out)
    assert exported.threshold.value == DLIB_THRESHOLD and exported.threshold.source.startswith(
        "dlib's own rule"
    )


def test_identify_dlib_calls_a_stranger_unknown_at_dlibs_own_threshold(astronaut, tmp_path, capsys):
    from shardface.infer.thresholds import DLIB_THRESHOLD
    from shardface.scripts.identify import main as identify

    chip = dlib_chip(Image.fromarray(astronaut["img"]), astronaut["points"])
    os.makedirs(tmp_path / "g" / "eileen")
    chip.save(tmp_path / "g" / "eileen" / "chip.png")
    mirror, stranger = str(tmp_path / "mirror.png"), str(tmp_path / "stranger.png")
    chip.transpose(Image.FLIP_LEFT_RIGHT).save(mirror)
    Image.fromarray(_lfw_chips(1)[0]).save(stranger)
    assert identify(["dlib", "--gallery", str(tmp_path / "g"), mirror, stranger]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"threshold {DLIB_THRESHOLD:.4f}: dlib's own rule, distance 0.6")
    assert lines[1].startswith(f"{mirror}  face 0") and "  eileen " in lines[1]
    assert lines[2].startswith(f"{stranger}  face 0") and "  unknown (best eileen " in lines[2]
