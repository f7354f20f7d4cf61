"""docs/arcface_torch.md's drop-in claims, held to arcface_torch's signatures written down here by hand: a
call that works positionally there means the same here, and what ShardFace adds is
keyword-only (so no positional call can land in an extra by mistake)."""

import inspect

import pytest

from shardface.backbones import get_model
from shardface.heads import PartialFC
from shardface.losses import ArcFace, CombinedMarginLoss, CosFace


def _positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name != "self"]


@pytest.mark.parametrize(
    "fn,theirs",
    [
        # partial_fc_v2.PartialFC_V2.__init__
        (PartialFC, ["margin_loss", "embedding_size", "num_classes", "sample_rate", "fp16"]),
        # losses.CombinedMarginLoss, losses.ArcFace, losses.CosFace
        (CombinedMarginLoss, ["s", "m1", "m2", "m3", "interclass_filtering_threshold"]),
        (ArcFace, ["s", "margin"]),
        (CosFace, ["s", "m"]),
        # backbones.get_model(name, **kwargs)
        (get_model, ["name"]),
    ],
    ids=["PartialFC", "CombinedMarginLoss", "ArcFace", "CosFace", "get_model"],
)
def test_positional_parameters_are_arcface_torchs(fn, theirs):
    assert _positional(fn) == theirs


def test_partial_fc_v2_positional_call_sets_sample_rate_and_fp16_not_a_tile_size():
    from shardface.configs.schema import keys

    head = PartialFC(CombinedMarginLoss(64.0, 1.0, 0.5, 0.0), 8, 10, 1.0, True)
    # 16-bit logits; the tile is the config's default, not the fifth argument
    assert head.chunk_size == keys()["chunk_size"].default and head.plan.precision == "bf16"
    assert (
        PartialFC(CosFace(), 8, 10, 0.5).plan.precision == "fp32"
        and PartialFC(CosFace(), 8, 10, 0.5).sample_rate == 0.5
    )
    with pytest.raises(ValueError, match="fp16=True"):
        PartialFC(CosFace(), 8, 10, 1.0, True, precision="fp32")
