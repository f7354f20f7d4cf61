"""At W=8 every rank issues the same collectives (op, shapes, dtypes, peers) in the same order
through training steps with ZeRO-2 (head, backbone, both optimizers, fp16 scaler, EMA), a
checkpoint save, a resume into fresh objects and a step after it. A rank that issued one
collective more, or another shape, would hang NCCL or mix up its buckets.

The real torch.distributed functions are wrapped inside each spawned rank: the collective
still runs (gloo), the wrapper only writes down what was asked for.
"""

from shardface.checkpoint.load import load_checkpoint
from shardface.checkpoint.save import save_checkpoint
from shardface.checkpoint.state import TrainState
from tests.collective_log import recording
from tests.distributed import run_distributed
from tests.tiny_zero_run import build_parts, train_step

WORLD = 8


def _train_save_resume(rank, world_size, output):
    logs = {}
    for exchange in ("collective", "p2p"):  # the NCCL default, then gloo's
        out = f"{output}/{exchange}"
        with recording() as (log, p2p):
            parts = build_parts(rank, exchange)
            for _ in range(2):
                train_step(parts)
            save_checkpoint(out, TrainState(step=2), **parts, rank=rank, world_size=world_size)
            resumed = build_parts(rank, exchange)
            state, _ = load_checkpoint(out, **resumed, rank=rank, world_size=world_size)
            assert state.step == 2
            train_step(resumed)
        logs[exchange] = (log, p2p)
    return logs


def _p2p_messages(p2p, rank):
    """(sender, receiver, tag, shape, dtype) of each message, as this rank saw it."""
    out = []
    for name, args, kwargs in p2p:
        peer = kwargs.get("dst", kwargs.get("src"))
        tensor = args[0]
        sender, receiver = (rank, peer) if name == "isend" else (peer, rank)
        out.append((sender, receiver, kwargs.get("tag"), tensor[1], tensor[2]))
    return out


def _comparable(entry, rank):
    """A call as every rank must issue it. A gather's list of receive buffers exists on its
    destination only (None elsewhere): there it must hold W tensors shaped like the input."""
    name, args, kwargs = entry
    if name == "gather":
        tensor, parts = args[0], args[1] if len(args) > 1 else kwargs.get("gather_list")
        if rank == kwargs.get("dst", 0):
            assert parts == [tensor] * WORLD, entry
        else:
            assert parts is None, entry
        return name, [tensor], {k: v for k, v in kwargs.items() if k != "gather_list"}
    return entry


def test_every_rank_issues_the_same_collectives_through_steps_checkpoint_and_resume(tmp_path):
    results = run_distributed(_train_save_resume, WORLD, str(tmp_path), timeout=170)
    for exchange in ("collective", "p2p"):
        logs = [[_comparable(entry, rank) for entry in r[exchange][0]] for rank, r in enumerate(results)]
        names = [entry[0] for entry in logs[0]]
        # the sequence is not trivially short: every part of the step and the checkpoint is in it
        for expected in (
            {"all_gather_into_tensor", "all_gather_single"},  # torch >= 2.14 spells them _single
            {"reduce_scatter_tensor", "reduce_scatter_single"},
            {"all_reduce"},
            {"barrier", "all_gather_object"},  # the checkpoint's ranks agree on its writes
            {"gather"},
        ):  # the checkpoint's sharded states go to rank 0 alone
            assert expected & set(names), (exchange, expected, sorted(set(names)))
        assert "reduce" not in names  # the collective exchange reduce-scatters; p2p sends to the owners
        for rank in range(1, WORLD):
            assert len(logs[rank]) == len(logs[0]), (exchange, rank)
            for i, (mine, first) in enumerate(zip(logs[rank], logs[0])):
                assert mine == first, f"{exchange}: rank {rank} call {i} is {mine}, rank 0's is {first}"
    # gloo's point-to-point exchange: every message sent is received, with its shape, in order
    sent, received = {}, {}
    for rank, r in enumerate(results):
        for msg in _p2p_messages(r["p2p"][1], rank):
            book = sent if msg[0] == rank else received
            book.setdefault(msg[:2], []).append(msg[2:])
    assert sent and sent == received
    assert not any(r["collective"][1] for r in results)  # the NCCL path sends nothing point to point
