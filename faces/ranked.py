"""Finding the faces of one photo list on many machines (`pack_rec --align` under torchrun, or
`--rank R --world W` by hand): each rank finds its share's faces (dataset.shares) on its own cores
and writes them exactly into its part's manifest beside the output; rank 0 reads every part back
into the `Found` one process would have made, so it writes what one process writes, byte for byte.
Detection is nearly all the work (warp and packing a few per cent): W machines take about 1/W."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from shardface.dataset.shares import WAIT_MIN_S, Parts, list_key, share_of
from shardface.faces.detect import Detection, Face
from shardface.faces.stream import Found, find_faces


def _record(face: Face) -> dict:
    """A face as JSON: floats written in full (repr), so it reads back bit for bit."""
    return {
        "box": list(face.box),
        "points": face.points.tolist(),
        "score": face.score,
        "shape": None if face.shape is None else face.shape.tolist(),
    }


def _face(record: dict) -> Face:
    shape = record["shape"]
    return Face(
        tuple(record["box"]),
        np.asarray(record["points"], np.float64),
        record["score"],
        None if shape is None else np.asarray(shape, np.float64),
    )


def find_faces_ranked(
    paths: list[str],
    detection: Detection,
    output: str,
    rank: int,
    world: int,
    progress: Callable[[], None] | None = None,
    workers: int = 1,
) -> Found | None:
    """The faces of every photo of `paths`, found by `world` ranks, each writing its share into its
    part beside `output`: rank 0 returns them all (as `find_faces`, which world 1 is), others None."""
    if world == 1:
        return find_faces(paths, detection, progress, workers)
    parts = Parts(output, list_key(paths, detection, "faces in the manifests", root=""), world)
    start, mine = time.monotonic(), share_of(len(paths), rank, world)
    share = paths[mine.start : mine.end]
    if parts.manifest(rank, paths) is None:  # else done by an earlier run of this job: kept
        found = find_faces(share, detection, progress if rank == 0 else None, workers)
        with parts.writing(rank, paths) as part:  # the manifest checks that a part holds its share
            part.summary["faces"] = [[_record(face) for face in found.faces[path]] for path in share]
    if rank != 0:
        return None
    manifests = parts.wait(paths, max(WAIT_MIN_S, time.monotonic() - start))
    rows = [faces for manifest in manifests for faces in manifest["summary"]["faces"]]
    parts.remove()
    return Found({p: [_face(record) for record in faces] for p, faces in zip(paths, rows)}, detection)
