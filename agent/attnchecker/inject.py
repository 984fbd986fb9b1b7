"""Seeded, deterministic fault injection into the output of the protected ops (q, k, v, scores, context, out).

The engine calls ``Injector.apply`` on every op output right after computing it, with protection on or off, so one
plan shows what the same faults do protected and unprotected. Each fault draws its location from its own seeded
``torch.Generator`` (never the global RNG), so a persistent fault hits the same elements every time.
``Injector.injected`` is the ground truth (what was hit, where, the original value) to compare with detections.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .policy import OPS, WHOLE_STEP_OPS

__all__ = ["FAULT_KINDS", "FAULT_PATTERNS", "INJECTABLE_OPS", "Fault", "FaultPlan", "Injected", "Injector", "WindowHit",
           "bitflip", "kernel_write", "record_kernel_hits"]

FAULT_KINDS = ("inf", "neg_inf", "nan", "near_inf", "bitflip", "add")
"""add: a finite error of `value` added to the element (an ordinary silent error)."""
FAULT_PATTERNS = ("0d", "1d", "2d")
DEFAULT_NEAR_INF = 1e20
INJECTABLE_OPS: tuple[str, ...] = (*OPS, *WHOLE_STEP_OPS)
"""The ops a fault can name: the six attention ops and, under protect(scope="all"), a Linear/Conv1D GEMM's output, input
gradient and weight gradient ("linear", "linear_dx", "linear_dw") and the attention backward's products: "scores_bwd"
S = Q·Kᵀ again and "grad_probs" dP = dO·Vᵀ (B, H, T, S), "grad_q" dQ (B, H, T, D) before its scale, "grad_v" dV and
"grad_k" dK (B, KV heads where the backward takes K and V unexpanded, else H, S, D). Where those products run in a
fused kernel that keeps them to itself (the CPU's, SDPA's, a vendor's), a layer and step with such a fault due runs
its backward in products the fault reaches instead: the checked PyTorch products, or the Triton kernels, which write
it in their tiles (S and dP in the pass that makes dK and dV; a gradient's fault in the first tile's share of its
sum). FlexAttention's backward and a varlen call's with a sliding window (attention/backward/modded.py) are not
among the checked ones: a fault planned there does not fire. Nor does a "scores_bwd" fault in the unfused backward
(a CPU call with attention dropout: attention/backward/unfused.py), which reuses the forward's AS."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One planned fault: which op output, where, what. Unset location fields are drawn from the fault's seed."""

    op: str
    layer: int
    step: int
    kind: str = "inf"
    pattern: str = "0d"
    batch: int | None = None
    head: int | None = None
    row: int | None = None
    col: int | None = None
    axis: str | None = None
    """1d only: "row" or "col" (None: drawn)."""
    block: tuple[int, int] = (2, 2)
    """2d only: block size (rows, cols), clipped to the matrix."""
    value: float | None = None
    """near_inf: the value written (default 1e20); add: the error added (default 1.0)."""
    persistent: bool = False
    """The fault reappears every time the op is computed at this layer and step, recompute included."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.op not in INJECTABLE_OPS:
            raise ValueError(f"fault.op must be one of {INJECTABLE_OPS}, got {self.op!r}")
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.pattern not in FAULT_PATTERNS:
            raise ValueError(f"fault.pattern must be one of {FAULT_PATTERNS}, got {self.pattern!r}")
        if self.axis not in (None, "row", "col"):
            raise ValueError(f"fault.axis must be 'row', 'col' or None, got {self.axis!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Injected:
    """Ground truth of one injection."""

    fault: Fault
    op: str
    layer: int
    step: int
    kind: str
    pattern: str
    batch: int | None
    head: int | None
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    original: float
    """The first hit element's value before the fault."""
    value: float
    """What it became."""
    attempt: int
    """0 the first computation of the op, 1 a recompute (persistent faults only)."""

    @property
    def row(self) -> int | None:
        return self.rows[0] if len(self.rows) == 1 else None

    @property
    def col(self) -> int | None:
        return self.cols[0] if len(self.cols) == 1 else None


@dataclass(slots=True)
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    @classmethod
    def random(
        cls,
        *,
        steps: int | Iterable[int],
        layers: int | Iterable[int],
        ops: Sequence[str] = OPS,
        kinds: Sequence[str] = ("inf", "neg_inf", "nan", "near_inf", "bitflip"),
        patterns: Sequence[str] = ("0d",),
        rate: float | None = None,
        per_step: int | None = None,
        persistent: bool = False,
        seed: int = 0,
    ) -> FaultPlan:
        """A reproducible plan: `rate` = probability per (step, layer, op), or exactly `per_step` faults per step."""
        if (rate is None) == (per_step is None):
            raise ValueError("FaultPlan.random needs exactly one of rate= or per_step=")
        rng = random.Random(seed)
        step_list = list(range(steps)) if isinstance(steps, int) else list(steps)
        layer_list = list(range(layers)) if isinstance(layers, int) else list(layers)
        slots = [(layer, op) for layer in layer_list for op in ops]
        faults = []
        for step in step_list:
            if per_step is not None:
                chosen = [rng.choice(slots) for _ in range(per_step)]
            else:
                chosen = [slot for slot in slots if rng.random() < rate]  # type: ignore[operator]
            for layer, op in chosen:
                faults.append(Fault(op=op, layer=layer, step=step, kind=rng.choice(list(kinds)),
                                    pattern=rng.choice(list(patterns)), persistent=persistent,
                                    seed=rng.randrange(2**31)))
        return cls(faults)


def bitflip(v: torch.Tensor) -> torch.Tensor:
    """Flip one exponent bit, as ATTNChecker's injection kernel: the highest if |v| < 2, else the next one.
    fp32 bits 30/29; bf16 and fp16 bits 14/13."""
    if v.dtype == torch.float32:
        ints, high = v.view(torch.int32), 30
    elif v.dtype in (torch.float16, torch.bfloat16):
        ints, high = v.view(torch.int16), 14
    else:
        raise ValueError(f"bitflip supports float32, bfloat16 and float16, not {v.dtype}")
    one = torch.ones((), dtype=ints.dtype, device=v.device)
    shift = torch.where(v.abs() < 2, high, high - 1).to(ints.dtype)
    return (ints ^ (one << shift)).view(v.dtype)


class Injector:
    """Applies a FaultPlan; each transient fault fires once, a persistent one on every computation of its op."""

    def __init__(self, plan: FaultPlan | Sequence[Fault]) -> None:
        faults = plan.faults if isinstance(plan, FaultPlan) else list(plan)
        self._by_slot: dict[tuple[str, int, int], list[tuple[int, Fault]]] = {}
        for i, fault in enumerate(faults):
            self._by_slot.setdefault((fault.op, fault.layer, fault.step), []).append((i, fault))
        self._fired: set[int] = set()
        self.injected: list[Injected] = []

    def apply(self, out: torch.Tensor, *, op: str, layer: int, step: int, attempt: int = 0) -> None:
        """Corrupt `out` (..., R, C) in place for every fault planned at (op, layer, step). Host-only dict lookup
        when nothing is planned; an injection itself syncs (it records the original value)."""
        planned = self._by_slot.get((op, layer, step))
        if not planned:
            return
        for i, fault in planned:
            if i in self._fired and not fault.persistent:
                continue
            self._fired.add(i)
            with torch.no_grad():
                self.injected.append(_inject_one(out, fault, attempt))


    def fires(self, *, op: str, layer: int, step: int) -> bool:
        """Whether a fault would fire on the next computation of (op, layer, step); nothing is consumed."""
        return any(i not in self._fired or fault.persistent for i, fault in self._by_slot.get((op, layer, step), ()))

    def resolve(
        self, *, op: str, layer: int, step: int, shape: Sequence[int], attempt: int = 0
    ) -> list[WindowHit]:
        """For an op computed in tiles (the tiled attention): the faults that fire on this computation of the op,
        located on its whole (..., R, C) shape as ``apply`` would, to be written tile by tile with
        :meth:`WindowHit.apply`. Firing follows ``apply``: a transient fault fires once, a persistent one on every
        computation."""
        planned = self._by_slot.get((op, layer, step))
        if not planned:
            return []
        hits = []
        for i, fault in planned:
            if i in self._fired and not fault.persistent:
                continue
            self._fired.add(i)
            lead, rows, cols = _locate(tuple(shape), fault)
            hits.append(WindowHit(fault=fault, lead=lead, rows=rows, cols=cols, attempt=attempt, sink=self.injected))
        return hits


@dataclass(slots=True, kw_only=True)
class WindowHit:
    """One resolved fault of an op computed in tiles: its elements in whole-matrix coordinates."""

    fault: Fault
    lead: list[int]
    rows: list[int]
    cols: list[int]
    attempt: int
    sink: list[Injected]
    recorded: bool = False

    def apply(self, tile: torch.Tensor, r0: int, c0: int) -> None:
        """Corrupt the part of the fault inside the tile whose top-left element is (r0, c0) of the whole matrix. The
        ground truth is recorded once, at the tile holding the fault's first element."""
        n_rows, n_cols = tile.shape[-2:]
        rows = [r - r0 for r in self.rows if r0 <= r < r0 + n_rows]
        cols = [c - c0 for c in self.cols if c0 <= c < c0 + n_cols]
        if not rows or not cols:
            return
        with torch.no_grad():
            index: tuple[Any, ...] = (*self.lead, torch.tensor(rows, device=tile.device)[:, None],
                                      torch.tensor(cols, device=tile.device)[None, :])
            before = tile[index].clone()
            tile[index] = _corrupt(before, self.fault)
            first = (self.rows[0] - r0, self.cols[0] - c0)
            if not self.recorded and first == (rows[0], cols[0]):
                self.recorded = True
                f = self.fault
                self.sink.append(Injected(
                    fault=f, op=f.op, layer=f.layer, step=f.step, kind=f.kind, pattern=f.pattern,
                    batch=self.lead[0] if self.lead else None, head=self.lead[1] if len(self.lead) > 1 else None,
                    rows=tuple(self.rows), cols=tuple(self.cols),
                    original=float(before.flatten()[0]),  # sync: injection only, never on a fault-free call
                    value=float(tile[index].flatten()[0]),  # sync: injection only
                    attempt=self.attempt,
                ))


def kernel_write(fault: Fault) -> tuple[str, float]:
    """What a kernel that emulates the fault in its own tiles writes (as ``_corrupt``): ("value", v), the element
    becomes v; ("add", v), v is added; ("bitflip", 0.0), an exponent bit flips (``bitflip``, on the fp32 value)."""
    if fault.kind in ("inf", "neg_inf", "nan"):
        return "value", {"inf": math.inf, "neg_inf": -math.inf, "nan": math.nan}[fault.kind]
    if fault.kind == "near_inf":
        return "value", DEFAULT_NEAR_INF if fault.value is None else fault.value
    if fault.kind == "add":
        return "add", 1.0 if fault.value is None else fault.value
    return "bitflip", 0.0


def record_kernel_hits(hits: Sequence[WindowHit], seen: Sequence[Sequence[Sequence[float]]]) -> None:
    """The ground truth of faults a kernel wrote in its own tiles, as ``WindowHit.apply`` records it: once per fault
    and computation (0 the first, 1 the repair's recompute), where the kernel wrote the fault's first element. seen:
    (applied, value before, value after) per attempt for each element of the hits in order, one element after
    another (a kernel's fault table, one row per element); a tile the kernel skipped holds none."""
    for attempt in (0, 1):
        first = 0
        for hit in hits:
            applied, before, after = seen[first][attempt]
            if applied:
                f = hit.fault
                hit.sink.append(Injected(
                    fault=f, op=f.op, layer=f.layer, step=f.step, kind=f.kind, pattern=f.pattern,
                    batch=hit.lead[0] if hit.lead else None, head=hit.lead[1] if len(hit.lead) > 1 else None,
                    rows=tuple(hit.rows), cols=tuple(hit.cols), original=before, value=after, attempt=attempt))
            first += len(hit.rows) * len(hit.cols)


def _draw(gen: torch.Generator, n: int) -> int:
    return int(torch.randint(n, (1,), generator=gen))


def _locate(shape: tuple[int, ...], fault: Fault) -> tuple[list[int], list[int], list[int]]:
    """(leading index, rows, cols) the fault hits in a tensor of this shape, drawn from the fault's seed."""
    if len(shape) < 2:
        raise ValueError(f"cannot inject into a tensor of shape {shape}")
    gen = torch.Generator().manual_seed(fault.seed)
    lead_shape, (n_rows, n_cols) = shape[:-2], shape[-2:]
    lead = [_draw(gen, n) for n in lead_shape]
    if lead and fault.batch is not None:
        lead[0] = fault.batch
    if len(lead) > 1 and fault.head is not None:
        lead[1] = fault.head
    row = fault.row if fault.row is not None else _draw(gen, n_rows)
    col = fault.col if fault.col is not None else _draw(gen, n_cols)
    if fault.pattern == "0d":
        rows, cols = [row], [col]
    elif fault.pattern == "1d":
        axis = fault.axis or ("row", "col")[_draw(gen, 2)]
        rows, cols = ([row], list(range(n_cols))) if axis == "row" else (list(range(n_rows)), [col])
    else:
        bh, bw = min(fault.block[0], n_rows), min(fault.block[1], n_cols)
        r0, c0 = min(row, n_rows - bh), min(col, n_cols - bw)
        rows, cols = list(range(r0, r0 + bh)), list(range(c0, c0 + bw))
    return lead, rows, cols


def _inject_one(out: torch.Tensor, fault: Fault, attempt: int) -> Injected:
    lead, rows, cols = _locate(tuple(out.shape), fault)
    rows_t = torch.tensor(rows, device=out.device)[:, None]
    cols_t = torch.tensor(cols, device=out.device)[None, :]
    index: tuple[Any, ...] = (*lead, rows_t, cols_t)
    before = out[index].clone()
    out[index] = _corrupt(before, fault)
    return Injected(
        fault=fault, op=fault.op, layer=fault.layer, step=fault.step, kind=fault.kind, pattern=fault.pattern,
        batch=lead[0] if lead else None, head=lead[1] if len(lead) > 1 else None, rows=tuple(rows), cols=tuple(cols),
        original=float(before.flatten()[0]),  # sync: injection only, never on a fault-free call
        value=float(out[index].flatten()[0]),  # sync: injection only
        attempt=attempt,
    )


def _corrupt(v: torch.Tensor, fault: Fault) -> torch.Tensor:
    if fault.kind == "inf":
        return torch.full_like(v, float("inf"))
    if fault.kind == "neg_inf":
        return torch.full_like(v, float("-inf"))
    if fault.kind == "nan":
        return torch.full_like(v, float("nan"))
    if fault.kind == "near_inf":
        # Built in fp32 and cast: 1e20 overflows fp16 to INF, which is what that hardware would hold.
        value = DEFAULT_NEAR_INF if fault.value is None else fault.value
        return torch.full(v.shape, value, dtype=torch.float32, device=v.device).to(v.dtype)
    if fault.kind == "add":
        return v + (1.0 if fault.value is None else fault.value)
    return bitflip(v)
