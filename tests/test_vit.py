"""The ViTs compute arcface_torch's function: an eval forward recomputed here from the state
dict alone, and the training-only token masking and stochastic depth measured.

The format, written down from arcface_torch's backbones/vit.py and get_model (not its code):
112x112 images cut in non-overlapping 9x9 patches (12x12 = 144 tokens), each projected by a
Conv2d with bias, plus `pos_embed`; per block x += attn(LN1(x)), x += mlp(LN2(x)), where attn is
softmax(q k^T / sqrt(d_head)) v over 8 heads, qkv a bias-free Linear whose 3*D outputs are
(q, k, v) each split head-major, then `proj` with bias; mlp is fc1, ReLU6, fc2; a final
LayerNorm; the 144*D tokens flattened, then Linear (no bias), BatchNorm1d eps 2e-5, Linear (no
bias), BatchNorm1d eps 2e-5. In training only: tokens masked at random (kept: int(L*(1-ratio)))
and refilled after the final norm with `mask_token`; stochastic depth rates rising linearly
from 0 at block 0 to drop_path_rate at the last block.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from shardface import backbones
from shardface.backbones.vit import VisionTransformer, drop_path

# name: (embed_dim, depth, drop_path_rate, mask ratio it trains with, checkpointed in training)
# arcface_torch's vit_b_dp005_mask_005 and vit_l_dp005_mask_005 pass mask_ratio 0.05, but its
# forward then masks with its default ratio 0.1: 0.1 is what those networks train with.
ARCFACE_TORCH_VITS = {
    "vit_t": (256, 12, 0.1, 0.1, False),
    "vit_t_dp005_mask0": (256, 12, 0.05, 0.0, False),
    "vit_s": (512, 12, 0.1, 0.1, False),
    "vit_s_dp005_mask_0": (512, 12, 0.05, 0.0, False),
    "vit_b": (512, 24, 0.1, 0.1, True),
    "vit_b_dp005_mask_005": (512, 24, 0.05, 0.1, True),
    "vit_l_dp005_mask_005": (768, 24, 0.05, 0.1, True),
    "vit_h": (1024, 48, 0.1, 0.0, True),
}
TOKENS = 144


def _small_vit(**kw) -> VisionTransformer:
    spec = dict(embed_dim=32, depth=2, num_heads=8, num_features=16)
    spec.update(kw)
    return VisionTransformer(**spec)


def _randomise_norms(model: torch.nn.Module) -> None:
    """Non-trivial affine and running statistics, so every norm's role shows in the output."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("running_mean") or name.endswith(".bias"):
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.2)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g, dtype=t.dtype) + 0.5)
            elif (
                name.startswith("norm")
                or ".norm" in name
                or name.startswith("feature.1")
                or name.startswith("feature.3")
            ) and name.endswith(".weight"):
                t.copy_(1 + torch.randn(t.shape, generator=g, dtype=t.dtype) * 0.2)


def _layer_norm(x, sd, prefix, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]


def _batch_norm_eval(x, sd, prefix, eps=2e-5):
    return (x - sd[prefix + ".running_mean"]) / torch.sqrt(sd[prefix + ".running_var"] + eps) * sd[
        prefix + ".weight"
    ] + sd[prefix + ".bias"]


def reference_forward(
    sd: dict, images: torch.Tensor, heads: int = 8, seen: dict | None = None
) -> torch.Tensor:
    """The eval-mode ViT, step by step from the state dict (the format in the module docstring)."""
    n = images.shape[0]
    dim, _, p, _ = sd["patch_embed.proj.weight"].shape
    grid = images.shape[-1] // p
    # patches as (channel, row, column) vectors, row-major over the grid
    patches = images.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(n, grid * grid, -1)
    x = (
        patches @ sd["patch_embed.proj.weight"].reshape(dim, -1).T
        + sd["patch_embed.proj.bias"]
        + sd["pos_embed"]
    )
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    d_head = dim // heads
    for i in range(depth):
        b = f"blocks.{i}."
        h = _layer_norm(x, sd, b + "norm1")
        qkv = h @ sd[b + "attn.qkv.weight"].T
        q, k, v = (
            qkv[..., j * dim : (j + 1) * dim].reshape(n, -1, heads, d_head).transpose(1, 2) for j in range(3)
        )
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d_head), dim=-1)
        attended = (weights @ v).transpose(1, 2).reshape(n, -1, dim)
        x = x + attended @ sd[b + "attn.proj.weight"].T + sd[b + "attn.proj.bias"]
        hidden = _layer_norm(x, sd, b + "norm2") @ sd[b + "mlp.fc1.weight"].T + sd[b + "mlp.fc1.bias"]
        if seen is not None:
            seen["below 0"] = seen.get("below 0", False) or bool((hidden < 0).any())
            seen["above 6"] = seen.get("above 6", False) or bool((hidden > 6).any())
        x = x + hidden.clamp(0, 6) @ sd[b + "mlp.fc2.weight"].T + sd[b + "mlp.fc2.bias"]
    x = _layer_norm(x, sd, "norm").reshape(n, -1)
    x = _batch_norm_eval(x @ sd["feature.0.weight"].T, sd, "feature.1")
    return _batch_norm_eval(x @ sd["feature.2.weight"].T, sd, "feature.3")


