"""The engine's process-wide caches of tensors, owned by whoever attached the engine: ``Guard.close()`` (and so
``unprotect()``) calls ``engine_caches.clear()``, so a causal mask cached at 8k context (~2 GiB of bool on the GPU per
(T, S, device)) does not outlive the run that made it."""
from __future__ import annotations

import functools
from typing import Any

import torch

from .abft import checksum_weights
from .abft.tolerance import _weights as _bound_weights

__all__ = ["EngineCaches", "engine_caches"]


class EngineCaches:
    """The lru_caches of tensors the engine keeps between calls; ``clear()`` empties all of them at once."""

    def __init__(self) -> None:
        self._caches: list[Any] = []

    def register(self, fn: Any) -> None:
        """Own a functools.lru_cache (abft's checksum weights too: abft is pure and cannot import this module)."""
        self._caches.append(fn)

    def entries(self) -> int:
        """How many tensors (entries) the caches hold now."""
        return sum(fn.cache_info().currsize for fn in self._caches)

    def clear(self) -> None:
        for fn in self._caches:
            fn.cache_clear()


engine_caches = EngineCaches()
engine_caches.register(checksum_weights)
engine_caches.register(_bound_weights)


@functools.lru_cache(maxsize=32)
def _future_mask(t: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(T, S) bool, True above the diagonal (top-left aligned, as SDPA's is_causal). Cached: callers must not
    write it."""
    return torch.ones(t, n_keys, dtype=torch.bool, device=device).triu(1)


engine_caches.register(_future_mask)
