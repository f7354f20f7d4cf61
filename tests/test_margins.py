import math

import pytest
import torch

from shardface.losses import ArcFace, CombinedMarginLoss, CosFace


def test_cosface_and_arcface_formulas_on_target_only():
    cos = torch.tensor([[0.5, 0.2], [0.1, 0.9]])
    labels = torch.tensor([0, -1])
    out = CosFace(s=10.0, m=0.3)(cos, labels)
    torch.testing.assert_close(out, torch.tensor([[10 * (0.5 - 0.3), 2.0], [1.0, 9.0]]))
    out = ArcFace(s=10.0, margin=0.5)(cos, labels)
    assert out[0, 0].item() == pytest.approx(10 * math.cos(math.acos(0.5) + 0.5), rel=1e-5)
    assert out[1].tolist() == pytest.approx([1.0, 9.0])


def test_combined_margin_applies_m1_m2_m3_together():
    m = CombinedMarginLoss(s=8.0, m1=1.2, m2=0.2, m3=0.1)
    cos = torch.tensor([0.6])
    expected = 8.0 * (math.cos(1.2 * math.acos(0.6) + 0.2) - 0.1)
    assert m.target_logit(cos).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("m1,m2", [(1.0, 0.5), (1.0, 0.8), (1.35, 0.0), (1.2, 0.3)])
def test_target_logit_is_decreasing_in_theta_past_pi(m1, m2):
    """theta' = m1*theta + m2 > pi must not let the target logit rise again."""
    m = CombinedMarginLoss(s=1.0, m1=m1, m2=m2)
    cos = torch.linspace(0.999, -0.999, 2001, dtype=torch.float64)
    out = m.target_logit(cos)
    assert torch.isfinite(out).all()
    assert (out[1:] <= out[:-1] + 1e-9).all()


def test_margin_does_not_modify_input_and_filters_interclass():
    cos = torch.tensor([[0.9, 0.5, 0.1]])
    before = cos.clone()
    out = CombinedMarginLoss(s=2.0, m1=1.0, m2=0.0, m3=0.0, interclass_filtering_threshold=0.4)(
        cos, torch.tensor([0])
    )
    assert torch.equal(cos, before)
    torch.testing.assert_close(out, torch.tensor([[1.8, 0.0, 0.2]]))
