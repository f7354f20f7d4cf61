"""Label-free training (issue #29, docs/distillation.md): `num_classes 0` with a teacher trains
on the distillation loss alone, with no margin head, on data without identities."""

import os
import re
import shutil

import pytest
import torch

from shardface import train
from shardface.checkpoint.folders import resolve_checkpoint
from shardface.configs import get_config
from shardface.dataset import FolderFaceDataset, build_dataset
from shardface.distill.teacher_file import TeacherFile
from shardface.errors import ConfigError
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.teach import main as teach
from tests.distributed import run_distributed
from tests.tool_files import jpeg
from tests.train_runs import train_argv


def _write(path, colour):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(jpeg(colour))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """16 photos of nobody in particular: 6 in the folder itself, 10 in sub-folders that are not
    people (two levels), plus a file that is not an image."""
    root = str(tmp_path_factory.mktemp("photos") / "photos")
    names = (
        [f"p{i}.jpg" for i in range(6)]
        + [f"2024/holiday/h{i}.png" for i in range(4)]
        + [f"2023/s{i}.jpeg" for i in range(6)]
    )
    for i, name in enumerate(names):
        _write(os.path.join(root, name), (20 + 13 * i, 200 - 9 * i, (70 * i) % 250))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("not an image")
    return root


def _argv(data, out, teacher, *extra):
    return train_argv(
        data,
        out,
        "--num_classes",
        "0",
        "--teacher",
        teacher,
        "--teacher_network",
        "tiny",
        "--checkpoint_interval",
        "2",
        *extra,
    )


def _losses(out):
    with open(os.path.join(out, "training.log")) as f:
        return [float(v) for v in re.findall(r"loss ([-+0-9.e]+|nan|inf)", f.read())]


def _run(rank, world_size, args):
    return train.main(args)


