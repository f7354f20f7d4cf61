from losses.base import MarginLoss
from losses.margin import AMSoftmax, ArcFace, CombinedMarginLoss, CosFace

__all__ = ["MarginLoss", "CombinedMarginLoss", "ArcFace", "CosFace", "AMSoftmax"]
