from losses.adaface import AdaFace
from losses.base import MarginLoss
from losses.build import MARGINS, build_margin
from losses.curricularface import CurricularFace
from losses.magface import MagFace
from losses.margin import AMSoftmax, ArcFace, CombinedMarginLoss, CosFace
from losses.subcenter import SubCenterArcFace

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