def test_eval_forward_equals_the_reference_recomputed_from_the_state_dict():
    torch.manual_seed(0)
    model = _small_vit(drop_path_rate=0.3, mask_ratio=0.3).double().eval()
    _randomise_norms(model)
    with torch.no_grad():  # MLP pre-activations on both sides of ReLU6's clip: GELU or ReLU would fail
        for block in model.blocks:
            block.mlp.fc1.weight.mul_(40)
    images = torch.randn(3, 3, 112, 112, dtype=torch.float64)
    seen = {}
    expected = reference_forward(model.state_dict(), images, seen=seen)
    assert seen == {"below 0": True, "above 6": True}
    with torch.no_grad():
        torch.testing.assert_close(model(images), expected, rtol=1e-9, atol=1e-9)


def test_eval_output_is_deterministic_and_per_sample():
    """Eval mode: no masking, no drop path, BatchNorm from running statistics: each image's
    embedding is the same on every call and whatever else is in the batch."""
    torch.manual_seed(0)
    model = _small_vit(drop_path_rate=0.5, mask_ratio=0.5).eval()
    images = torch.randn(4, 3, 112, 112)
    with torch.no_grad():
        out = model(images)
        torch.testing.assert_close(model(images), out, rtol=0, atol=0)
        torch.testing.assert_close(model(images[2:3]), out[2:3])


def test_eval_ignores_masking_and_drop_path():
    torch.manual_seed(0)
    regularised = _small_vit(drop_path_rate=0.5, mask_ratio=0.5)
    plain = _small_vit()
    plain.load_state_dict(regularised.state_dict())
    images = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        torch.testing.assert_close(regularised.eval()(images), plain.eval()(images))
        assert not torch.allclose(regularised.train()(images), plain.train()(images))


def _tokens_before_feature_head(model, images):
    """Blocks' input token count and the N x L x D tokens entering the feature head."""
    seen = {}

    def record(key, value):
        seen[key] = value  # returns None: the hook leaves the input as it is

    h1 = model.blocks[0].register_forward_pre_hook(lambda m, args: record("kept", args[0].shape[1]))
    h2 = model.feature.register_forward_pre_hook(lambda m, args: record("tokens", args[0]))
    try:
        model(images)
    finally:
        h1.remove()
        h2.remove()
    return seen["kept"], seen["tokens"].reshape(images.shape[0], TOKENS, -1)


@pytest.mark.parametrize("ratio", [0.1, 0.25])
def test_training_masks_int_l_times_ratio_tokens_per_sample_with_the_mask_token(ratio):
    torch.manual_seed(0)
    model = _small_vit(mask_ratio=ratio).train()
    images = torch.randn(64, 3, 112, 112)
    kept, tokens = _tokens_before_feature_head(model, images)
    masked = tokens.eq(model.mask_token.detach().reshape(1, 1, -1)).all(-1)  # N x L
    assert kept == int(TOKENS * (1 - ratio))  # 129 of 144 at 0.1, 108 at 0.25
    assert masked.sum(1).tolist() == [TOKENS - kept] * 64
    # positions drawn afresh per sample, uniformly: each position masked about `ratio` of the time
    assert len({tuple(row.nonzero().flatten().tolist()) for row in masked}) == 64
    freq = masked.double().mean(0)
    assert abs(freq.mean().item() - (TOKENS - kept) / TOKENS) < 1e-12
    assert ((freq - ratio).abs() < 5 * math.sqrt(ratio * (1 - ratio) / 64)).all()
    # the mask token is learned: it receives a gradient through the feature head
    model(images).square().sum().backward()
    assert model.mask_token.grad is not None and model.mask_token.grad.abs().sum() > 0


