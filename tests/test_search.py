"""Gallery search: every engine equals a brute-force sort (ties to the lower id, k beyond the
gallery clamped to its size), whatever the block sizes and storage; "auto" answers as both do
and picks the engine its measured table names."""

import numpy as np
import pytest
import torch

from shardface.infer.search import FASTER, ExactIndex, FaissIndex, make_index, pick_engine


def brute_force(gallery: np.ndarray, queries: np.ndarray, k: int):
    """Every score, then sort by (score descending, id ascending) with Python's sort: the first
    k of each row, all of them where the gallery holds fewer."""
    scores = queries.astype(np.float64) @ gallery.astype(np.float64).T
    ranked = [sorted(range(len(row)), key=lambda j: (-row[j], j))[:k] for row in scores]
    return (
        np.array([row[r] for row, r in zip(scores, ranked)]).reshape(len(queries), -1),
        np.array(ranked, np.int64).reshape(len(queries), -1),
    )


def tied_gallery(rng, n: int, dim: int) -> np.ndarray:
    """Small-integer vectors: dot products are exact in float32 and many are equal."""
    return rng.integers(-2, 3, size=(n, dim)).astype(np.float32)


ENGINES = {
    "exact": lambda d: ExactIndex(d, gallery_block=7, query_block=3),
    "exact-fp16": lambda d: ExactIndex(d, torch.float16, gallery_block=16, query_block=5),
    "exact-one-block": lambda d: ExactIndex(d),
    "faiss": lambda d: FaissIndex(d),
    "faiss-fp16": lambda d: FaissIndex(d, fp16=True),
}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("n,k", [(40, 1), (40, 5), (40, 40), (23, 30), (1, 3)])
def test_search_equals_brute_force_with_ties_and_k_beyond_the_gallery(engine, n, k):
    rng = np.random.default_rng(n * 100 + k)
    gallery, queries = tied_gallery(rng, n, 4), tied_gallery(rng, 11, 4)
    index = ENGINES[engine](4)
    index.add(gallery[: n // 2])  # added in two calls: ids continue
    index.add(gallery[n // 2 :])
    scores, ids = index.search(queries, k)
    want_s, want_i = brute_force(gallery, queries, k)
    assert index.ntotal == n and scores.dtype == np.float32 and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(scores, want_s)


def test_faiss_engine_asks_again_until_ties_at_the_kth_place_are_settled_by_the_lower_id():
    """faiss keeps whichever equal scores its scan meets first. Scanned from the highest id
    down (a real IndexFlatIP behind an IndexIDMap, rows added in reverse), its first answer
    holds the wrong ones of 60 tied rows: the engine must fetch more places until the k-th
    score is settled, and still return the lowest ids."""
    import faiss

    rng = np.random.default_rng(0)
    gallery = np.concatenate([np.tile([[1, 0, 0, 0]], (60, 1)), tied_gallery(rng, 20, 4) * 0.1]).astype(
        np.float32
    )
    queries = np.array([[1, 0, 0, 0], [2, 0, 0, 0]], np.float32)
    index = FaissIndex(4)
    index.index = faiss.IndexIDMap(faiss.IndexFlatIP(4))
    order = np.arange(len(gallery))[::-1].copy()
    index.index.add_with_ids(gallery[order], order.astype(np.int64))
    calls = []
    search = index.index.search
    index.index.search = lambda q, k: calls.append(k) or search(q, k)
    scores, ids = index.search(queries, 3)
    want_s, want_i = brute_force(gallery, queries, 3)
    np.testing.assert_array_equal(ids, want_i)  # [0, 1, 2]: the lowest of the 60 ties
    np.testing.assert_array_equal(scores, want_s)
    assert len(calls) > 1 and calls[0] < 60 <= calls[-1], calls  # the first answer was not settled


@pytest.mark.parametrize("engine", ["exact", "faiss"])
def test_search_of_random_unit_vectors_equals_brute_force(engine):
    rng = np.random.default_rng(1)
    gallery = rng.normal(size=(300, 32)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = gallery[rng.integers(0, 300, 20)] + 0.1 * rng.normal(size=(20, 32)).astype(np.float32)
    index = make_index(32, engine)
    index.add(gallery)
    scores, ids = index.search(queries, 10)
    want_s, want_i = brute_force(gallery, queries, 10)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_allclose(scores, want_s, atol=1e-5)


def test_engines_agree_and_fp16_storage_changes_scores_only_by_its_rounding():
    rng = np.random.default_rng(2)
    gallery = rng.normal(size=(500, 64)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = gallery[:50] + 0.2 * rng.normal(size=(50, 64)).astype(np.float32)
    results = {}
    for name, index in {
        "exact": make_index(64),
        "faiss": make_index(64, "faiss"),
        "fp16": make_index(64, fp16=True),
    }.items():
        index.add(gallery)
        results[name] = index.search(queries, 5)
    np.testing.assert_array_equal(results["exact"][1], results["faiss"][1])
    np.testing.assert_allclose(results["exact"][0], results["faiss"][0], atol=1e-5)
    np.testing.assert_array_equal(results["exact"][1][:, 0], results["fp16"][1][:, 0])
    np.testing.assert_allclose(results["exact"][0], results["fp16"][0], atol=2e-3)


def test_wrong_shapes_and_k_are_refused_by_name():
    index = make_index(8)
    with pytest.raises(ValueError, match="expected N x 8"):
        index.add(np.zeros((3, 7), np.float32))
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(np.zeros((1, 8), np.float32), 0)
    with pytest.raises(ValueError, match="unknown search engine"):
        make_index(8, "annoy")


SIZES, QUERIES = (10_000, 100_000, 1_000_000), (1, 10, 100, 1000)  # benchmarks/search.py --grid


def test_the_rule_covers_the_measured_grid_with_an_engine_per_threads_and_storage():
    assert set(FASTER) == {(n, q) for n in SIZES for q in QUERIES}
    assert all(len(picks) == 4 and set(picks) <= {"exact", "faiss"} for picks in FASTER.values())


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 16])
def test_the_rule_picks_the_table_entry_of_the_nearest_measured_point(threads, fp16):
    column = (threads > 1) + 2 * fp16  # (1 thread, all) x (float32, float16)
    nearest_size = {
        10_000: 10_000,
        1: 10_000,
        31_000: 10_000,
        32_000: 100_000,
        300_000: 100_000,
        317_000: 1_000_000,
        50_000_000: 1_000_000,
    }
    nearest_queries = {1: 1, 0: 1, 3: 1, 4: 10, 31: 10, 32: 100, 316: 100, 317: 1000, 10**6: 1000}
    for size, n in nearest_size.items():
        for queries, q in nearest_queries.items():
            assert pick_engine(size, queries, threads, fp16) == FASTER[n, q][column], (size, queries)


@pytest.mark.parametrize("fp16", [False, True])
def test_auto_builds_the_engine_the_rule_picks_for_this_process_threads(fp16):
    for size, queries in FASTER:
        index = make_index(8, "auto", fp16, size=size, queries=queries)
        engine = pick_engine(size, queries, torch.get_num_threads(), fp16)
        assert isinstance(index, ExactIndex if engine == "exact" else FaissIndex)
        if engine == "exact":
            assert index.dtype == (torch.float16 if fp16 else torch.float32)
    with pytest.raises(ValueError, match="give size and queries"):
        make_index(8, "auto")


@pytest.mark.parametrize("fp16", [False, True])
def test_auto_answers_exactly_as_both_engines_with_ties_to_the_lower_id(fp16):
    """Whatever auto picks at each measured point, the answer is the brute-force sort, and so
    the same as either engine's."""
    rng = np.random.default_rng(7)
    gallery, queries = tied_gallery(rng, 50, 4), tied_gallery(rng, 9, 4)
    want_s, want_i = brute_force(gallery, queries, 6)
    for engine in ("exact", "faiss"):
        index = make_index(4, engine, fp16)
        index.add(gallery)
        scores, ids = index.search(queries, 6)
        np.testing.assert_array_equal(ids, want_i)
        np.testing.assert_array_equal(scores, want_s)
    for size, n in FASTER:
        index = make_index(4, "auto", fp16, size=size, queries=n)
        index.add(gallery)
        scores, ids = index.search(queries, 6)
        np.testing.assert_array_equal(ids, want_i)
        np.testing.assert_array_equal(scores, want_s)


@pytest.mark.parametrize("engine", ENGINES)
def test_k_far_beyond_the_gallery_is_clamped_before_anything_is_allocated(engine):
    """identify --top 1000000000 with two people: Q x k places would be terabytes; the answer is
    every row of the gallery, best first, as for k = N."""
    rng = np.random.default_rng(7)
    gallery, queries = tied_gallery(rng, 2, 4), tied_gallery(rng, 3, 4)
    index = ENGINES[engine](4)
    index.add(gallery)
    scores, ids = index.search(queries, 10**12)
    want_s, want_i = brute_force(gallery, queries, 2)
    assert scores.shape == ids.shape == (3, 2)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(scores, want_s)


def test_gallery_identify_with_a_huge_top_lists_everyone_once():
    """The path Gallery.identify(top=...) and scripts.identify share (infer.enrolment.identify)."""
    from shardface.infer.enrolment import identify

    rng = np.random.default_rng(3)
    templates = rng.normal(size=(2, 8)).astype(np.float32)
    templates /= np.linalg.norm(templates, axis=1, keepdims=True)

    class Two:  # the two fields identify reads of an Enrolment
        pass

    gallery = Two()
    gallery.templates, gallery.names = templates, ["ann", "bob"]
    scores, ids = identify(gallery, templates[:1], 10**12)
    assert ids.tolist() == [[0, 1]] and scores.shape == (1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_exact_engine_on_a_gpu_answers_as_brute_force_with_ties_to_the_lower_id(dtype):
    rng = np.random.default_rng(7)
    gallery, queries = tied_gallery(rng, 40, 4), tied_gallery(rng, 11, 4)
    index = ExactIndex(4, dtype, gallery_block=7, query_block=3, device="cuda")
    index.add(gallery)
    scores, ids = index.search(queries, 5)
    want_s, want_i = brute_force(gallery, queries, 5)
    np.testing.assert_array_equal(ids, want_i)
    np.testing.assert_array_equal(scores, want_s)


def test_auto_on_a_models_gpu_is_the_exact_engine_there():
    index = make_index(4, "auto", size=10, queries=1, device=torch.device("cuda", 0))
    assert isinstance(index, ExactIndex) and index.device == torch.device("cuda", 0)  # nothing allocated yet
