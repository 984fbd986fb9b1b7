"""The engine's process-wide caches of tensors, owned by the live guards together: the last one's ``Guard.close()``
(and so ``unprotect()``) calls ``engine_caches.clear()``, so a causal mask cached at 8k context (~2 GiB of bool on the
GPU per (T, S, device)) does not outlive the runs that made it, and closing one of several guards leaves the others
their cached tensors."""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..abft import checksum_weights
from ..abft.tolerance import _weights as _bound_weights

__all__ = ["EngineCaches", "engine_caches", "fill_future_"]


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


FUTURE_BLOCK = 64
"""Rows per block of ``fill_future_``."""


@functools.lru_cache(maxsize=32)
def _future_values(n: int, value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, n): ``value`` above the diagonal, 0 on and below it. Cached: callers must not write it."""
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill_(_future_mask(n, n, device), value)


engine_caches.register(_future_values)


def fill_future_(x_TS: torch.Tensor, value: float, *, row0: int = 0) -> torch.Tensor:
    """x (..., T, S), rows row0..row0+T of a causal attention (top-left aligned, as SDPA's is_causal): every key
    j > i set to ``value``, in place, whatever was there (an INF or NaN too). A block of rows at a time: the keys
    past the block's last row are one strided fill; in its diagonal block, tril_ zeroes the future keys and a cached
    triangle of ``value`` is added to them. A masked_fill_ of the whole tensor with the (T, S) mask broadcast over
    (B, H) ran ~10x slower on CPU (1.8 ms for (4, 8, 256, 256)), and so did masked_fill_ on the diagonal blocks."""
    t, s = x_TS.shape[-2:]
    for r0 in range(0, t, FUTURE_BLOCK):
        r1 = min(t, r0 + FUTURE_BLOCK)
        first, last = row0 + r0, row0 + r1  # the block's absolute rows: first..last-1
        if last < s:
            x_TS[..., r0:r1, last:].fill_(value)
        end = min(last, s)
        if first < end:
            diag = x_TS[..., r0:r1, first:end]
            diag.tril_()
            if value != 0.0:
                diag.add_(_future_values(FUTURE_BLOCK, value, x_TS.dtype, x_TS.device)[: r1 - r0, : end - first])
    return x_TS
