import functools
import gzip
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from shardface import backbones
from shardface.backbones import iresnet
from shardface.backbones.common import run_segments

# Parameter and buffer names and shapes, in state-dict order, of every network name of
# insightface arcface_torch's backbones.get_model (num_features 512), dumped once from its
# backbones/ package on the meta device: the contract that lets its published model.pt files
# load into ours, and its optimizer states (ordered like parameters()) map onto ours.
ARCFACE_TORCH_STATE_DICTS = os.path.join(
    os.path.dirname(__file__), "fixtures", "arcface_torch_state_dicts.json.gz"
)
with gzip.open(ARCFACE_TORCH_STATE_DICTS, "rt") as _f:
    ARCFACE_TORCH = {
        name: [(k, tuple(shape)) for k, shape in entries] for name, entries in json.load(_f).items()
    }

ARCFACE_TORCH_NAMES = [
    "r18",
    "r34",
    "r50",
    "r100",
    "r200",
    "r2060",
    "mbf",
    "mbf_large",
    "vit_t",
    "vit_t_dp005_mask0",
    "vit_s",
    "vit_s_dp005_mask_0",
    "vit_b",
    "vit_b_dp005_mask_005",
    "vit_l_dp005_mask_005",
    "vit_h",
]
ARCFACE_TORCH_PARAM_COUNTS = {
    "r18": 24_025_600,
    "r34": 34_139_328,
    "r50": 43_590_848,
    "r100": 65_156_160,
    "r200": 118_833_920,
    "r2060": 1_122_301_120,
    "mbf": 2_059_520,
    "mbf_large": 6_314_880,
    "vit_t": 19_137_792,
    "vit_t_dp005_mask0": 19_137_792,
    "vit_s": 76_023_296,
    "vit_s_dp005_mask_0": 76_023_296,
    "vit_b": 113_833_472,
    "vit_b_dp005_mask_005": 113_833_472,
    "vit_l_dp005_mask_005": 255_684_352,
    "vit_h": 756_393_984,
}
# too large to allocate in the default suite, or a variant of a smaller name's class: checked on
# the meta device (tests/test_vit.py checks the ViT's function at small sizes)
LARGE = {
    "r2060",
    "vit_h",
    "vit_l_dp005_mask_005",
    "vit_b",
    "vit_b_dp005_mask_005",
    "vit_s",
    "vit_s_dp005_mask_0",
    "vit_t_dp005_mask0",
}


@functools.lru_cache(maxsize=None)
def _meta_model(name: str, num_features: int = 512) -> torch.nn.Module:
    """Built once per name, on the meta device (r2060 takes seconds to build); read-only use."""
    with torch.device("meta"):
        return backbones.get_model(name, num_features=num_features)


def test_every_arcface_torch_network_name_is_registered_and_in_the_fixture():
    assert sorted(ARCFACE_TORCH) == sorted(ARCFACE_TORCH_NAMES)
    assert set(backbones.list_models()) == set(ARCFACE_TORCH_NAMES) | {"tiny", "dlib_resnet"}


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH_PARAM_COUNTS))
def test_parameter_count_matches_arcface_torch(name):
    model = _meta_model(name)
    assert sum(p.numel() for p in model.parameters()) == ARCFACE_TORCH_PARAM_COUNTS[name]


@pytest.mark.parametrize("name", sorted(set(backbones.list_models()) - LARGE))
def test_forward_gives_num_features_embedding(name):
    torch.manual_seed(0)
    # train-mode BatchNorm: untrained deep IResNets overflow fp32 with running statistics
    model = backbones.get_model(name, num_features=128).train()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 112, 112))
    assert out.shape == (2, 128) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_unknown_network_lists_known_names():
    with pytest.raises(ValueError, match="r50.*") as err:
        backbones.get_model("resnet9000")
    assert "mbf" in str(err.value) and "tiny" in str(err.value)


def test_bf16_trunk_keeps_fp32_output_and_gradients():
    torch.manual_seed(0)
    model = backbones.get_model("tiny", bf16=True)
    x = torch.randn(4, 3, 112, 112)
    out = model(x)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad
    )


