"""`python -m scripts.flops NETWORK`: parameters exact, GFLOPs (multiply-accumulates at 112x112)
where arcface_torch's README puts them: r18 2.6, r50 6.3, mobilefacenet 0.45 (ptflops also
counts norms and activations, which we leave out: a few percent on mbf), ViT-T 1.5 with
attention (its "Total-GFLOPs")."""

import functools

import pytest

from shardface.scripts import flops

complexity = functools.lru_cache(maxsize=None)(flops.complexity)

# name: (parameters at embedding 512, GFLOPs low, high)
EXPECTED = {
    "r18": (24_025_600, 2.55, 2.65),
    "r50": (43_590_848, 6.25, 6.35),
    "mbf": (2_059_520, 0.42, 0.46),
    "vit_t": (19_137_792, 1.45, 1.55),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameters_exact_and_gflops_in_arcface_torch_range(name):
    params, macs = complexity(name)
    count, low, high = EXPECTED[name]
    assert params == count
    assert low <= macs / 1e9 <= high


def _iresnet_macs(depths, num_features=512):
    """IResNet's multiply-accumulates by hand: stem 3x3 conv at 112; each stage halves the
    resolution in its first block's second 3x3 conv and 1x1 downsample; then the 7x7x512 FC."""
    macs, size, cin = 112 * 112 * 64 * 3 * 9, 112, 64
    for planes, blocks in zip((64, 128, 256, 512), depths):
        out = size // 2
        macs += size * size * planes * cin * 9 + out * out * planes * planes * 9 + out * out * planes * cin
        macs += (blocks - 1) * 2 * out * out * planes * planes * 9
        size, cin = out, planes
    return macs + 512 * 7 * 7 * num_features


def test_iresnet_macs_equal_the_count_by_hand():
    """Multiply-accumulates, not FLOPs (2 per MAC): exact for r18 and r50."""
    assert complexity("r18")[1] == _iresnet_macs((2, 2, 2, 2))
    assert complexity("r50")[1] == _iresnet_macs((3, 4, 14, 3))


def test_cli_prints_gflops_and_parameters(capsys):
    assert flops.main(["mbf", "--embedding-size", "128"]) == 0
    line = capsys.readouterr().out.strip()
    params, _ = flops.complexity("mbf", 128)
    assert line.startswith("mbf: 0.43") and "GFLOPs" in line and f"({params:,} parameters)" in line
    assert params == 2_059_520 - (512 + 2) * (512 - 128)  # the embedding Linear and its BatchNorm resized
