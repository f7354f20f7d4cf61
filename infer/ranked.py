"""Finding the faces of one photo list on many machines (`pack_rec --align` under torchrun): each rank
finds its share's faces (dataset.shares) on its own cores and writes them exactly into its part's
manifest beside the output; rank 0 gathers every manifest into the `Found` one process would have
made, so it writes what one process writes, byte for byte. Detection is nearly all the work (warp
and packing a few per cent): W machines take about 1/W.

A rank saves what it finds as it goes, in its `ShareCache` beside the parts (infer.cache: every
SAVE_EVERY_S seconds and when its work stops), so a rank killed part-way through its share keeps
what it found, and a run again searches only the rest."""

from __future__ import annotations

import os
from typing import Callable

from shardface.dataset.shares import Parts, Ranks, list_key, share_of
from shardface.faces.detect import Detection, Face
from shardface.faces.stream import Found, find_faces, stream
from shardface.infer.cache import Cache, content_key


class ShareCache(Cache):
    """(photo path, content) -> the faces found in it (each `Face.to_dict`, largest first); one
    job's, as the parts folder that holds it is."""

    kind = "shardface rank faces"
    what = "rank's faces cache file"
    hint = "remove the parts folder"
    redo = "searching its share again"

    def __init__(self, path: str):
        super().__init__(path, {}, None)


def find_faces_ranked(
    paths: list[str],
    detection: Detection,
    output: str,
    ranks: Ranks,
    progress: Callable[[], None] | None = None,
    workers: int = 1,
) -> tuple[Found, Parts | None] | None:
    """The faces of every photo of `paths`, found by the ranks, each writing its share into its part
    beside `output` (kept where a run of this job left it complete, else its faces found so far
    taken up): rank 0 returns them all (as `find_faces`, which one rank is) and the parts, which it
    removes once its output is published; the others None."""
    if ranks.world == 1:
        return find_faces(paths, detection, progress, workers), None
    ranks.agree(paths, detection, root="")
    parts = Parts(output, list_key(paths, detection, "faces in the manifests", root=""), ranks.world)
    mine = share_of(len(paths), ranks.rank, ranks.world)
    share = paths[mine.start : mine.end]
    tick = progress if ranks.rank == 0 else None

    def fill(part) -> None:
        cache = ShareCache(os.path.join(parts.root, f"rank-{ranks.rank}.shardface_faces.sqlite"))
        keys = {p: f"{p}|{content_key(p)}" for p in share}
        todo = [p for p in share if keys[p] not in cache]
        if len(todo) < len(share):
            print(
                f"rank {ranks.rank} of {ranks.world}: the faces of {len(share) - len(todo)} of its "
                f"{len(share)} photos were found by an earlier run"
            )
        for _ in range(len(share) - len(todo)) if tick else ():
            tick()
        try:
            for photo in stream(todo, detection, workers=workers, progress=tick):
                cache.put(keys[photo.name], [face.to_dict() for face in photo.faces])
        finally:
            cache.save()
        part.summary["faces"] = [cache.get(keys[p]) for p in share]

    manifests = ranks.outcome(lambda: parts.make(ranks.rank, paths, fill, root=""))
    if ranks.rank != 0:
        return None
    rows = [faces for manifest in manifests for faces in manifest["summary"]["faces"]]
    return Found(
        {p: [Face.from_dict(record) for record in faces] for p, faces in zip(paths, rows)}, detection
    ), parts
