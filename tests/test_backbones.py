import json
import os

import pytest
import torch

import backbones

# Parameter and buffer names and shapes of insightface arcface_torch's iresnet50, iresnet100
# and get_mbf (num_features 512), dumped from its backbones/ package: the contract that
# lets its published model.pt files load into ours.
ARCFACE_TORCH_STATE_DICTS = os.path.join(os.path.dirname(__file__), "fixtures", "arcface_torch_state_dicts.json")

ARCFACE_TORCH_PARAM_COUNTS = {
    "r18": 24_025_600, "r34": 34_139_328, "r50": 43_590_848,
    "r100": 65_156_160, "r200": 118_833_920, "mbf": 2_059_520,
}


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH_PARAM_COUNTS))
def test_parameter_count_matches_arcface_torch(name):
    model = backbones.get_model(name)
    assert sum(p.numel() for p in model.parameters()) == ARCFACE_TORCH_PARAM_COUNTS[name]


@pytest.mark.parametrize("name", backbones.list_models())
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
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for p in model.parameters() if p.requires_grad)


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


@pytest.mark.parametrize("name", ["r50", "r100", "mbf"])
def test_state_dict_names_and_shapes_equal_arcface_torch(name):
    with open(ARCFACE_TORCH_STATE_DICTS) as f:
        expected = [(k, tuple(shape)) for k, shape in json.load(f)[name]]
    ours = [(k, tuple(v.shape)) for k, v in backbones.get_model(name).state_dict().items()]
    assert sorted(ours) == sorted(expected)


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