def test_gradient_checkpointing_gives_identical_gradients():
    torch.manual_seed(0)
    plain = backbones.get_model("r18", num_features=64).double()
    ckpt = backbones.get_model("r18", num_features=64, grad_checkpoint=True).double()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 112, 112, dtype=torch.float64)
    plain(x).square().sum().backward()
    ckpt(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("name", ["tiny"] + [pytest.param(n, marks=pytest.mark.slow) for n in ("mbf", "r18")])
def test_channels_last_batch_gives_the_same_embedding_and_gradients(name):
    """config.channels_last: the batch in NHWC memory, the parameters as they are (their
    gradients stay contiguous, as ZeRO's flat shards need); in float64, the sums' order aside."""
    torch.manual_seed(0)
    model = backbones.get_model(name, num_features=64).double().train()
    x = torch.randn(3, 3, 112, 112, dtype=torch.float64)
    grads = []
    for batch in (x, x.contiguous(memory_format=torch.channels_last)):
        model.zero_grad()
        out = model(batch)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    for (pname, param), a, b in zip(model.named_parameters(), grads[0][1], grads[1][1]):
        if a is None:  # a parameter the forward does not use (r18's)
            assert b is None, pname
            continue
        assert b.is_contiguous(), pname
        torch.testing.assert_close(b, a, msg=pname)


@pytest.mark.slow
def test_channels_last_benchmark_runs():
    """benchmarks/channels_last.py at its smoke size (so that the script cannot rot)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "benchmarks/channels_last.py", "--smoke", "--networks", "tiny"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"^ *tiny( +[0-9.]+){6}$", done.stdout, re.M), done.stdout


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "r2060" else n for n in sorted(LARGE)]
)
def test_large_network_forward_gives_num_features_embedding_on_meta(name):
    with torch.device("meta"):
        model = backbones.get_model(name, num_features=128)
    for mode in (True, False):
        assert model.train(mode)(torch.empty(2, 3, 112, 112, device="meta")).shape == (2, 128)


@pytest.mark.parametrize("name", ARCFACE_TORCH_NAMES)
def test_state_dict_names_shapes_and_order_equal_arcface_torch(name):
    ours = [(k, tuple(v.shape)) for k, v in _meta_model(name).state_dict().items()]
    assert ours == ARCFACE_TORCH[name]


def test_arcface_torch_state_dict_loads_strictly(name="vit_t"):
    """A state dict made from the fixture alone (as a published model.pt) loads with strict=True."""
    published = {
        k: torch.full(shape, 3, dtype=torch.long if k.endswith("num_batches_tracked") else torch.float32)
        for k, shape in ARCFACE_TORCH[name]
    }
    with torch.device("meta"):
        model = backbones.get_model(name)
    model.load_state_dict(published, strict=True, assign=True)
    assert all(v.device.type == "cpu" and (v == 3).all() for v in model.state_dict().values())
    with pytest.raises(RuntimeError, match="mask_token"):
        model.load_state_dict(
            {k: v for k, v in published.items() if k != "mask_token"}, strict=True, assign=True
        )


def test_segments_checkpoint_with_identical_gradients_and_fewer_saved_tensors():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.PReLU(16))
            for _ in range(8)
        ]
    ).double()
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    results = []
    for segments in (0, 4):
        layers.zero_grad()
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run_segments(layers, x, segments) if segments else layers(x)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in layers.parameters()], count[0]))
    torch.testing.assert_close(results[1][0], results[0][0])
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b)
    assert results[1][2] < results[0][2] / 2


def test_r2060_trains_its_deep_stages_in_arcface_torch_segments(monkeypatch):
    """r2060 checkpoints stages 2 and 3 in 20 and 100 segments in training, whatever
    grad_checkpoint says, and runs them plainly in eval (shown at reduced depth on the meta device)."""
    assert _meta_model("r2060").segments == (0, 20, 100, 0)
    calls = []
    monkeypatch.setattr(
        iresnet, "run_segments", lambda layers, x, n: calls.append((len(layers), n)) or layers(x)
    )
    with torch.device("meta"):
        model = iresnet.IResNet((1, 4, 6, 1), num_features=8, segments=(0, 2, 3, 0))
    x = torch.empty(2, 3, 112, 112, device="meta")
    model.eval()(x)
    assert calls == []
    model.train()(x)
    assert calls == [(4, 2), (6, 3)]


def test_dropout_is_applied_or_refused():
    x = torch.randn(4, 3, 112, 112)
    for name in ("tiny", "r18", "vit_t"):
        torch.manual_seed(0)
        model = backbones.get_model(name, num_features=32, dropout=0.5).train()
        with torch.no_grad():
            a, b = model(x), model(x)  # two dropout masks
        assert not torch.allclose(a, b), name
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), model(x), msg=name)
    with pytest.raises(ValueError, match="dropout 0.5: MobileFaceNet has no dropout"):
        backbones.get_model("mbf", dropout=0.5)


def test_mistyped_network_is_one_line_listing_the_known_names_in_every_tool(tmp_path, capsys):
    """`--network resnet18` is a config error the tools print as `error: ...`, not a traceback."""
    from shardface.errors import ConfigError
    from shardface.scripts.export_onnx import main as export_onnx

    with pytest.raises(ConfigError, match=r"unknown network 'resnet18'; known networks: .*r18"):
        backbones.get_model("resnet18")
    torch.save(backbones.get_model("tiny").state_dict(), tmp_path / "model.pt")
    capsys.readouterr()
    assert export_onnx([str(tmp_path / "model.pt"), str(tmp_path / "m.onnx"), "--network", "resnet18"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("error: ")
        and "unknown network 'resnet18'" in err
        and "r50" in err
    )
