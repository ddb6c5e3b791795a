"""A module that is imported on first attribute access.

Method modules whose registries the CLI reads (to derive ``--method`` and per-field options) use
``torch = lazy_module("torch")`` so that ``llmtool … --help`` never pays torch's import time; the
functions that compute still use ``torch.…`` as usual."""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class _LazyModule:
    __slots__ = ("_name", "_mod")

    def __init__(self, name: str) -> None:
        self._name = name
        self._mod: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._mod is None:
            self._mod = importlib.import_module(self._name)
        return getattr(self._mod, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (loaded)' if self._mod is not None else ''}>"


def lazy_module(name: str) -> Any:
    """A stand-in for ``import name`` that imports the module at its first attribute access."""
    return _LazyModule(name)