def test_num_classes_0_without_a_teacher_or_with_weight_0_is_one_error_line(drawn_faces, tmp_path, capsys):
    out = str(tmp_path / "refused")
    argv = train_argv(drawn_faces, out, "--num_classes", "0")
    with pytest.raises(ConfigError, match=r"^config num_classes = 0: label-free training needs a teacher"):
        get_config(argv[0], argv[1:])
    assert exits_on_user_error(train.main)(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: config num_classes = 0") and "--teacher" in err[0]
    assert not os.path.exists(out)
    with pytest.raises(
        ConfigError, match=r"^config distill_weight = 0.0: with num_classes 0 the distillation loss is"
    ):
        get_config(argv[0], argv[1:] + ["--teacher", "t.teacher", "--distill_weight", "0.0"])


def test_folder_without_identities_reads_every_image_under_it(photos):
    data = FolderFaceDataset(photos, train=False, normalize=False, label_free=True)
    paths = [os.path.relpath(p, photos) for p, _ in data.samples]
    # the folder's own images first, then each sub-folder depth first, sorted at every level
    assert paths == [f"p{i}.jpg" for i in range(6)] + [f"2023/s{i}.jpeg" for i in range(6)] + [
        f"2024/holiday/h{i}.png" for i in range(4)
    ]
    assert {int(data[i][1]) for i in range(len(data))} == {0} and data.num_classes == 0
    assert build_dataset(photos, 0, normalize=False).fingerprint() == data.fingerprint()


def test_identity_folders_read_label_free_keep_their_order(tmp_path):
    """One teacher file serves a run with identities and a label-free run on the same folder."""
    root = str(tmp_path / "people")
    for who in ("ann", "bob", "bob-2"):  # '-' sorts before '/': folder order, not path order
        for i in range(2):
            _write(os.path.join(root, who, f"{i}.jpg"), (40 * i + 30, 100, 150))
    with_ids = build_dataset(root, 3, normalize=False)
    label_free = build_dataset(root, 0, normalize=False)
    assert [p for p, _ in label_free.samples] == [p for p, _ in with_ids.samples]
    assert label_free.fingerprint() == with_ids.fingerprint()


def test_packed_set_labels_are_not_read_label_free(drawn_faces):
    """The demo set's property says 16 classes: num_classes 0 ignores them (label 0 for all)."""
    data = build_dataset(drawn_faces, 0, normalize=False)
    assert len(data) == 128 and {int(data[i][1]) for i in range(0, 128, 9)} == {0}
    with pytest.raises(Exception, match="16 classes, config num_classes is 3"):
        build_dataset(drawn_faces, 3, normalize=False)


def test_label_free_run_trains_with_no_head_and_writes_model_pt(photos, teacher_pt, tmp_path):
    out = str(tmp_path / "run")
    assert train.main(_argv(photos, out, teacher_pt, "--max_steps", "2")) == 0
    losses = _losses(out)
    assert len(losses) == 2 and all(map(torch.isfinite, torch.tensor(losses)))
    assert os.path.isfile(os.path.join(out, "model.pt"))
    ckpt = resolve_checkpoint(out)
    assert not [f for f in os.listdir(ckpt) if f.startswith("head")]
    assert torch.load(os.path.join(ckpt, "meta.pt"))["num_classes"] == 0


def test_label_free_step_under_ddp_gradient_acc_and_clipping(photos, teacher_pt, tmp_path):
    """The step's other paths with no head: DDP's no_sync micro-batches and a clip that binds,
    over the backbone (and projection) alone."""
    out = str(tmp_path / "ddp")
    args = _argv(
        photos,
        out,
        teacher_pt,
        "--zero",
        "false",
        "--gradient_acc",
        "2",
        "--max_grad_norm",
        "0.01",
        "--max_steps",
        "1",
    )
    assert train.main(args) == 0
    assert resolve_checkpoint(out).endswith("checkpoint-00000001") and len(_losses(out)) == 1


def test_planner_counts_no_head_label_free(teacher_pt):
    from shardface.planner import plan

    base = ["--batch_size", "16", "--teacher", teacher_pt, "--teacher_network", "tiny"]
    with_head = plan(get_config("configs/demo.py", base + ["--num_classes", "1000"]), 2)
    cosine = plan(get_config("configs/demo.py", base + ["--num_classes", "0"]), 2)
    relational = plan(
        get_config("configs/demo.py", base + ["--num_classes", "0", "--distill_loss", "relational"]), 2
    )
    assert with_head.head_bytes() > 0 and cosine.head_bytes() == 0
    assert with_head.total - cosine.total == with_head.head_bytes()
    assert list(cosine.sends) == ["ZeRO-2 gradients + parameters"]
    assert relational.sends["embeddings all-gather"] == with_head.sends["embeddings all-gather"]
    assert "labels all-gather" not in relational.sends


def test_label_free_builds_no_head_nor_head_optimizer(teacher_pt):
    from shardface.builders import build_head, build_head_optimizer

    cfg = get_config("configs/demo.py", ["--num_classes", "0", "--teacher", teacher_pt])
    assert build_head(cfg) is None and build_head_optimizer(cfg, None) is None


def _saved(out, step):
    ckpt = os.path.join(out, f"checkpoint-{step:08d}")
    tensors = {f"backbone.{k}": v for k, v in torch.load(os.path.join(ckpt, "backbone.pt")).items()}
    tensors.update({f"ema.{k}": v for k, v in torch.load(os.path.join(ckpt, "ema.pt"))["state"].items()})
    for name, state in torch.load(os.path.join(ckpt, "optimizer.pt"))["state"].items():
        tensors.update({f"opt.{name}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return tensors


@pytest.fixture(scope="module")
def relational_runs(photos, teacher_pt, tmp_path_factory):
    """W=2, relational, from a teacher file made from the label-free folder: uninterrupted, and
    stopped at step 2 then resumed."""
    base = tmp_path_factory.mktemp("relational")
    rows = str(base / "photos.teacher")
    assert teach([teacher_pt, photos, rows, "--network", "tiny", "--num_workers", "0"]) == 0
    full, cut = str(base / "full"), str(base / "cut")

    def argv(out, *extra):
        return _argv(
            photos, out, rows, "--distill_loss", "relational", "--num_epoch", "10", "--max_steps", "4", *extra
        )

    assert run_distributed(_run, 2, argv(full)) == [0, 0]
    assert run_distributed(_run, 2, argv(cut, "--stop_after_steps", "2")) == [0, 0]
    assert run_distributed(_run, 2, argv(cut, "--resume", "true")) == [0, 0]
    return {"rows": rows, "full": full, "cut": cut, "argv": argv}


@pytest.mark.slow
def test_label_free_checkpoint_resumes_exactly_at_two_ranks(relational_runs, photos):
    rows = TeacherFile(relational_runs["rows"])
    assert rows.size == 16 and rows.header["data_fingerprint"] == build_dataset(photos, 0).fingerprint()
    a, b = _saved(relational_runs["full"], 4), _saved(relational_runs["cut"], 4)
    assert any(k.startswith("opt.") for k in a) and a.keys() == b.keys()
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert all(map(torch.isfinite, torch.tensor(_losses(relational_runs["full"]))))


@pytest.mark.slow
def test_label_free_checkpoint_of_two_ranks_resumes_on_one(relational_runs, tmp_path):
    out = str(tmp_path / "one_rank")
    os.makedirs(out)
    shutil.copytree(
        os.path.join(relational_runs["full"], "checkpoint-00000002"), os.path.join(out, "checkpoint-00000002")
    )
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("checkpoint-00000002\n")
    assert train.main(relational_runs["argv"](out, "--resume", "true", "--stop_after_steps", "1")) == 0
    assert resolve_checkpoint(out).endswith("checkpoint-00000003")
    before, after = _saved(out, 2), _saved(out, 3)
    assert not torch.equal(after["backbone.fc.weight"], before["backbone.fc.weight"])


def test_label_free_save_refuses_finite_weights_whose_embeddings_overflow():
    """With no head the checkpoint probe is the batch's embeddings: finite weights that give
    inf embeddings are not saved."""
    from shardface.utils.divergence import TrainingStopped, check_weights

    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    batch = (torch.ones(2, 3, 2, 2), torch.zeros(2, dtype=torch.long))
    check_weights(1, net, None, batch)
    with torch.no_grad():
        net[1].weight.fill_(1e38)  # finite in fp32; 12 of them summed are not
    with pytest.raises(TrainingStopped, match="give loss nan on the last batch"):
        check_weights(2, net, None, batch)
