#!/usr/bin/env python
"""Use a face model from Python, in face_recognition's spirit: load it, find faces, embed,
compare, enrol a gallery and identify.

    python examples/use_a_model.py MODEL PEOPLE QUERY [OTHER]    (shardface installed: make setup)

MODEL: `dlib`, a run or checkpoint directory, a model.pt or an .onnx. PEOPLE: a folder with one
folder of photos per person. QUERY, OTHER: photos (OTHER defaults to QUERY)."""

import sys

from shardface import Gallery, load_model


def main(model_name: str, people: str, query: str, other: str | None = None) -> None:
    model = load_model(model_name)  # any MODEL form, resolved once
    for face in model.faces(query):  # largest first
        print(f"face at {tuple(round(v) for v in face.box)}, score {face.score:.2f}")
    embedding = model.embed([query])[0]  # its largest face: a unit vector
    print(f"embedding: {embedding.shape[0]} numbers")
    print(f"cosine to {other or query}: {model.compare(query, other or query).score:.4f}")
    gallery = Gallery(model, people)  # enrolled once, cached in PEOPLE
    for match in gallery.identify(query):  # one answer per face: .name (None: nobody), .score, .box
        print(f"{match.name or 'unknown'} ({match.score:.4f})")


if __name__ == "__main__":
    main(*sys.argv[1:])
