"""The margin a config asks for (`margin` plus the papers' hyper-parameter names)."""

from __future__ import annotations

from shardface.losses.adaface import AdaFace
from shardface.losses.base import MarginLoss
from shardface.losses.curricularface import CurricularFace
from shardface.losses.magface import MagFace
from shardface.losses.margin import CombinedMarginLoss
from shardface.losses.subcenter import SubCenterArcFace

MARGINS = ("combined", "arcface", "cosface", "adaface", "magface", "curricularface", "subcenter_arcface")


def build_margin(cfg) -> MarginLoss:
    """`combined` (default) reads `margin_list` = (m1, m2, m3); the others their own keys."""
    name = cfg.margin
    if name == "combined":
        if len(cfg.margin_list) != 3:
            raise ValueError(f"margin_list must be (m1, m2, m3), got {cfg.margin_list!r}")
        m1, m2, m3 = cfg.margin_list
        return CombinedMarginLoss(
            cfg.scale, m1, m2, m3, cfg.interclass_filtering_threshold, straight_through=cfg.straight_through
        )
    if name == "arcface":
        return CombinedMarginLoss(
            cfg.scale,
            1.0,
            cfg.arcface_m,
            0.0,
            cfg.interclass_filtering_threshold,
            straight_through=cfg.straight_through,
        )
    if name == "cosface":
        return CombinedMarginLoss(cfg.scale, 1.0, 0.0, cfg.cosface_m, cfg.interclass_filtering_threshold)
    if name == "adaface":
        return AdaFace(cfg.scale, cfg.adaface_m, cfg.adaface_h, cfg.adaface_t_alpha)
    if name == "magface":
        return MagFace(
            cfg.scale,
            cfg.magface_l_a,
            cfg.magface_u_a,
            cfg.magface_l_m,
            cfg.magface_u_m,
            cfg.magface_lambda_g,
            cfg.magface_easy_margin,
        )
    if name == "curricularface":
        return CurricularFace(cfg.scale, cfg.curricularface_m)
    if name == "subcenter_arcface":
        return SubCenterArcFace(cfg.scale, cfg.arcface_m, cfg.subcenter_k)
    raise ValueError(f"unknown margin {name!r}; one of {', '.join(MARGINS)}")
