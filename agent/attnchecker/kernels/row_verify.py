"""The clean row check's verdict in one native call (issue 17): bounds, residuals and flags of every row vector of an
fp32 product, evaluated by ``row_verify.c`` from the factored rule (``abft.tolerance.row_rule``).

A clean check by rows reads its matrices once each (fused_pass) and is then left with vectors: per row of C, its
checksums and square sum, the reference and the operand norms. Eagerly, the bound on them (`direction_bounds`,
`Bound.pair`, `verify_direction`) is some fifty small tensor ops, a fixed cost of about 2.5 ms a check on this
machine's CPU: a projection check at GPT-2 width took 6.4 ms so, 3.7 ms with this one call over the vectors
(docs/performance.md §1).

Where the kernel is not built, the tensors are not fp32 on the CPU, or ``ATTNCHECKER_NATIVE=0``, ``verify_rows``
returns None and the caller verifies eagerly (the same rule, the same verdicts: tests/agent/test_row_verify.py).
The check it returns carries no rule (``DirectionCheck.rule`` None): a flagged product is checked again in both
directions, with rules, by the slow path that repairs it (projection.check_linear, gemm.check.check_gemms).

Legend: N matrices, R rows, g checksum groups per row, V = R·g row vectors. No host-device sync (CPU tensors only).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from ..abft.checksum import DirectionCheck
from ..abft.tolerance import RowRule
from . import build

__all__ = ["available", "verify_rows"]

enabled = True
"""False: ``verify_rows`` declines every call (bench/overhead.py prices the kernel side by side)."""
_SOURCE = build.source("row_verify.c")
_CALIBRATED = 4
"""Index in RowRule.scalars of the flag of the calibrated part (row_verify.c's S_CALIBRATED)."""
_TERMS = 18
"""Doubles of scratch per checksum group (row_verify.c's C_COUNT)."""


def available() -> bool:
    """Whether the kernel is built and loaded (building it now if it is not yet)."""
    return _kernel() is not None


def verify_rows(
    rule: RowRule,
    ref_NV2: torch.Tensor,
    got_NV2: torch.Tensor,
    sq_NV: torch.Tensor | None,
    a_norm_NR: torch.Tensor,
    *,
    a_max_NR: torch.Tensor | None = None,
    moments_NV4: torch.Tensor | None = None,
) -> DirectionCheck | None:
    """The row direction's check of C = A·B: ref_NV2 the reference checksums, got_NV2 C's, sq_NV C's sum of squares
    per vector (None: a rule without the calibrated part does not read it), a_norm_NR ‖A_i‖₂ (not floored); for a
    rule with the random-walk model, a_max_NR ‖A_i‖∞ and, where made, moments_NV4 (tolerance.direction_bounds).
    Returns ``verify_direction``'s check without its rule, with its worst clean ratio and flag made in the same
    loop (``DirectionCheck.worst``, ``.flagged``), or None where the kernel cannot take these tensors (the
    caller verifies eagerly)."""
    kernel = _kernel()
    if kernel is None or not enabled:
        return None
    vectors = (ref_NV2, got_NV2, sq_NV, a_norm_NR, a_max_NR, moments_NV4)
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in vectors):
        return None
    lead, v = ref_NV2.shape[:-2], ref_NV2.shape[-2]
    rows, g = a_norm_NR.shape[-1], rule.groups
    calibrated = rule.scalars[_CALIBRATED] != 0.0
    if (rows * g != v or got_NV2.shape != ref_NV2.shape
            or (sq_NV.shape != ref_NV2.shape[:-1] if sq_NV is not None else calibrated)
            or a_norm_NR.shape[:-1] != lead or (a_max_NR is not None and a_max_NR.shape != a_norm_NR.shape)
            or (moments_NV4 is not None and moments_NV4.shape != (*lead, v, 4))
            or (rule.walk and a_max_NR is None)):
        return None
    ref, got, a = (t.detach().contiguous() for t in (ref_NV2, got_NV2, a_norm_NR))
    sq = None if sq_NV is None or not calibrated else sq_NV.detach().contiguous()
    amax = None if a_max_NR is None else a_max_NR.detach().contiguous()
    mom = None if moments_NV4 is None else moments_NV4.detach().contiguous()
    other = [None if t is None else t.detach().contiguous() for t in
             (rule.b_norm_gn, rule.bias_abs_gn, rule.ref_norm_g2, rule.b_max_gn, rule.ref_max_g2)]
    g_n, g_2 = rule.b_norm_gn.shape, (g, 2)
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != shape)
           for t, shape in zip(other, (g_n, g_n, g_2, g_n, g_2), strict=True)):
        return None
    diff = torch.empty_like(ref)
    bound, bound2 = torch.empty(ref.shape[:-1]), torch.empty(ref.shape[:-1])
    bad = torch.empty(ref.shape[:-1], dtype=torch.bool)
    terms = torch.empty(g, _TERMS, dtype=torch.float64)
    worst, flagged = torch.empty(()), torch.empty((), dtype=torch.bool)
    p = build.ptr
    kernel(a.numel() // rows if rows else 0, rows, g, p(ref), p(got), p(sq), p(a), p(amax), p(mom), *map(p, other),
           (ctypes.c_double * len(rule.scalars))(*rule.scalars), p(terms), p(diff), p(bound), p(bound2), p(bad),
           p(worst), p(flagged))
    return DirectionCheck(ref=ref_NV2, diff=diff, bound=bound, bad=bad, rule=None, bound2=bound2, groups=g,
                          worst=worst, flagged=flagged)


@functools.lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The kernel's entry point, built and loaded once per process; None (logged once) where it cannot be."""
    fn = build.load(_SOURCE, "attnchecker_verify_rows", "clean row checks evaluate their bound eagerly")
    if fn is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.restype = None
    fn.argtypes = [i64, i64, i64, *[ptr] * 19]
    return fn
