"""Where an on-the-fly teacher runs and in what type (issue #39): an ONNX teacher serves a CPU
run and is refused, in one line pointing to scripts.teach, on a GPU rank (onnxruntime would run
it on the host); under fp16/bf16 a frozen teacher's weights are cast once, not at every call."""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardface.backbones import get_model
from shardface.distill.teacher import OnlineTeacher, load_teacher
from shardface.errors import ConfigError
from shardface.faces.align import ARCFACE_112
from shardface.infer.model import Model, load_model
from shardface.scripts.export_onnx import main as export_onnx


@pytest.fixture(scope="module")
def teacher_onnx(teacher_pt, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("onnx") / "teacher.onnx")
    assert export_onnx([teacher_pt, path, "--network", "tiny"]) == 0
    return path


def test_onnx_teacher_is_refused_on_a_gpu_rank_in_one_line_naming_scripts_teach(teacher_onnx):
    with pytest.raises(ConfigError) as refused:
        load_teacher(teacher_onnx, None, torch.device("cuda", 1))
    message = str(refused.value)
    assert "\n" not in message and teacher_onnx in message and "python -m scripts.teach" in message
    assert "cuda:1" in message


def test_onnx_teacher_serves_a_cpu_run_with_the_targets_of_its_model_pt(teacher_onnx, teacher_pt):
    images = torch.rand(3, 3, 112, 112) * 2 - 1
    got = load_teacher(teacher_onnx, None, torch.device("cpu")).targets(images, None)
    want = load_teacher(teacher_pt, "tiny", torch.device("cpu")).targets(images, None)
    assert got.device == images.device and got.shape == (3, 64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_onnx_teacher_runs_on_the_threads_torch_was_given(teacher_onnx):
    """W ranks on one node: each rank's onnxruntime pool is its share, not one thread per core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        teacher = load_teacher(teacher_onnx, None, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert teacher.model.module.session.get_session_options().intra_op_num_threads == 1


class _WeightCasts(TorchDispatchMode):
    """Counts the casts whose input is one of `params` (what autocast does to fp32 weights)."""

    def __init__(self, params):
        super().__init__()
        self.ptrs, self.count = {p.data_ptr() for p in params}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func._schema.name == "aten::_to_copy"
            and torch.is_tensor(args[0])
            and args[0].data_ptr() in self.ptrs
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Fp32Fc(nn.Module):
    """A trunk under autocast and an fc the network keeps in fp32, as some backbones do."""

    def __init__(self):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, stride=4), nn.Linear(8, 16)

    def forward(self, x):
        x = self.conv(x).mean(dim=(2, 3))
        with torch.autocast("cpu", enabled=False):
            return self.fc(x.float())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("network", ["tiny", "fp32_fc"])
def test_frozen_teacher_casts_its_weights_once_and_keeps_autocasts_targets(precision, network):
    def build():
        torch.manual_seed(0)
        return get_model("tiny", num_features=32).eval() if network == "tiny" else _Fp32Fc().eval()

    reference = build()  # fp32 weights, cast by autocast at each call
    teacher = OnlineTeacher(Model(build(), ARCFACE_112, network, "x"), torch.device("cpu"), precision)
    module = teacher.model.module
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    convs = [m for m in module.modules() if isinstance(m, nn.Conv2d)]
    assert teacher.cast_once >= len(convs) > 0 and all(m.weight.dtype == low for m in convs)
    if network == "fp32_fc":
        assert module.fc.weight.dtype == torch.float32  # outside autocast: left as it runs
    images = torch.rand(4, 3, 112, 112) * 2 - 1
    with _WeightCasts(list(module.parameters())) as casts:
        got = teacher.targets(images, None)
    with torch.no_grad(), torch.autocast("cpu", dtype=low):
        want = reference(images).float()
    assert casts.count == 0  # no weight re-cast per call
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_teacher_in_fp32_is_left_as_it_is(teacher_pt):
    teacher = load_teacher(teacher_pt, "tiny", torch.device("cpu"))
    assert teacher.cast_once == 0 and all(p.dtype == torch.float32 for p in teacher.model.module.parameters())


def test_teacher_is_loaded_on_the_device_it_is_given(teacher_pt):
    embedder = load_model(teacher_pt, "tiny", device=torch.device("cpu"))
    assert embedder.device == torch.device("cpu")
