"""ShardFace: class-sharded face recognition training for PyTorch, and its trained models on photos.

    from shardface import load_model, Gallery
    model = load_model("dlib")             # or a run dir, checkpoint, model.pt, .onnx
    model.faces("group.jpg")               # every face, largest first: .box, .points, .score, .embedding
    model.compare("a.jpg", "b.jpg")        # .score (cosine), .same (None: no threshold known)
    Gallery(model, "people/").identify("query.jpg")   # [Match] per face: .name (None: nobody), .score, .box

The checkout's root is this package: train.py, configs/, backbones/, heads/, losses/, parallel/,
dataset/, eval/, scripts/ ... are its modules and subpackages, where arcface_torch users look for
them, and `shardface` in the checkout is a link to the root, so the package imports there without
installing. The public names below load on first use: `import shardface.heads` loads no photo tools.
"""

from shardface.lazy import lazy_exports

_PUBLIC = {
    "load_model": "shardface.infer.model",
    "Model": "shardface.infer.model",
    "Comparison": "shardface.infer.model",
    "Gallery": "shardface.infer.enrolment",
    "Match": "shardface.infer.enrolment",
    "Threshold": "shardface.infer.thresholds",
    "fit_threshold": "shardface.eval.verification",
    "UserError": "shardface.errors",
    "ConfigError": "shardface.errors",
    "DataError": "shardface.errors",
    "ModelError": "shardface.errors",
    "OutputError": "shardface.errors",
}
__all__ = list(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
