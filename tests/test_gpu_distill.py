"""The GPU kit, round 2 (issue #39): distillation, label-free training and the dlib network on
the device. Each test is parametrized as in tests/test_gpu.py: the cuda case is marked `gpu`
(`make test-gpu`), the cheap cpu case of the same body runs in `make test`, so the kit cannot
rot unrun; a cpu case proves the harness, not the GPU.

- train.py with a teacher run on the fly (dlib, a model.pt, an ONNX model: refused on a GPU in
  one line), from a teacher file (rows read by the loader workers), and label-free;
- dlib_resnet as a student in fp16 and bf16 (cuDNN autotuned) against fp32 on the CPU;
- gallery enrolment with the model on the device against the CPU's;
- a whole distillation step under `torch.cuda.set_sync_debug_mode("error")`, making no tensor
  from host data (tests/host_sync.HostDataCounter).
"""

import contextlib
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tests.devices import CUDA, device_of, env_for
from tests.distill_step import distill_step
from tests.host_sync import HostDataCounter, HostSyncCounter
from tests.train_runs import train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2


def _python(kind: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env_for(kind), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def teacher_onnx(teacher_pt, tmp_path_factory) -> str:
    from shardface.scripts.export_onnx import main as export_onnx

    path = str(tmp_path_factory.mktemp("onnx") / "teacher.onnx")
    assert export_onnx([teacher_pt, path, "--network", "tiny"]) == 0
    return path


# (teacher, extra keys, precision on cuda); the cpu cases run fp32 (16-bit CPU kernels are slow;
# the teacher's cast once is proven on the CPU by tests/test_teacher_device.py)
CASES = {
    "dlib": ("dlib", ("--distill_loss", "relational"), "fp16"),
    "model_pt": ("teacher_pt", ("--teacher_network", "tiny"), "bf16"),
    "onnx": ("teacher_onnx", (), "fp32"),
    "teacher_file": ("teacher_file", ("--num_workers", "2"), "bf16"),
    "label_free": ("teacher_pt", ("--teacher_network", "tiny", "--num_classes", "0"), "bf16"),
}


# every teacher form on the GPU; on the CPU (make test) the one with loader workers proves the
# harness: each form's CPU training is tested elsewhere (test_distill_training, test_label_free)
DEVICE_CASES = [pytest.param("cuda", case, marks=pytest.mark.gpu, id=f"cuda-{case}") for case in CASES] + [
    pytest.param("cpu", "teacher_file", id="cpu-teacher_file")
]


@pytest.mark.parametrize("kind,case", DEVICE_CASES)
def test_distillation_trains_on_the_device(kind, case, drawn_faces, teacher_pt, request, tmp_path):
    source, extra, cuda_precision = CASES[case]
    precision = cuda_precision if kind == "cuda" else "fp32"
    if source == "teacher_file":  # made on the device (scripts.teach runs the teacher there)
        teacher = str(tmp_path / "tiny.teacher")
        args = ["-m", "scripts.teach", teacher_pt, drawn_faces, teacher, "--network", "tiny"]
        if kind == "cuda":
            made = _python(kind, *args)
            assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
        else:  # in this process: no second interpreter start in make test
            from shardface.scripts.teach import main as teach

            assert teach(args[2:] + ["--num_workers", "0"]) == 0
    else:
        teacher = source if source == "dlib" else request.getfixturevalue(source)
    out = str(tmp_path / "run")
    argv = train_argv(
        drawn_faces,
        out,
        "--teacher",
        teacher,
        "--max_steps",
        str(STEPS),
        "--checkpoint_interval",
        str(STEPS),
        "--fp16",
        str(precision == "fp16").lower(),
        "--bf16",
        str(precision == "bf16").lower(),
        *extra,
    )
    done = _python(kind, "train.py", *argv)
    if case == "onnx" and kind == "cuda":  # onnxruntime would run it on the host: refused at start
        assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-3000:]
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "python -m scripts.teach" in lines[0], done.stderr[-3000:]
        assert not os.path.exists(os.path.join(out, "training.log"))
        return
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = open(os.path.join(out, "training.log")).read()
    assert f"(world size 1, {kind}" in log
    losses = re.findall(r"loss ([-+0-9.e]+|nan|inf) ", log)
    assert len(losses) == STEPS and all(v not in ("nan", "inf") for v in losses), log[-3000:]
    if case == "model_pt" and precision != "fp32":
        assert re.search(r"the weights of \d+ layers cast to bf16 once", log), log[-3000:]
    assert os.path.isfile(os.path.join(out, "model.pt"))


