"""No tensor is made from host data in the dlib paths after the first call (issue #39): on a GPU
each would be a copy from pageable memory that waits for the device, and neither the sync
counter nor CUDA's sync debug mode sees it; a teacher file's rows come from the loader workers.
The whole step's count: tests/test_gpu_distill.py, whose cpu cases run in make test."""

import numpy as np
import pytest
import torch

from shardface.backbones import get_model
from shardface.dataset import ResumableDistributedSampler, build_dataset, get_dataloader
from shardface.distill.teacher_file import TeacherFile
from shardface.faces.dlib_chip import DLIB_150
from shardface.infer.model import Model
from shardface.scripts.teach import main as teach
from tests.host_sync import HostDataCounter

MADE_FROM_HOST_DATA = [
    ("tensor", lambda: torch.tensor([1.0, 2.0]), "torch.tensor"),
    ("as_tensor", lambda: torch.as_tensor(np.zeros((2, 3))), "torch.as_tensor"),
    ("asarray", lambda: torch.asarray([[1, 2]]), "torch.asarray"),
    ("from_numpy", lambda: torch.from_numpy(np.zeros(4, np.float32)), "torch.from_numpy"),
    ("frombuffer", lambda: torch.frombuffer(bytearray(8), dtype=torch.float32), "torch.frombuffer"),
    ("new_tensor", lambda: torch.zeros(2).new_tensor([3.0]), "Tensor.new_tensor"),
]


@pytest.mark.parametrize("name,make,expected", MADE_FROM_HOST_DATA, ids=[m[0] for m in MADE_FROM_HOST_DATA])
def test_counter_sees_each_tensor_made_from_host_data(name, make, expected):
    real = torch.from_numpy, torch.frombuffer
    with HostDataCounter() as c:
        make()
    assert c.calls == [expected]
    make()  # counted only inside; the wrapped functions are put back
    assert c.calls == [expected] and (torch.from_numpy, torch.frombuffer) == real


def test_counter_ignores_tensors_made_on_the_device_or_from_tensors():
    x = torch.arange(3.0)
    with HostDataCounter() as c:
        torch.zeros(2), torch.full((1,), 1.0), torch.as_tensor(x), x * 2, x.to(torch.float64)
    assert c.calls == []


def test_dlib_resnet_student_makes_no_tensor_from_host_data_after_its_first_forward():
    net = get_model("dlib_resnet", num_features=16).eval()
    x = torch.rand(1, 3, 112, 112) * 2 - 1
    with torch.no_grad():
        first = net(x)
        with HostDataCounter() as c:
            again = net(x)
    assert c.calls == []
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_teacher_reframing_makes_no_tensor_from_host_data_after_the_first_batch():
    class Means(torch.nn.Module):  # any network taking the 150x150 chip
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x.mean(dim=(2, 3)) * self.w

    embedder = Model(Means(), DLIB_150, "means", "x")
    x = torch.rand(3, 3, 112, 112) * 2 - 1
    first = embedder.reframe(x)
    with HostDataCounter() as c:
        again = embedder.reframe(x)
    assert c.calls == [] and again.shape == (3, 3, 150, 150)
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.fixture(scope="module")
def teacher_file(drawn_faces, teacher_pt, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("teacher_file") / "tiny.teacher")
    assert teach([teacher_pt, drawn_faces, path, "--network", "tiny", "--num_workers", "0"]) == 0
    return path


def test_teacher_file_rows_arrive_with_the_batch_from_the_loader_workers(drawn_faces, teacher_file):
    """Read in two worker processes, shuffled, on rank 1 of 2, mid-epoch: each image's row is
    its record's."""
    rows = TeacherFile(teacher_file)
    dataset = build_dataset(drawn_faces, 16, train=True, normalize=False)
    sampler = ResumableDistributedSampler(len(dataset), 2, 1, 8, seed=3)
    sampler.set_epoch(1, 2)
    dataset.set_epoch(1, 3)
    loader = get_dataloader(
        dataset, sampler, 2, with_index=True, teacher_rows=rows.row, persistent_workers=False
    )
    images, labels, indices, got = next(iter(loader))
    assert indices.tolist() == sampler.epoch_indices()[16:24].tolist()
    assert got.dtype == torch.float32 and got.shape == (8, rows.dim)
    torch.testing.assert_close(
        got, torch.from_numpy(np.asarray(rows.rows[indices.numpy()], np.float32)), rtol=0, atol=0
    )
