"""Host synchronisation: the counter catches each op that makes a CUDA host wait (and none
of their fixed-size replacements); the head's forward+backward must make none."""

import pytest
import torch

from tests.host_sync import HostSyncCounter

SYNCING = [
    ("item", lambda x: x.sum().item(), "aten::_local_scalar_dense"),
    ("bool", lambda x: bool(x[1] > 0), "aten::_local_scalar_dense"),
    ("is_nonzero", lambda x: torch.is_nonzero(x[1:2]), "aten::_local_scalar_dense"),
    ("nonzero", lambda x: torch.nonzero(x), "aten::nonzero"),
    ("argwhere", lambda x: torch.argwhere(x), "aten::nonzero"),
    ("where_one_argument", lambda x: torch.where(x > 0), "aten::nonzero"),
    ("unique", lambda x: torch.unique(x), "aten::_unique2"),
    ("unique_dim", lambda x: torch.unique(x[:, None], dim=0), "aten::unique_dim"),
    ("unique_consecutive", lambda x: torch.unique_consecutive(x), "aten::unique_consecutive"),
    ("masked_select", lambda x: torch.masked_select(x, x > 0), "aten::masked_select"),
    ("bool_mask_index", lambda x: x[x > 0], "aten::index(bool mask)"),
    # a tensor value: torch >= 2.15 turns `x[mask] = <Python scalar>` into masked_fill_ (no sync)
    (
        "bool_mask_assign",
        lambda x: x.clone().__setitem__(x > 0, torch.tensor(0.0)),
        "aten::index_put_(bool mask)",
    ),
    ("assert_async", lambda x: torch._assert_async(x[1] > 0), "aten::_assert_async"),
    ("equal", lambda x: torch.equal(x, x), "aten::equal"),
    ("repeat_interleave", lambda x: torch.repeat_interleave(torch.tensor([1, 2])), "aten::repeat_interleave"),
    ("tolist", lambda x: x.tolist(), "Tensor.tolist"),
    ("numpy", lambda x: x.numpy(), "Tensor.numpy"),
]

# what the head uses instead: fixed output sizes, no value read by the host
NOT_SYNCING = [
    lambda x: torch.nonzero_static(x, size=3),
    lambda x: torch.topk(x, 2),
    lambda x: x.masked_fill(x > 0, 0.0),
    lambda x: torch.where(x > 0, x, -x),
    lambda x: x.index_select(0, torch.tensor([2, 0])),
    lambda x: x[torch.tensor([2, 0])],
    lambda x: torch.searchsorted(x, torch.tensor([0.5])),
    lambda x: torch.zeros(4).scatter_add_(0, torch.tensor([1, 1, 3]), x),
    lambda x: x.clone().index_put_((torch.tensor([0]),), torch.tensor(5.0)),
]


@pytest.mark.parametrize("name,op,expected", SYNCING, ids=[s[0] for s in SYNCING])
def test_counter_sees_each_host_synchronising_op(name, op, expected):
    x = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncCounter() as c:
        op(x)
    assert c.calls == [expected]


def test_counter_ignores_fixed_size_replacements():
    x = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncCounter() as c:
        for op in NOT_SYNCING:
            op(x)
    assert c.calls == []


def test_counter_records_in_order_and_stops_at_exit():
    x = torch.tensor([0.0, 1.0, 2.0])
    with HostSyncCounter() as c:
        x.tolist()
        torch.nonzero(x)
        x.max().item()
    x.tolist(), torch.nonzero(x)
    assert c.calls == ["Tensor.tolist", "aten::nonzero", "aten::_local_scalar_dense"]
