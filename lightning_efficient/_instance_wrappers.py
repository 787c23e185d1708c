"""A method wrapped on one object for the length of a fit, that copies of the object do not inherit.

ActivationMemory sets each block's ``forward``, and SelectiveTokenLoss the module's ``training_step`` and
``optimizer_step``, on the instance. A closure set there refers to the object it was made for: a ``copy.deepcopy`` of
the module made while the fit runs (an EMA callback's copy, a model kept for evaluation) kept the closure, so the copy
ran the live module's blocks (a new user's trial: an EMA model evaluated the trained weights), and ``torch.save`` of
the module could not pickle it."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any


def _as_is(value: Any) -> Any:
    return value


class InstanceWrapper:
    """``wrapper``, called in place of ``original`` (the object's method as it was before: normally its class's, bound
    to it). A deep copy or a pickle of it is ``original`` copied with the object: bound to the copy, so the copy runs
    its own method, unwrapped. ``__wrapped__`` is ``original``, as :func:`functools.wraps` sets it."""

    def __init__(self, wrapper: Callable[..., Any], original: Callable[..., Any]) -> None:
        functools.update_wrapper(self, original)
        self._wrapper, self._original = wrapper, original
        code = getattr(original, "__code__", None)
        if code is not None:  # Lightning's is_overridden reads it one __wrapped__ below a wrapper of another's
            self.__code__ = code

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapper."""
        return self._wrapper(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self._original, memo)

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _as_is, (self._original,)


def put_back(owner: Any, name: str, method: Callable[..., Any]) -> None:
    """Set ``owner.name`` to ``method`` as it was before a wrapper: no instance attribute where ``method`` is the
    class's own, bound to ``owner``; else ``method`` itself (one set on the instance before, kept)."""
    if getattr(method, "__self__", None) is owner and getattr(method, "__func__", None) is getattr(type(owner), name, None):
        if name in vars(owner):
            delattr(owner, name)
    else:
        setattr(owner, name, method)
