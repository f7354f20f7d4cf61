"""train.py with a teacher (issue #29): exact resume, the projection checkpointed but not
exported, one teacher in three forms, teacher files (made, used, refused), start checks."""

import os
import shutil

import pytest
import torch

from shardface import train
from shardface.backbones import get_model
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.dataset import build_dataset, normalize_images
from shardface.distill.teacher import OnlineTeacher
from shardface.distill.teacher_file import TeacherFile
from shardface.errors import ConfigError
from shardface.faces.align import ARCFACE_112
from shardface.infer.model import Model, load_model
from shardface.scripts.export_onnx import main as export_onnx
from shardface.scripts.teach import main as teach
from tests.distributed import run_distributed
from tests.tool_files import jpeg
from tests.train_runs import checkpoint_tensors, train_argv

STEPS = 8


def _run(rank, world_size, args):
    return train.main(args)


def _argv(data, out, teacher, *extra):
    return train_argv(
        data, out, "--teacher", teacher, "--teacher_network", "tiny", "--max_steps", str(STEPS), *extra
    )


@pytest.fixture(scope="module")
def distilled(drawn_faces, teacher_pt, tmp_path_factory):
    """W=2, cosine with a projection: uninterrupted, and stopped at step 4 then resumed."""
    base = tmp_path_factory.mktemp("distilled")
    full, cut = str(base / "full"), str(base / "cut")
    assert run_distributed(_run, 2, _argv(drawn_faces, full, teacher_pt)) == [0, 0]
    assert run_distributed(_run, 2, _argv(drawn_faces, cut, teacher_pt, "--stop_after_steps", "4")) == [0, 0]
    assert run_distributed(_run, 2, _argv(drawn_faces, cut, teacher_pt, "--resume", "true")) == [0, 0]
    return {"full": full, "cut": cut}


@pytest.mark.slow
def test_resumed_distillation_matches_uninterrupted_run(distilled):
    a, b = checkpoint_tensors(distilled["full"]), checkpoint_tensors(distilled["cut"])
    assert "backbone.distill_projection.weight" in a and "ema.distill_projection.weight" in a
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.slow
def test_projection_is_trained_and_checkpointed_but_not_exported(distilled):
    ckpt = resolve_checkpoint(distilled["full"])
    optimizer = torch.load(os.path.join(ckpt, "optimizer.pt"))
    assert "distill_projection.weight" in optimizer["state"]  # its momentum, by name (any W)
    exported = torch.load(os.path.join(distilled["full"], "model.pt"))
    assert not [k for k in exported if "distill" in k]
    load_model(distilled["full"])  # the run loads as a MODEL without it


def _batch(data, n=6):
    dataset = build_dataset(data, 16, train=False, normalize=False)
    return normalize_images(torch.stack([dataset[i][0] for i in range(n)]))


@pytest.mark.slow
def test_one_teacher_as_run_model_pt_and_onnx_gives_the_same_targets(distilled, drawn_faces, tmp_path):
    run = str(tmp_path / "run")
    shutil.copytree(distilled["full"], run)
    export_onnx([run, str(tmp_path / "t.onnx")])
    images = _batch(drawn_faces)
    targets = [
        OnlineTeacher(load_model(m), torch.device("cpu")).targets(images, None)
        for m in (run, os.path.join(run, "model.pt"), str(tmp_path / "t.onnx"))
    ]
    assert targets[0].shape == (6, 128)
    for other in targets[1:]:
        torch.testing.assert_close(other, targets[0], rtol=0, atol=1e-4)


def _folder_set(root):
    for who, colour in enumerate([(200, 30, 30), (30, 200, 30)]):
        os.makedirs(os.path.join(root, f"id{who}"))
        for i in range(4):
            with open(os.path.join(root, f"id{who}", f"{i}.jpg"), "wb") as f:
                f.write(jpeg(tuple(c + 5 * i for c in colour)))
    return root


@pytest.mark.slow
def test_teacher_file_trains_relational_and_other_data_is_refused(drawn_faces, teacher_pt, tmp_path):
    own, other = str(tmp_path / "own.teacher"), str(tmp_path / "other.teacher")
    assert teach([teacher_pt, drawn_faces, own, "--network", "tiny", "--num_workers", "0"]) == 0
    assert (
        teach(
            [
                teacher_pt,
                _folder_set(str(tmp_path / "folders")),
                other,
                "--network",
                "tiny",
                "--num_workers",
                "0",
            ]
        )
        == 0
    )
    rows = TeacherFile(own)
    assert rows.rows.shape == (128, 64) and rows.rows.dtype == "float16"
    # the row of record i is the teacher's flip-fused embedding of record i
    teacher = OnlineTeacher(load_model(teacher_pt, "tiny"), torch.device("cpu"))
    images = _batch(drawn_faces, 3)
    want = torch.nn.functional.normalize(
        teacher.targets(images, None) + teacher.targets(images.flip(3), None)
    )
    torch.testing.assert_close(rows.targets(images, rows.read(torch.arange(3))), want, rtol=0, atol=2e-3)

    out = str(tmp_path / "from_file")
    args = train_argv(drawn_faces, out, "--teacher", own, "--distill_loss", "relational", "--max_steps", "4")
    assert run_distributed(_run, 2, args) == [0, 0]
    assert resolve_checkpoint(out).endswith("checkpoint-00000004")

    with pytest.raises(ConfigError) as refused:
        train.main(train_argv(drawn_faces, str(tmp_path / "refused"), "--teacher", other))
    message = str(refused.value)
    assert (
        "belongs to other data" in message and str(tmp_path / "folders") in message and drawn_faces in message
    )
    assert not os.path.exists(str(tmp_path / "refused" / "checkpoint-00000000"))


