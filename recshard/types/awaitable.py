"""Awaitables: results that may still be in flight (TorchRec's `Awaitable`, `NoWait`,
`LazyAwaitable`). Every dist step returns one; nothing blocks until `wait()`."""

from __future__ import annotations

import abc
from typing import Any, Callable, Generic, Iterator, List, TypeVar

W = TypeVar("W")


class Awaitable(abc.ABC, Generic[W]):
    """A result that may still be in flight. `wait()` finishes it, applies `callbacks` in
    order, and caches the result: waiting twice returns the same object (TorchRec re-runs
    the wait and fails)."""

    def __init__(self) -> None:
        self.callbacks: List[Callable[[W], W]] = []
        self._done = False
        self._result: Any = None

    @abc.abstractmethod
    def _wait_impl(self) -> W: ...

    def wait(self) -> W:
        if not self._done:
            result = self._wait_impl()
            for callback in self.callbacks:
                result = callback(result)
            self._result = result
            self._done = True
        return self._result


class NoWait(Awaitable[W]):
    """An awaitable of a value that is already there."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj


class FnAwaitable(Awaitable[W]):
    """An awaitable whose wait calls a function (e.g. wait on a work handle, then reshape)."""

    def __init__(self, fn: Callable[[], W]) -> None:
        super().__init__()
        self._fn = fn

    def _wait_impl(self) -> W:
        return self._fn()


def _wait_lazy(obj: Any) -> Any:
    """Replace LazyAwaitables (also inside lists, tuples and dicts) by their results."""
    if isinstance(obj, LazyAwaitable):
        return obj.wait()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_wait_lazy(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _wait_lazy(v) for k, v in obj.items()}
    return obj


class LazyAwaitable(Awaitable[W]):
    """An awaitable that waits by itself when its result is used: passed to a torch function,
    or an attribute / item of it is read. Model code stays unaware of the communication."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        return func(*_wait_lazy(args), **_wait_lazy(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("callbacks",):
            raise AttributeError(name)
        return getattr(self.wait(), name)

    def __getitem__(self, key: Any) -> Any:
        return self.wait()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.wait())

    def __len__(self) -> int:
        return len(self.wait())


def _lazy_binary(op: str) -> Callable[[LazyAwaitable, Any], Any]:
    def method(self: LazyAwaitable, other: Any) -> Any:
        return getattr(self.wait(), op)(_wait_lazy(other))

    method.__name__ = op
    return method


for _op in (
    "__add__",
    "__radd__",
    "__sub__",
    "__rsub__",
    "__mul__",
    "__rmul__",
    "__truediv__",
    "__rtruediv__",
    "__matmul__",
    "__rmatmul__",
    "__eq__",
):
    setattr(LazyAwaitable, _op, _lazy_binary(_op))
LazyAwaitable.__hash__ = object.__hash__  # type: ignore[method-assign]


class LazyNoWait(LazyAwaitable[W]):
    """A lazy awaitable of a value that is already there."""

    def __init__(self, obj: W) -> None:
        super().__init__()
        self._obj = obj

    def _wait_impl(self) -> W:
        return self._obj