def _astronaut_crops(n: int) -> torch.Tensor:
    """n 112x112 crops of skimage's astronaut photo, [-1, 1]."""
    from skimage import data

    img = torch.from_numpy(data.astronaut()).permute(2, 0, 1).float()
    return (
        torch.stack([img[:, 20 + 20 * i : 132 + 20 * i, 150 + 10 * i : 262 + 10 * i] for i in range(n)])
        / 127.5
        - 1
    )


def _dlib_student(**kw):
    from shardface.backbones.dlib_resnet import DlibResNet
    from shardface.infer.weights import dlib_state

    net = DlibResNet(input_size=112, **kw)
    net.load_state_dict(dlib_state())
    return net


def _cosine(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=dim)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_dlib_resnet_student_in_16_bits_matches_fp32_on_the_cpu(kind, precision):
    device = device_of(kind)
    x = _astronaut_crops(16 if kind == "cuda" else 2)
    reference = _dlib_student()
    want = reference(x)
    want.square().mean().backward()
    student = _dlib_student(fp16=precision == "fp16", bf16=precision == "bf16").to(device)
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # as train.py sets it on a GPU: cuDNN's own kernel choice
    try:
        got = student(x.to(device))
        got.float().square().mean().backward()
    finally:
        torch.backends.cudnn.benchmark = benchmark
    assert got.dtype == torch.float32 and got.device.type == kind
    assert _cosine(got.detach().cpu(), want.detach()).min() >= 0.999
    grads = [
        torch.cat([p.grad.detach().cpu().flatten() for p in net.parameters()]) for net in (student, reference)
    ]
    assert _cosine(*grads, dim=0) >= 0.99


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_gallery_enrolment_with_the_model_on_the_device_matches_the_cpu(kind, teacher_pt, tmp_path):
    from shardface.infer.enrolment import enrol
    from shardface.infer.model import load_model

    crops = ((_astronaut_crops(6) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    gallery = tmp_path / "gallery"
    for i, crop in enumerate(crops):
        (gallery / f"person{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(crop.permute(1, 2, 0).numpy()).save(gallery / f"person{i % 3}" / f"{i}.png")
    on_device = load_model(teacher_pt, "tiny", device=device_of(kind))
    assert on_device.device.type == kind
    got = enrol(str(gallery), on_device, cache=str(tmp_path / "device.sqlite"), show_progress=False)
    want = enrol(
        str(gallery),
        load_model(teacher_pt, "tiny", device=torch.device("cpu")),
        cache=str(tmp_path / "cpu.sqlite"),
        show_progress=False,
    )
    assert got.names == want.names == ["person0", "person1", "person2"] and got.images == 6
    np.testing.assert_allclose(got.templates, want.templates, atol=5e-3)  # cuDNN may run convolutions in TF32


STEP_CASES = [
    ("teacher_file", ("--teacher_network", "tiny")),
    ("dlib", ("--distill_loss", "relational", "--num_classes", "0")),
]


@pytest.mark.parametrize(
    "teacher,extra", STEP_CASES, ids=["teacher_file_cosine", "dlib_relational_label_free"]
)
@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_distillation_step_never_synchronises_the_host_nor_copies_host_data(
    kind, teacher, extra, drawn_faces, teacher_pt, tmp_path
):
    """A whole step after the first (backbone, teacher, head, loss, backward, clip, optimizers,
    EMA): on a GPU under sync debug "error"; on the CPU under the sync counter. Neither makes a
    tensor from host data (a copy from pageable memory neither of them sees)."""
    if teacher == "teacher_file":
        from shardface.scripts.teach import main as teach

        teacher = str(tmp_path / "tiny.teacher")
        assert teach([teacher_pt, drawn_faces, teacher, "--network", "tiny", "--num_workers", "0"]) == 0
    device = device_of(kind)
    step, batches = distill_step(drawn_faces, teacher, device, *extra)
    step(next(batches))  # warm-up: optimizer state, allocator pools, cuDNN's choices, the cached warps
    batch = next(batches)
    if kind == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with (
            HostDataCounter() as made,
            HostSyncCounter() if kind == "cpu" else contextlib.nullcontext() as synced,
        ):
            loss = step(batch)
    finally:
        if kind == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert made.calls == []
    assert synced is None or synced.calls == []
    assert torch.isfinite(loss)
