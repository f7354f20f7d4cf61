"""Using a trained face model: load any form of one, find faces, embed, compare, identify.

    from infer import load_model, Gallery
    model = load_model("dlib")             # or a run dir, checkpoint, model.pt, .onnx
    model.faces("group.jpg")               # largest first: .box, .points, .score
    model.embed(["a.jpg", pil, array])     # N x D, one row per photo's largest face
    model.compare("a.jpg", "b.jpg")        # cosine of the two photos' largest faces
    Gallery(model, "people/").identify("query.jpg")   # [(name or "unknown", score)] per face
"""
from infer.gallery import Gallery
from infer.model import Model, load_model

__all__ = ["load_model", "Model", "Gallery"]
