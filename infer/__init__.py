"""Using a trained face model: load any form of one, find faces, embed, compare, identify.

from infer import load_model, Gallery
model = load_model("dlib")             # or a run dir, checkpoint, model.pt, .onnx
model.faces("group.jpg")               # every face, largest first: .box, .points, .score, .embedding
model.embed(["a.jpg", pil, array])     # N x D, one row per photo's largest face
model.compare("a.jpg", "b.jpg")        # .score (cosine), .same (None: no threshold known)
Gallery(model, "people/").identify("query.jpg")   # [Match] per face: .name (None: nobody), .score, .box
model.draw("query.jpg", matches)       # a PIL picture of them
"""

from infer.enrolment import Gallery, Match
from infer.model import Comparison, Model, load_model

__all__ = ["load_model", "Model", "Gallery", "Match", "Comparison"]
