"""scripts.teach and its teacher files (issue #34): the output rule (checked before the work,
--overwrite, never one of the files it reads), a data fingerprint of the images' content and
the way they were read, and teacher files that are old, cut or hold non-finite or non-unit rows
(zero, near zero) refused at open in one line naming the file."""

import os
import shutil

import numpy as np
import pytest
import torch

from shardface import train
from shardface.builders import build_train_dataset
from shardface.configs import get_config
from shardface.distill.run import Distillation
from shardface.distill.teacher_file import MAGIC, TeacherFile, header_bytes
from shardface.errors import ConfigError, ModelError
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.teach import main as teach
from tests.tool_files import photos, tiny_model
from tests.train_runs import train_argv


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return photos(tmp_path_factory.mktemp("data") / "people", ids=2, per_id=3)


@pytest.fixture(scope="module")
def made(model, folder, tmp_path_factory) -> str:
    """A teacher file of `folder`."""
    out = str(tmp_path_factory.mktemp("made") / "people.teacher")
    assert teach([model, folder, out, "--num_workers", "0"]) == 0
    return out


def _refused(capsys, argv, *protected) -> str:
    """teach's one error line; the `protected` files are as they were."""
    before = [open(p, "rb").read() for p in protected]
    assert teach(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert [open(p, "rb").read() for p in protected] == before
    return err[0]


def test_teach_never_writes_over_a_packed_set_it_reads(model, drawn_faces, tmp_path, capsys):
    data = str(tmp_path / "set")
    shutil.copytree(drawn_faces, data)
    idx, rec = os.path.join(data, "train.idx"), os.path.join(data, "train.rec")
    os.symlink(idx, str(tmp_path / "link.idx"))
    for out in (idx, str(tmp_path / "link.idx"), rec):
        err = _refused(capsys, [model, data, out, "--overwrite", "--num_workers", "0"], idx, rec)
        assert "is also an input" in err and out in err
    # the set still reads, and a teacher file of it is made beside it
    assert teach([model, data, os.path.join(data, "set.teacher"), "--num_workers", "0"]) == 0


def test_teach_never_writes_over_the_model_or_its_config(model, folder, capsys):
    config = os.path.join(os.path.dirname(model), "config.json")
    for out in (model, config):
        err = _refused(capsys, [model, folder, out, "--overwrite", "--num_workers", "0"], model, config)
        assert "is also an input" in err
    err = _refused(
        capsys,
        [model, folder, os.path.join(folder, "id0", "0.jpg"), "--overwrite"],
        os.path.join(folder, "id0", "0.jpg"),
    )
    assert "is also an input" in err


def test_teach_never_writes_over_a_runs_model_pt(drawn_faces, folder, tmp_path, capsys):
    run = str(tmp_path / "run")
    assert (
        train.main(
            train_argv(drawn_faces, run, "--max_steps", "1", "--checkpoint_interval", "1", "--ema", "false")
        )
        == 0
    )
    pt = os.path.join(run, "model.pt")
    err = _refused(capsys, [run, folder, pt, "--overwrite", "--num_workers", "0"], pt)
    assert "is also an input" in err and pt in err


def test_teach_checks_its_output_before_the_work_and_replaces_only_with_overwrite(
    model, folder, made, tmp_path, capsys
):
    missing_model = str(tmp_path / "no_such_model.pt")  # loading it would be the first failure of the work
    err = _refused(capsys, [missing_model, folder, made], made)
    assert err == f"error: OUT {made} exists; pass --overwrite to replace it"
    err = _refused(capsys, [missing_model, folder, str(tmp_path)])
    assert err == f"error: OUT {tmp_path} is a directory; name a file"
    assert os.listdir(tmp_path) == []
    copy = str(tmp_path / "copy.teacher")
    shutil.copy(made, copy)
    with open(copy, "r+b") as f:  # one byte of a row changed: replaced by --overwrite, rows as made
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    assert teach([model, folder, copy, "--overwrite", "--num_workers", "0"]) == 0
    assert open(copy, "rb").read() == open(made, "rb").read()


def _check(teacher_file, data, *keys):
    """What train.py does at start with a teacher file: Distillation.check_data on the run's data."""
    cfg = get_config(
        "configs/demo.py", ["--rec", data, "--num_classes", "0", "--teacher", teacher_file, *keys]
    )
    Distillation(TeacherFile(teacher_file), None).check_data(cfg, build_train_dataset(cfg, train=False))


def test_teacher_file_of_one_folder_is_refused_for_another_with_the_same_names(made, folder, tmp_path):
    same = shutil.copytree(folder, str(tmp_path / "moved"))
    _check(made, same)  # a moved copy is the same data
    others = photos(tmp_path / "others", ids=2, per_id=3, first_seed=1000)  # id0/0.jpg ... other people
    assert sorted(os.listdir(os.path.join(others, "id1"))) == sorted(os.listdir(os.path.join(folder, "id1")))
    with pytest.raises(
        ConfigError, match=f"^teacher file {made} belongs to other data: it was made from {folder}"
    ):
        _check(made, others)


def test_teacher_file_is_refused_for_a_run_reading_the_data_otherwise(made, folder, tmp_path):
    with pytest.raises(
        ConfigError,
        match=f"^teacher file {made} was made from {folder} read with align false, "
        f"resize false; this run reads {folder} with align false, resize true",
    ):
        _check(made, folder, "--resize", "true")
    resized = str(tmp_path / "resized.teacher")
    assert teach([tiny_model(tmp_path / "m"), folder, resized, "--resize", "--num_workers", "0"]) == 0
    _check(resized, folder, "--resize", "true")


def _write_teacher_file(path, header, rows: np.ndarray) -> str:
    with open(path, "wb") as f:
        f.write(header_bytes(header) + rows.astype("<f2").tobytes())
    return str(path)


def _opened(capsys, path) -> str:
    """Opening the file as train.py does: its one error line."""
    assert exits_on_user_error(lambda: TeacherFile(path))() == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_teacher_file_of_the_old_format_is_refused_in_one_line_saying_to_remake_it(tmp_path, capsys):
    old = {"format": 1, "data": "/data/x", "data_fingerprint": "abc", "data_size": 4, "dim": 3}
    path = _write_teacher_file(tmp_path / "old.teacher", old, np.ones((4, 3)))
    err = _opened(capsys, path)
    assert (
        err.startswith(f"error: {path}: teacher file format 1")
        and "remake it with `python -m scripts.teach`" in err
    )


def test_teacher_file_cut_inside_its_header_is_one_line_naming_it(made, tmp_path, capsys):
    whole = open(made, "rb").read()
    for cut in (len(MAGIC) + 2, len(MAGIC) + 4, len(MAGIC) + 40):
        path = tmp_path / f"cut{cut}.teacher"
        path.write_bytes(whole[:cut])
        err = _opened(capsys, str(path))
        assert err.startswith(f"error: {path}: teacher file cut inside its header"), err


def test_teacher_file_with_non_finite_rows_is_refused_at_open_naming_them(made, tmp_path, capsys):
    file = TeacherFile(made)
    rows = np.array(file.rows, dtype=np.float32)
    rows[2, 1], rows[4, 0] = np.nan, np.inf
    path = _write_teacher_file(tmp_path / "nan.teacher", file.header, rows)
    err = _opened(capsys, path)
    assert err.startswith(f"error: {path}: 2 of 6 teacher rows are not finite (NaN or inf): rows 2, 4;"), err


class _ScaledTeacher(torch.nn.Module):
    """N x 3 embeddings times `factor`: NaN or zero (the start probe checks only shapes)."""

    def __init__(self, factor: float):
        super().__init__()
        self.w, self.factor = torch.nn.Parameter(torch.ones(1)), factor

    def forward(self, x):
        return x.mean(dim=(2, 3)) * self.w * self.factor


@pytest.mark.parametrize("factor,said", [(float("nan"), "is not finite"), (0.0, ".* has norm 0")])
def test_teach_refuses_a_teacher_whose_embedding_of_a_record_is_not_finite_or_zero(
    folder, tmp_path, factor, said
):
    from shardface.distill.teacher import OnlineTeacher
    from shardface.faces.align import ARCFACE_112
    from shardface.infer.model import Model
    from shardface.scripts.teach import write_teacher_file

    cfg = get_config("configs/demo.py", ["--rec", folder, "--num_classes", "0", "--teacher", "odd"])
    data = build_train_dataset(cfg, train=False)
    teacher = OnlineTeacher(Model(_ScaledTeacher(factor), ARCFACE_112, "odd", "x"), torch.device("cpu"))
    out = str(tmp_path / "odd.teacher")
    with pytest.raises(ModelError, match=f"^teacher odd: its embedding of record 0 of {folder} {said}"):
        write_teacher_file(teacher, data, {"data": folder}, out, batch_size=4, num_workers=0)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "scale,why",
    [
        (0.0, "all zero: one constant target"),
        (1e-4, "norm 1e-4: centring is a no-op"),
        (1.5, "norm 1.5: not scripts.teach's"),
    ],
)
def test_teacher_file_with_rows_that_are_not_unit_is_refused_at_open_naming_the_first(
    made, tmp_path, capsys, scale, why
):
    file = TeacherFile(made)
    rows = np.array(file.rows, dtype=np.float32)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-3)  # what teach writes
    rows[3:] *= scale
    path = _write_teacher_file(tmp_path / "scaled.teacher", file.header, rows)
    err = _opened(capsys, path)
    assert err.startswith(f"error: {path}: 3 of 6 teacher rows are not unit vectors"), err
    assert "rows 3, 4, 5, the first of norm" in err and "run scripts.teach again" in err
    rows[:] = 0.0  # every row zero: the file of a collapsed teacher
    path = _write_teacher_file(tmp_path / "zero.teacher", file.header, rows)
    err = _opened(capsys, path)
    assert "6 of 6 teacher rows are not unit vectors" in err and "the first of norm 0" in err, err
