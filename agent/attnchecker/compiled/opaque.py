"""Autograd for a custom op whose body is the eager engine: the body records the engine's own autograd graph (its
checked backward, custom Functions and all) and keeps it under a handle the op returns; the op's registered backward is
another custom op that runs that graph with ``torch.autograd.grad``. The compiler sees two opaque calls and their fake
shapes; the engine's forward and backward run exactly as they do eagerly.

Kept graphs are dropped by the backward that uses them, or at the step boundary (``release``) when no backward came
(a forward whose loss was never differentiated)."""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = ["NO_HANDLE", "autograd_inside", "backward", "fake_grads", "fake_handle", "kept_count", "record", "release"]

NO_HANDLE = 0
"""The handle of a call that kept no graph (nothing needed a gradient)."""

# A custom op's body runs below the autograd dispatch keys (and below autocast): these are what has to be let through
# again for the engine's ops to record a graph.
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


@dataclass(slots=True)
class _Kept:
    outputs: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]
    owner: int
    """The key of the runtime whose step boundary drops it (``release``)."""


_KEPT: dict[int, _Kept] = {}
_HANDLES = itertools.count(1)


@contextlib.contextmanager
def autograd_inside() -> Iterator[None]:
    """Autograd on inside a custom op's body, as it is around an eager call of the engine."""
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in _AUTOGRAD_KEYS]
    for k in _AUTOGRAD_KEYS:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(_AUTOGRAD_KEYS, excluded, strict=True):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


def record(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], tensors: Sequence[torch.Tensor | None],
           grads: Sequence[bool], *, owner: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Run ``fn(*inputs)`` with autograd on, ``inputs`` being ``tensors`` detached and requiring grad where ``grads``
    says. Returns the outputs (detached, contiguous: what the fake implementations promise) and the handle, a () int64
    CPU tensor (``NO_HANDLE`` when no gradient is needed)."""
    inputs = [t.detach().requires_grad_(g and t.is_floating_point()) if t is not None else None
              for t, g in zip(tensors, grads, strict=True)]
    needed = any(t is not None and t.requires_grad for t in inputs)
    if needed:
        with autograd_inside():
            got = fn(*inputs)
    else:
        got = fn(*inputs)
    outputs = (got,) if isinstance(got, torch.Tensor) else tuple(got)
    key = NO_HANDLE
    if needed and any(o.requires_grad for o in outputs):
        key = next(_HANDLES)
        _KEPT[key] = _Kept(outputs=outputs, inputs=tuple(t for t in inputs if t is not None and t.requires_grad),
                           owner=owner)
    return tuple(o.detach().contiguous() for o in outputs), torch.tensor(key, dtype=torch.int64)


def backward(handle: torch.Tensor, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The gradients of the kept call's inputs that required grad (in their order), contiguous, given the gradients
    of its outputs (None: the output was not used)."""
    key = int(handle.item())  # sync: none (a CPU scalar)
    kept = _KEPT.pop(key, None)
    if kept is None:
        raise RuntimeError(
            "attnchecker: the backward of a compiled checked op found no graph for its forward: the backward ran twice "
            "(retain_graph=True is not supported through checked ops under torch.compile), or after the step "
            "boundary that released it")
    pairs = [(o, g) for o, g in zip(kept.outputs, grads, strict=True) if g is not None and o.requires_grad]
    got = torch.autograd.grad([o for o, _ in pairs], kept.inputs, [g for _, g in pairs], allow_unused=True,
                              materialize_grads=True)
    return [g.contiguous() for g in got]


def fake_handle() -> torch.Tensor:
    """The fake handle: a () int64 CPU tensor."""
    return torch.empty((), dtype=torch.int64, device="cpu")


def fake_grads(tensors: Sequence[torch.Tensor | None], grads: Sequence[bool]) -> list[torch.Tensor]:
    """What ``backward`` returns, as fake tensors: one contiguous gradient per floating input that requires grad."""
    return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t, g in zip(tensors, grads, strict=True)
            if t is not None and g and t.is_floating_point()]


def release(owner: int) -> None:
    """Drop every graph kept for ``owner`` (its step ended: a backward that was coming has come)."""
    for key in [k for k, kept in _KEPT.items() if kept.owner == owner]:
        del _KEPT[key]


def kept_count() -> int:
    """How many graphs are kept (tests: none may outlive its step)."""
    return len(_KEPT)
