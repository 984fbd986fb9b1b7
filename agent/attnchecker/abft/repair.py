"""The slow path: locate and correct flagged vectors, then recompute, then give up (the recovery ladder).

Runs only after the fast path found a flagged vector, so it may sync with the device (each sync is marked).
Works on a copy of the flagged matrices only; the caller's tensor is written once, at the end, per matrix.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .checksum import DirectionCheck, acc_dtype, checksum_weights, checksums_of, spread, vector_sum, verify_direction
from .tolerance import Tolerance

__all__ = ["MatrixReport", "locate_and_fix", "pattern_of", "repair"]

# |d2/d1 - round(d2/d1)| above this: the vector holds more than one error (its weighted mean position is not an
# index), so it is left to the other direction instead of "fixing" a wrong element.
_LOCATE_SLACK = 0.3


@dataclass(slots=True, kw_only=True)
class MatrixReport:
    """The outcome for one flagged matrix (one (batch, head) of scores/context, one batch element of a projection)."""

    index: tuple[int, ...]
    """Index of the matrix in C's leading dims."""
    pattern: str
    row: int | None
    col: int | None
    value: float
    """The offending value as found (before any correction)."""
    residual: float | None
    bound: float
    action: str


def locate_and_fix(
    v_PL: torch.Tensor, ref_P2: torch.Tensor, tol: Tolerance
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EEC-ABFT for P vectors of length L at once: (location (P,), corrected value (P,), fixable (P,) bool).

    Extreme elements (INF, NaN, |x| > near_inf) are located by value; a vector with more than one of them is not
    fixable here. Otherwise the location is d2/d1 - 1, accepted only when it is (nearly) an integer in range.
    Small differences are added back; large ones rebuild the element as checksum minus the healthy elements.
    v_PL and ref_P2 are in the accumulation dtype.
    """
    n = v_PL.shape[-1]
    w_L2 = checksum_weights(n, v_PL.device, v_PL.dtype)
    extreme_PL = ~torch.isfinite(v_PL) | (v_PL.abs() > tol.near_inf)
    n_extreme_P = extreme_PL.sum(-1)
    finite_v_PL = torch.where(extreme_PL, torch.zeros_like(v_PL), v_PL)
    got_P2 = finite_v_PL @ w_L2
    d1_P, d2_P = ref_P2[:, 0] - got_P2[:, 0], ref_P2[:, 1] - got_P2[:, 1]
    pos_P = d2_P / d1_P
    loc_sum_P = pos_P.round() - 1
    located_P = torch.isfinite(pos_P) & ((pos_P - pos_P.round()).abs() <= _LOCATE_SLACK)
    located_P &= (loc_sum_P >= 0) & (loc_sum_P < n)
    # NaN/INF positions (d1 = 0, or INF residuals) become index 0 here and are marked unfixable by `located_P`.
    loc_from_sum_P = torch.nan_to_num(loc_sum_P, nan=0.0, posinf=0.0, neginf=0.0).clamp(0, n - 1).long()
    loc_P = torch.where(n_extreme_P == 1, extreme_PL.to(torch.int8).argmax(-1), loc_from_sum_P)
    fixable_P = torch.isfinite(ref_P2).all(-1) & ((n_extreme_P == 1) | ((n_extreme_P == 0) & located_P))
    old_P = v_PL.gather(-1, loc_P[:, None])[:, 0]
    # Sums exclude extreme elements (finite_v), so "checksum minus the healthy elements" needs no special case.
    healthy_sum_P = got_P2[:, 0] - torch.where(n_extreme_P == 1, torch.zeros_like(old_P), old_P)
    rebuilt_P = ref_P2[:, 0] - healthy_sum_P
    added_P = old_P + d1_P
    use_rebuild_P = (n_extreme_P == 1) | (d1_P.abs() > tol.fix_threshold)
    return loc_P, torch.where(use_rebuild_P, rebuilt_P, added_P), fixable_P


def _recheck(work_MRC: torch.Tensor, refs: dict[str, DirectionCheck]) -> dict[str, DirectionCheck]:
    """Verify C as it stands against the original references, bounds re-evaluated on it."""
    rules = {d: chk.rule for d, chk in refs.items() if chk.rule is not None}
    assert len(rules) == len(refs), "repair() refuses checks without rules"
    use_abs = any(rule.abs_coef for rule in rules.values())
    use_sq = any(rule.var_NV2 is not None and rule.sq_coef != (0.0, 0.0) for rule in rules.values())
    groups = (refs["row"].groups if "row" in refs else 1, refs["col"].groups if "col" in refs else 1)
    rows_MR2, cols_MC2, sums = checksums_of(work_MRC, with_abs=use_abs, with_sq=use_sq, groups=groups)
    got = {"row": rows_MR2, "col": cols_MC2}
    return {d: verify_direction(chk.ref, got[d], rules[d], *(sums.of(d) if sums is not None else (None, None)),
                                groups=chk.groups)
            for d, chk in refs.items()}


def _fix_pass(
    work_MRC: torch.Tensor, direction: str, chk: DirectionCheck, allowed_MV: torch.Tensor, tol: Tolerance
) -> None:
    """Correct each flagged, allowed vector of one direction in place (one element per vector)."""
    g = chk.groups
    vecs_MVn = work_MRC if direction == "row" else work_MRC.transpose(-2, -1)
    length = vecs_MVn.shape[-1] // g
    # Grouped: each vector is one run of `length` elements (a copy for the column direction; written back below).
    vecs_MVL = vecs_MVn if g == 1 else vecs_MVn.reshape(vecs_MVn.shape[0], -1, length)
    todo_MV = chk.bad & allowed_MV
    if not bool(todo_MV.any()):  # sync: slow path only
        return
    m_P, v_P = todo_MV.nonzero(as_tuple=True)  # sync: slow path only
    loc_P, new_P, fixable_P = locate_and_fix(vecs_MVL[m_P, v_P], chk.ref[m_P, v_P], tol)
    keep = fixable_P
    along_P, across_P = (v_P % g) * length + loc_P, v_P // g
    vecs_MVn[m_P[keep], across_P[keep], along_P[keep]] = new_P[keep]


def pattern_of(n_rows: int, n_cols: int) -> str:
    """A fault's pattern from how many rows and columns it touches: 0d one row and one column (or fewer); 1d one row
    (or column) across several of the other; 2d a block."""
    if n_rows >= 2 and n_cols >= 2:
        return "2d"
    return "0d" if n_rows <= 1 and n_cols <= 1 else "1d"


def _classify(rows: list[int], cols: list[int]) -> tuple[str, int | None, int | None]:
    """(pattern_of, its row, its column): a block's top-left element; a line's row (column) alone."""
    nr, nc = len(rows), len(cols)
    pattern = pattern_of(nr, nc)
    if pattern == "2d":
        return pattern, min(rows), min(cols)
    return pattern, rows[0] if nr == 1 else None, cols[0] if nc == 1 else None


def _worst_value(orig_RC: torch.Tensor, region_RC: torch.Tensor) -> float:
    """The offending value: NaN first, then INF, then the largest magnitude in the region."""
    vals = orig_RC[region_RC].double()
    if vals.numel() == 0:
        return math.nan
    for pick in (torch.isnan(vals), torch.isinf(vals)):
        if bool(pick.any()):  # sync: slow path only
            return float(vals[pick][0])  # sync: slow path only
    return float(vals[vals.abs().argmax()])  # sync: slow path only


def _residual(refs: dict[str, DirectionCheck], m: int) -> tuple[float | None, float]:
    """Worst flagged vector of matrix m: (|d1| or None if non-finite, its bound)."""
    best: tuple[float, float | None, float] = (-1.0, None, 0.0)
    for chk in refs.values():
        bad = chk.bad[m]
        if not bool(bad.any()):  # sync: slow path only
            continue
        d1 = chk.diff[m, :, 0][bad].double().abs()
        bound = chk.bound[m][bad].double()
        ratio = torch.where(torch.isfinite(d1), d1 / bound.clamp_min(1e-300), torch.full_like(d1, math.inf))
        i = int(ratio.argmax())  # sync: slow path only
        r = float(ratio[i])  # sync: slow path only
        if r > best[0]:
            d = float(d1[i])  # sync: slow path only
            best = (r, d if math.isfinite(d) else None, float(bound[i]))  # sync: slow path only
    return best[1], best[2]


@torch.no_grad()
def repair(
    c_NRC: torch.Tensor,
    checks: dict[str, DirectionCheck],
    tol: Tolerance,
    *,
    correct: bool,
    recompute: Callable[[], torch.Tensor] | None = None,
    trusted: dict[str, torch.Tensor] | None = None,
    exact: Callable[[tuple[int, ...], torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> list[MatrixReport]:
    """Run the recovery ladder on every matrix of C with a flagged vector; write repaired matrices back into C.

    checks: the fast path's DirectionCheck per direction ("row", "col"), batch dims equal to C's.
    correct: False = detect mode (locate and report, change nothing).
    recompute: recomputes the whole op (with any persistent fault re-injected) for 2D/unlocatable errors.
    trusted: per direction, a bool tensor over C's batch dims (or absent = trusted): is that direction's reference
        clean? Paper-faithful checksum passing builds one direction of a reference from an unverified operand; such a
        direction neither fixes nor vetoes, and the trusted direction alone must end clean.
    Syncs with the device (slow path only).
    """
    if any(chk.rule is None for chk in checks.values()):
        raise ValueError("repair: a check without its bound rule (a native clean verdict) cannot re-verify a repair; "
                         "check the product again with rules (both directions) and repair with those")
    batch_shape = c_NRC.shape[:-2]
    any_N = torch.zeros(batch_shape, dtype=torch.bool, device=c_NRC.device)
    for chk in checks.values():
        any_N = any_N | chk.bad.any(-1)
    idx_MK = any_N.nonzero()  # sync: slow path only
    if idx_MK.shape[0] == 0:
        return []
    idx = tuple(idx_MK.unbind(-1))
    acc = acc_dtype(c_NRC.dtype)
    orig_MRC = c_NRC[idx].detach().clone()
    sub = {d: _select(chk, idx) for d, chk in checks.items()}
    trust = {d: torch.ones(idx_MK.shape[0], dtype=torch.bool, device=c_NRC.device)
             if trusted is None or d not in trusted else trusted[d].expand(batch_shape)[idx] for d in checks}

    work_MRC = orig_MRC.to(acc, copy=True)
    current = sub
    rounded_MRC = orig_MRC
    # Columns first, then rows: a bad row is fixed column by column, a bad column row by row, a cross by both.
    for direction in ("col", "row"):
        if direction in current:
            allowed = trust[direction][:, None].expand_as(current[direction].bad)
            _fix_pass(work_MRC, direction, current[direction], allowed, tol)
            rounded_MRC = work_MRC.to(c_NRC.dtype)
            current = _recheck(rounded_MRC.to(acc), sub)
    ok_M = _accepted(current, trust, (c_NRC.shape[-2], c_NRC.shape[-1]), ~(rounded_MRC == orig_MRC))

    reports: list[MatrixReport] = []
    fresh: torch.Tensor | None = None
    for m, key in enumerate(idx_MK.tolist()):  # sync: slow path only
        bad_rows, bad_cols = (
            sorted({v // sub[d].groups for v in sub[d].bad[m].nonzero()[:, 0].tolist()})  # sync: slow path only
            if d in sub else [] for d in ("row", "col"))
        residual, bound = _residual(sub, m)
        fixed_RC = work_MRC[m].to(c_NRC.dtype)
        changed_RC = ~(fixed_RC == orig_MRC[m])
        if bool(ok_M[m]) and bool(changed_RC.any()):  # sync: slow path only
            rows, cols = (sorted(set(t.tolist())) for t in changed_RC.nonzero(as_tuple=True))  # sync: slow path only
            pattern, row, col = _classify(rows, cols)
            value = _worst_value(orig_MRC[m], changed_RC)
            action = "corrected"
            if correct:
                if exact is not None:
                    rows_P, cols_P = changed_RC.nonzero(as_tuple=True)  # sync: slow path only
                    fixed_RC[rows_P, cols_P] = exact(tuple(key), rows_P, cols_P).to(fixed_RC.dtype)
                c_NRC[tuple(key)] = fixed_RC
        else:
            pattern, row, col = _classify(bad_rows, bad_cols)
            value = _worst_value(orig_MRC[m], _region(orig_MRC[m], bad_rows, bad_cols))
            action = "uncorrectable"
            if correct and recompute is not None:
                if fresh is None:
                    fresh = recompute()
                if _verify_one(fresh[tuple(key)], sub, trust, m):
                    c_NRC[tuple(key)] = fresh[tuple(key)]
                    action = "recomputed"
        if not correct:
            action = "detected"
        reports.append(MatrixReport(index=tuple(key), pattern=pattern, row=row, col=col, value=value,
                                    residual=residual, bound=bound, action=action))
    return reports


def _accepted(
    current: dict[str, DirectionCheck],
    trust: dict[str, torch.Tensor],
    shape_RC: tuple[int, int],
    changed_MRC: torch.Tensor | None = None,
) -> torch.Tensor:
    """(M,) bool: every trusted direction is clean in d1 and d2, and at least one direction is trusted.

    An element rebuilt from a checksum carries that vector's round-off (the other elements' rounding, the
    reference's error: at most the crossing vector's bound), so a vector may also differ by the bounds of the
    crossing vectors at its corrected elements (changed_MRC): without that, a short fp16 row fails its own re-check
    after a long column fixed it.
    """
    extra: dict[str, torch.Tensor | float] = {"row": 0.0, "col": 0.0}
    if changed_MRC is not None and "row" in current and "col" in current:
        row, col = current["row"], current["col"]
        changed = changed_MRC.to(row.bound.dtype)
        extra["row"] = vector_sum(changed * spread(col.bound, "col", col.groups, shape_RC), "row", row.groups)
        extra["col"] = vector_sum(changed * spread(row.bound, "row", row.groups, shape_RC), "col", col.groups)
    ok = None
    any_trusted = None
    for d, chk in current.items():
        n = (shape_RC[1] if d == "row" else shape_RC[0]) // chk.groups
        tol_MV = chk.bound + extra[d]
        d1_ok = ~torch.isfinite(chk.ref[..., 0]) | (chk.diff[..., 0].abs() <= tol_MV)
        # Weights up to n: d2 within its own tolerance (n × the d1 one without it), the crossing vectors' slack
        # weighted by at most n. Catches a wrong fix that zeroed d1 but not d2, and a balanced pattern left in place.
        tol2_MV = n * tol_MV if chk.bound2 is None else chk.bound2 + n * extra[d]
        d2_ok = ~torch.isfinite(chk.ref[..., 1]) | (chk.diff[..., 1].abs() <= tol2_MV)
        clean_M = (d1_ok & d2_ok).all(-1) | ~trust[d]
        ok = clean_M if ok is None else ok & clean_M
        any_trusted = trust[d] if any_trusted is None else any_trusted | trust[d]
    assert ok is not None and any_trusted is not None
    return ok & any_trusted


def _verify_one(c_RC: torch.Tensor, sub: dict[str, DirectionCheck], trust: dict[str, torch.Tensor], m: int) -> bool:
    one = {d: _select(chk, slice(m, m + 1)) for d, chk in sub.items()}
    current = _recheck(c_RC[None].to(acc_dtype(c_RC.dtype)), one)
    trust_one = {d: t[m : m + 1] for d, t in trust.items()}
    return bool(_accepted(current, trust_one, (c_RC.shape[0], c_RC.shape[1]))[0])  # sync: slow path only


def _select(chk: DirectionCheck, idx: Any) -> DirectionCheck:
    """The matrices `idx` of a check (leading dims), the bound rule's base included."""
    return DirectionCheck(ref=chk.ref[idx], diff=chk.diff[idx], bound=chk.bound[idx], bad=chk.bad[idx],
                          rule=None if chk.rule is None else chk.rule.select(idx, chk.bad.shape),
                          bound2=None if chk.bound2 is None else chk.bound2[idx], groups=chk.groups)


def _region(orig_RC: torch.Tensor, bad_rows: list[int], bad_cols: list[int]) -> torch.Tensor:
    """Where the offending value lies: the crossings of flagged rows and columns, else the flagged vectors."""
    r_R = torch.zeros(orig_RC.shape[0], dtype=torch.bool, device=orig_RC.device)
    c_C = torch.zeros(orig_RC.shape[1], dtype=torch.bool, device=orig_RC.device)
    r_R[bad_rows] = True
    c_C[bad_cols] = True
    if bad_rows and bad_cols:
        return r_R[:, None] & c_C[None, :]
    return r_R[:, None] | c_C[None, :]
