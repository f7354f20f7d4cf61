"""A package's public names, imported on first use (PEP 562): importing one module of the package
then costs only that module's own imports (the photo tools' workers import no torch)."""

import importlib
from typing import Callable


def lazy_exports(package: str, names: dict[str, str]) -> tuple[Callable, Callable]:
    """`__getattr__` and `__dir__` for `package`, whose public name `n` is defined in module `names[n]`."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(names[name]), name)

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