def test_teacher_that_does_not_take_its_input_is_one_error_at_start():
    net = get_model("tiny", num_features=32)  # 112x112 only: its fc is sized for 7x7 maps
    with pytest.raises(ConfigError, match="does not take its 150x150 input"):
        OnlineTeacher(Model(net, ARCFACE_112.scaled(150), "t150", "x"), torch.device("cpu"))


def test_teacher_that_does_not_give_n_by_d_embeddings_is_one_error_at_start():
    maps = torch.nn.Conv2d(3, 4, 3)  # feature maps, not embeddings
    with pytest.raises(ConfigError, match=r"returns shape \(2, 4, 110, 110\)"):
        OnlineTeacher(Model(maps, ARCFACE_112, "maps", "x"), torch.device("cpu"))


def test_teacher_on_another_template_gets_its_own_crops():
    """A 150x150 teacher (dlib's chip size) is fed 150x150 re-framed crops of the 112 batch."""
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            seen.append(tuple(x.shape))
            return x.mean(dim=(2, 3)) * self.w

    teacher = OnlineTeacher(Model(Probe(), ARCFACE_112.scaled(150), "p", "x"), torch.device("cpu"))
    assert teacher.dim == 3 and seen[-1] == (2, 3, 150, 150)
    teacher.targets(torch.zeros(5, 3, 112, 112), None)
    assert seen[-1] == (5, 3, 150, 150)


def test_planner_counts_an_on_the_fly_teacher(teacher_pt):
    from shardface.configs import get_config
    from shardface.planner import plan

    base = ["--num_classes", "1000", "--batch_size", "16"]
    without = plan(get_config("configs/demo.py", base), 2)
    cfg = get_config("configs/demo.py", base + ["--teacher", teacher_pt, "--teacher_network", "tiny"])
    with_teacher = plan(cfg, 2)
    weights = sum(v.numel() * 4 for v in torch.load(teacher_pt).values() if v.is_floating_point())
    assert with_teacher.parts["teacher weights"] == weights
    # the first conv's input (16 x 3 x 112 x 112) and output (16 x 16 x 56 x 56) at least
    assert with_teacher.parts["teacher forward"] >= 16 * (3 * 112 * 112 + 16 * 56 * 56) * 4
    assert with_teacher.total - without.total == weights + with_teacher.parts["teacher forward"]


def test_loader_yields_each_image_with_its_record_index(drawn_faces):
    """What a teacher file's rows are read by: shuffled, on rank 1 of 2, mid-epoch."""
    from shardface.dataset import ResumableDistributedSampler, get_dataloader

    dataset = build_dataset(drawn_faces, 16, train=True, normalize=False)
    sampler = ResumableDistributedSampler(len(dataset), 2, 1, 8, seed=3)
    sampler.set_epoch(1, 2)
    dataset.set_epoch(1, 3)
    images, labels, indices = next(iter(get_dataloader(dataset, sampler, 0, with_index=True)))
    assert indices.tolist() == sampler.epoch_indices()[16:24].tolist()
    for image, label, index in zip(images, labels, indices.tolist()):
        want_image, want_label = dataset[index]
        assert torch.equal(image, want_image) and int(label) == int(want_label)


@pytest.mark.slow
def test_distillation_checkpoint_resumes_on_one_rank(distilled, drawn_faces, teacher_pt, tmp_path):
    out = str(tmp_path / "one_rank")
    os.makedirs(out)
    shutil.copytree(
        os.path.join(distilled["full"], "checkpoint-00000004"), os.path.join(out, "checkpoint-00000004")
    )
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("checkpoint-00000004\n")
    before = checkpoint_tensors(out)
    args = _argv(drawn_faces, out, teacher_pt, "--resume", "true", "--stop_after_steps", "2")
    assert run_distributed(_run, 1, args) == [0]
    after = checkpoint_tensors(out)
    assert resolve_checkpoint(out).endswith("checkpoint-00000006")
    assert not torch.equal(
        after["backbone.distill_projection.weight"], before["backbone.distill_projection.weight"]
    )
