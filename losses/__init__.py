from shardface.losses.adaface import AdaFace
from shardface.losses.base import MarginLoss
from shardface.losses.build import MARGINS, build_margin
from shardface.losses.curricularface import CurricularFace
from shardface.losses.magface import MagFace
from shardface.losses.margin import AMSoftmax, ArcFace, CombinedMarginLoss, CosFace
from shardface.losses.subcenter import SubCenterArcFace

__all__ = [
    "MarginLoss",
    "CombinedMarginLoss",
    "ArcFace",
    "CosFace",
    "AMSoftmax",
    "AdaFace",
    "MagFace",
    "CurricularFace",
    "SubCenterArcFace",
    "build_margin",
    "MARGINS",
]
