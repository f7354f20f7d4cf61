"""Finding the faces of one photo list on many machines (`pack_rec --align` under torchrun): each rank
finds its share's faces (dataset.shares) on its own cores and writes them exactly into its part's
manifest beside the output; rank 0 gathers every manifest into the `Found` one process would have
made, so it writes what one process writes, byte for byte. Detection is nearly all the work (warp
and packing a few per cent): W machines take about 1/W."""

from __future__ import annotations

from typing import Callable

from shardface.dataset.shares import Parts, Ranks, list_key, share_of
from shardface.faces.detect import Detection, Face
from shardface.faces.stream import Found, find_faces


def find_faces_ranked(
    paths: list[str],
    detection: Detection,
    output: str,
    ranks: Ranks,
    progress: Callable[[], None] | None = None,
    workers: int = 1,
) -> tuple[Found, Parts | None] | None:
    """The faces of every photo of `paths`, found by the ranks, each writing its share into its part
    beside `output` (kept where a run of this job left it complete): rank 0 returns them all (as
    `find_faces`, which one rank is) and the parts, which it removes once its output is published;
    the others None."""
    if ranks.world == 1:
        return find_faces(paths, detection, progress, workers), None
    ranks.agree(paths, detection, root="")
    parts = Parts(output, list_key(paths, detection, "faces in the manifests", root=""), ranks.world)
    mine = share_of(len(paths), ranks.rank, ranks.world)
    share = paths[mine.start : mine.end]

    def fill(part) -> None:
        found = find_faces(share, detection, progress if ranks.rank == 0 else None, workers)
        part.summary["faces"] = [[face.to_dict() for face in found.faces[path]] for path in share]

    manifests = ranks.outcome(lambda: parts.make(ranks.rank, paths, fill, root=""))
    if ranks.rank != 0:
        return None
    rows = [faces for manifest in manifests for faces in manifest["summary"]["faces"]]
    return Found(
        {p: [Face.from_dict(record) for record in faces] for p, faces in zip(paths, rows)}, detection
    ), parts
