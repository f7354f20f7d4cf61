from losses.margin import AMSoftmax, ArcFace, CombinedMarginLoss, CosFace

__all__ = ["CombinedMarginLoss", "ArcFace", "CosFace", "AMSoftmax"]
