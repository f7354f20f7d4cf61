"""Count the operations that make the host wait for a CUDA device, on any device.

On a GPU these drain the launch queue: reading a value (`.item()`, `.tolist()`, `bool(t)`),
data-dependent output sizes (`nonzero`, `unique`, `masked_select`, boolean-mask indexing)
and device-side asserts that must be checked. A TorchDispatchMode sees every aten call, so
the count on the CPU is the count the same code makes on a GPU. `.tolist()` and `.numpy()`
of a CPU tensor dispatch no aten op, so a TorchFunctionMode beside it sees those. (`.cpu()`
and `.to("cpu")` are not counted: on a CPU run they are no-ops that cannot be told from a
device copy; on a GPU, `torch.cuda.set_sync_debug_mode` in the gpu tests catches them.)
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNCING = {
    "aten::_local_scalar_dense",  # .item(), float(t), bool(t), torch.is_nonzero
    "aten::nonzero",
    "aten::nonzero_static_unused",
    "aten::argwhere",
    "aten::unique",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::masked_select",
    "aten::is_nonzero",
    "aten::_assert_async",
    "aten::equal",
    "aten::repeat_interleave",
}
_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
_HOST_READS = {"tolist", "numpy"}  # Tensor methods that copy the data to Python / numpy


class _HostReads(TorchFunctionMode):
    def __init__(self, calls: list[str]):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in _HOST_READS:
            self.calls.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class HostSyncCounter(TorchDispatchMode):
    """`with HostSyncCounter() as c: ...`; `c.calls` lists each syncing op by name, in order."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._reads = _HostReads(self.calls)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SYNCING:
            self.calls.append(name)
        elif name in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t is not None and t.dtype == torch.bool for t in indices):
                self.calls.append(name + "(bool mask)")
        return func(*args, **kwargs)


_FROM_HOST_DATA = {"tensor", "as_tensor", "asarray", "new_tensor"}  # seen by a TorchFunctionMode
_FROM_HOST_MEMORY = ("from_numpy", "frombuffer")  # not dispatched: wrapped while counting


class HostDataCounter(TorchFunctionMode):
    """`with HostDataCounter() as c: ...`; `c.calls` lists each tensor made from host data
    (Python numbers or lists, numpy arrays, buffers), in order. In a training step each one is
    a copy from pageable host memory to the device, which waits for the stream: the host
    stalls behind the queued work, and HostSyncCounter (and CUDA's sync debug mode, which sees
    only the copies torch itself synchronises) cannot see it. The count on the CPU is the
    count on a GPU: the same calls build the same tensors. `torch.from_numpy` and
    `torch.frombuffer` reach no mode, so they are wrapped while the counter is active."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []
        self._saved: dict = {}

    def __enter__(self):
        for name in _FROM_HOST_MEMORY:
            self._saved[name] = real = getattr(torch, name)
            setattr(torch, name, self._counted(name, real))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, real in self._saved.items():
                setattr(torch, name, real)
            self._saved.clear()

    def _counted(self, name: str, real):
        def counted(*args, **kwargs):
            self.calls.append(f"torch.{name}")
            return real(*args, **kwargs)

        return counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _FROM_HOST_DATA:
            data = args[1] if name == "new_tensor" else args[0] if args else (kwargs or {}).get("data")
            if not torch.is_tensor(data):  # a tensor's own copy is no host data
                self.calls.append(("Tensor." if name == "new_tensor" else "torch.") + name)
        return func(*args, **(kwargs or {}))
