"""The clean residual/bound ratios of an interval's checks (wire: stats.residual_ratio), kept on the device and folded
into their histogram once, when it is read.

Every clean check adds its worst ratio (records._record_ratio): how close clean data came to a flag. Folded in one
check at a time, that was a dozen small tensor ops a check (isfinite, bucketize, index_add, two sums, a per-op
maximum): under protect(scope="all") about 70 a step, ~7 ms of a GPT-2 step on the overhead benchmark's CPU. Here a
check's ratios are only kept; the first read (the guard at the step boundary, a test) folds them all in with the ops
of one update. No sync either way: the ratios and the histogram stay device tensors.

Legend: V ratios pending, P the distinct ops among them.
"""
from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from .caches import engine_caches

__all__ = ["RESIDUAL_RATIO_BUCKETS", "RatioHistogram"]

# Upper bounds of the residual/bound histogram the agent keeps on the device (wire: stats.residual_ratio.le).
RESIDUAL_RATIO_BUCKETS: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5, 1.0, 10.0, 1000.0)

_Pending = tuple[torch.Tensor, "tuple[str, ...] | None"]


class RatioHistogram:
    """Bucket counts (len(RESIDUAL_RATIO_BUCKETS) + 1,), the sum and count of the finite ratios, and per op the
    largest, over the ratios ``add``ed: device tensors, None (empty dict) before the first."""

    __slots__ = ("_count", "_counts", "_max", "_pending", "_sum")

    def __init__(self) -> None:
        self._pending: list[_Pending] = []
        self._counts: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._max: dict[str, torch.Tensor] = {}

    def add(self, worst: torch.Tensor, op: str | Sequence[str] | None = None) -> None:
        """Checks' worst clean ratios: a device scalar (one check) or (V,) (one per check). op: the op of every
        ratio, or one per ratio (their per-op maxima are kept), or None. Kept as a copy (one small op, no sync): a
        caller may reuse its tensor before the fold."""
        ratios_V = worst.detach().reshape(-1).clone()
        names = None if op is None else (op,) * ratios_V.numel() if isinstance(op, str) else tuple(op)
        if names is not None and len(names) != ratios_V.numel():
            raise ValueError(f"RatioHistogram.add: {len(names)} op names for {ratios_V.numel()} ratios")
        self._pending.append((ratios_V, names))

    @property
    def counts(self) -> torch.Tensor | None:
        self._fold()
        return self._counts

    @property
    def total(self) -> torch.Tensor | None:
        """() float64: the sum of the finite ratios."""
        self._fold()
        return self._sum

    @property
    def count(self) -> torch.Tensor | None:
        """() int64: how many finite ratios."""
        self._fold()
        return self._count

    @property
    def maxima(self) -> dict[str, torch.Tensor]:
        """op -> () fp32, its largest finite ratio."""
        self._fold()
        return self._max

    def _fold(self) -> None:
        pending, self._pending = self._pending, []
        # In order, a run per device: a model moved between devices mid-interval (rare) starts the histogram over
        # on the new one, as it always has.
        for device, run in itertools.groupby(pending, key=lambda p: p[0].device):
            self._fold_run(device, list(run))

    def _fold_run(self, device: torch.device, run: list[_Pending]) -> None:
        if self._counts is None or self._counts.device != device:
            self._counts = torch.zeros(len(RESIDUAL_RATIO_BUCKETS) + 1, device=device, dtype=torch.int64)
            self._sum = torch.zeros((), device=device, dtype=torch.float64)
            self._count = torch.zeros((), device=device, dtype=torch.int64)
        assert self._sum is not None and self._count is not None
        ratio_V = run[0][0] if len(run) == 1 else torch.cat([r for r, _ in run])
        # A non-finite ratio is a check that could not be evaluated (its inputs already carried a fault that another
        # op reports, e.g. context computed from scores before their repair): it is left out, so one such check does
        # not turn the interval's sum into NaN (JSON cannot carry it, and the whole histogram would be lost).
        valid_V = torch.isfinite(ratio_V)
        kept_V = torch.where(valid_V, ratio_V, 0.0)
        self._counts.index_add_(0, torch.bucketize(kept_V, _bucket_edges(device)), valid_V.to(torch.int64))
        self._sum += kept_V.double().sum()
        self._count += valid_V.to(torch.int64).sum()
        names = tuple(itertools.chain.from_iterable(
            (None,) * r.numel() if ns is None else ns for r, ns in run))
        ops, index_V = _op_index(names, device)
        if not ops:
            return
        # Ratios are ≥ 0, so a maximum that starts at 0 is the maximum; the last slot takes the unnamed ones.
        top_P = torch.zeros(len(ops) + 1, device=device, dtype=torch.float32).scatter_reduce_(
            0, index_V, kept_V.float(), "amax")
        for i, op in enumerate(ops):
            seen = self._max.get(op)
            self._max[op] = top_P[i] if seen is None else torch.maximum(seen, top_P[i])


@functools.lru_cache(maxsize=16)
def _bucket_edges(device: torch.device) -> torch.Tensor:
    return torch.tensor(RESIDUAL_RATIO_BUCKETS, device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def _op_index(names: tuple[str | None, ...], device: torch.device) -> tuple[tuple[str, ...], torch.Tensor]:
    """(the distinct ops in first-seen order, (V,) int64: each ratio's slot among them, len(ops) for no op). A step
    adds the same ops in the same order as the one before: cached, the index is built and copied to the device once,
    not at every fold. On CUDA from pinned memory, without blocking: a copy from pageable memory would wait for the
    device's queue."""
    ops = tuple(dict.fromkeys(n for n in names if n is not None))
    slot = {op: i for i, op in enumerate(ops)}
    index = torch.tensor([slot.get(n, len(ops)) if n is not None else len(ops) for n in names], dtype=torch.int64,
                         pin_memory=device.type == "cuda")
    return ops, index.to(device, non_blocking=True)


engine_caches.register(_bucket_edges)
engine_caches.register(_op_index)
