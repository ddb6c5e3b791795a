"""One registry per command: ``METHODS = Registry("compress")`` and ``@METHODS.register("zs-svd")``.

The registry lists its methods for ``--help`` and for the error raised on an unknown name.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

from llmtool.core.console import UsageError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, command: str, what: str = "method"):
        self.command = command
        self.what = what
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.command}: {self.what} {name!r} registered twice")
            self._items[name] = obj
            return obj

        return deco

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UsageError(
                f"unknown {self.what} {name!r} for `llmtool {self.command}`; choose one of: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: Any) -> bool:
        return name in self._items

    def items(self):
        return sorted(self._items.items())
