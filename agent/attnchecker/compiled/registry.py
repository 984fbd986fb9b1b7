"""Integer keys for the LayerContexts a custom op's run-time body needs.

A custom op's schema takes tensors and scalars only; the traced graph carries the key as a constant, and the op's
body looks the object up when it runs. Every key is dropped when its guard closes (``Binder.on_close``)."""
from __future__ import annotations

import itertools
from typing import Any

from ..checks.context import LayerContext

__all__ = ["add", "context", "get", "remove"]

_OBJECTS: dict[int, Any] = {}
_KEYS = itertools.count(1)


def add(obj: Any) -> int:
    """A fresh key for ``obj`` (0 is never one: it stands for "not registered")."""
    key = next(_KEYS)
    _OBJECTS[key] = obj
    return key


def get(key: int) -> Any:
    try:
        return _OBJECTS[key]
    except KeyError:
        raise RuntimeError(
            f"attnchecker: a compiled graph calls a checked op of a guard that was closed (key {key}); compile the "
            "model again after protect() or unprotect() (torch._dynamo.reset())") from None


def remove(key: int) -> None:
    _OBJECTS.pop(key, None)


def context(key: int) -> LayerContext:
    """The LayerContext of ``key``, for an op's body; marks its step as one the model ran a forward in. The guard's
    root hooks count forwards eagerly; under compile they add nothing to the graph (an op there would sit in a graph
    of its own before a model's first graph break, transformers' loss), so any checked op that runs counts instead:
    the coverage claims (``coverage.unchecked_claims``) need to know only whether the model ran in a step."""
    ctx: LayerContext = get(key)
    stats = ctx.runtime.stats
    if stats is not None and stats.forwards == 0:
        stats.forwards = 1
    return ctx