def test_without_masking_every_token_passes_and_the_mask_token_is_frozen():
    torch.manual_seed(0)
    model = _small_vit(mask_ratio=0.0).train()
    kept, tokens = _tokens_before_feature_head(model, torch.randn(8, 3, 112, 112))
    assert kept == TOKENS
    assert not tokens.eq(model.mask_token.detach().reshape(1, 1, -1)).all(-1).any()
    assert not model.mask_token.requires_grad  # unused: ZeRO-2 and DDP must not wait for its gradient


def test_drop_path_drops_whole_samples_at_its_rate_and_keeps_the_mean():
    torch.manual_seed(0)
    p, n = 0.3, 20000
    x = torch.ones(n, 5, 4)
    out = drop_path(x, p, training=True)
    per_sample = out.reshape(n, -1)
    assert (per_sample == per_sample[:, :1]).all()  # one decision per sample
    kept = per_sample[per_sample[:, 0] != 0, 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))  # kept branches rescaled
    dropped = (per_sample[:, 0] == 0).double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert abs(out.mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)
    assert drop_path(x, p, training=False) is x
    assert drop_path(x, 0.0, training=True) is x


@pytest.mark.parametrize("name", sorted(ARCFACE_TORCH_VITS))
def test_registered_vit_has_arcface_torch_sizes_rates_masking_and_checkpointing(name):
    embed_dim, depth, rate, mask_ratio, checkpointed = ARCFACE_TORCH_VITS[name]
    with torch.device("meta"):
        model = backbones.get_model(name)
    assert (model.embed_dim, len(model.blocks), model.mask_ratio) == (embed_dim, depth, mask_ratio)
    assert all(block.attn.num_heads == 8 for block in model.blocks)
    rates = [block.drop_path_rate for block in model.blocks]
    assert rates == pytest.approx([rate * i / (depth - 1) for i in range(depth)], abs=1e-7)
    assert model.grad_checkpoint == checkpointed
    assert model.feature[1].eps == model.feature[3].eps == 2e-5
    with torch.device("meta"):
        assert backbones.get_model(name, grad_checkpoint=True).grad_checkpoint  # the key adds it


def test_checkpointed_training_gives_identical_outputs_and_gradients_with_fewer_saved_tensors():
    """Recomputation replays the same masks and drop-path draws (the RNG state is restored)."""
    runs = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = _small_vit(drop_path_rate=0.5, mask_ratio=0.25, grad_checkpoint=ckpt).double().train()
        images = torch.randn(4, 3, 112, 112, dtype=torch.float64)
        count = [0]

        def pack(t, count=count):
            count[0] += t.numel()
            return t

        torch.manual_seed(1)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(images)
        out.square().sum().backward()
        runs[ckpt] = (
            out.detach(),
            {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
            count[0],
        )
    torch.testing.assert_close(runs[True][0], runs[False][0])
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], grad, msg=name)
    assert runs[True][2] < runs[False][2]


def test_wrong_image_size_is_refused_with_the_expected_size():
    with pytest.raises(ValueError, match=r"ViT input \(96, 96\): expected 112x112"):
        _small_vit()(torch.randn(2, 3, 96, 96))


def test_bf16_trunk_keeps_attention_scores_in_fp32_and_fp32_output(monkeypatch):
    torch.manual_seed(0)
    model = _small_vit(bf16=True).eval()
    dtypes = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        out = original(q, k, v, *a, **kw)
        dtypes.append((q.dtype, out.dtype))
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 112, 112))
    assert dtypes == [(torch.float32, torch.float32)] * 2 and out.dtype == torch.float32
    assert model.blocks[0].attn.qkv(torch.randn(1, 32)).dtype == torch.float32  # outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the linear layers themselves do run in bf16
        assert model.blocks[0].attn.qkv(torch.randn(1, 32)).dtype == torch.bfloat16
