"""A package's names imported on first use (PEP 562): a light module of the package then loads
without the heavy ones (torch) that other names of it need."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def names_on_first_use(package: str, module_of: dict[str, str]) -> Callable[[str], object]:
    """The package's `__getattr__`: name -> that name from `package.<module_of[name]>`."""

    def __getattr__(name: str):
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
