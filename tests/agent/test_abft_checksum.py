"""attnchecker.abft on plain batched products C = A·B: encoding, tolerances, locate/correct, the recovery ladder."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import (
    DirectionCheck,
    Tolerance,
    acc_dtype,
    bounds,
    checksum_weights,
    checksums_of,
    locate_and_fix,
    repair,
    verify_direction,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def references(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row refs A (B w) (..., R, 2) and column refs ((wᵀA) B)ᵀ (..., C, 2), accumulated like the engine does."""
    acc = acc_dtype(a.dtype)
    a32, b32 = a.to(acc), b.to(acc)
    w_c = checksum_weights(b.shape[-1], a.device, acc)
    w_r = checksum_weights(a.shape[-2], a.device, acc)
    return a32 @ (b32 @ w_c), (w_r.T @ a32 @ b32).transpose(-2, -1)


def check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tol: Tolerance) -> dict[str, DirectionCheck]:
    acc = acc_dtype(a.dtype)
    row_ref, col_ref = references(a, b)
    use_abs = acc != c.dtype and tol.mode == "roundoff"
    got_rows, got_cols, sums = checksums_of(c, with_abs=use_abs, with_sq=tol.mode == "roundoff" and tol.calibrated)
    a32, b32 = a.to(acc), b.to(acc)
    # ‖B w‖ and ‖wᵀA‖ (..., 2): what the engine passes for the calibrated model's reference terms.
    bw_norm = torch.linalg.vector_norm(b32 @ checksum_weights(b.shape[-1], a.device, acc), dim=-2)
    wa_norm = torch.linalg.vector_norm(checksum_weights(a.shape[-2], a.device, acc).T @ a32, dim=-1)
    row_rule, col_rule = bounds(
        torch.linalg.vector_norm(a32, dim=-1),
        torch.linalg.vector_norm(b32, dim=-2),
        k=a.shape[-1],
        out_dtype=c.dtype,
        tol=tol,
        use_abs=use_abs,
        ref_norms=(bw_norm, wa_norm),
    )
    return {
        "row": verify_direction(row_ref, got_rows, row_rule, *(sums.of("row") if sums else (None, None))),
        "col": verify_direction(col_ref, got_cols, col_rule, *(sums.of("col") if sums else (None, None))),
    }


def n_flagged(checks: dict[str, DirectionCheck]) -> int:
    return int(sum(chk.bad.sum() for chk in checks.values()))


def operands(n: int, r: int, k: int, c: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random operands with per-matrix magnitudes spread over 1e-3..1e3 (fp16: 1e-3..1e1, so that clean products
    stay finite) and a share of heavy-tailed entries."""
    gen = torch.Generator().manual_seed(seed)
    decades = 4 if dtype == torch.float16 else 6
    scale_a = 10 ** (torch.rand(n, 1, 1, generator=gen) * decades - 3)
    scale_b = 10 ** (torch.rand(n, 1, 1, generator=gen) * 2 - 1)
    a = torch.randn(n, r, k, generator=gen) * scale_a
    a = torch.where(torch.rand(n, r, k, generator=gen) < 0.05, a * 30, a)
    b = torch.randn(n, k, c, generator=gen) * scale_b
    return a.to(dtype), b.to(dtype)


def test_checksum_weights_are_ones_and_one_to_n() -> None:
    w = checksum_weights(5, torch.device("cpu"), torch.float32)
    assert w[:, 0].tolist() == [1.0] * 5
    assert w[:, 1].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert checksum_weights(5, torch.device("cpu"), torch.float32) is w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundoff_never_flags_clean_products(dtype: torch.dtype) -> None:
    """Zero false positives over 10,000+ clean products (both directions each) per dtype, odd shapes included."""
    shapes = [(1, 1, 1), (3, 7, 5), (17, 33, 9), (64, 64, 64), (31, 128, 47), (5, 300, 11), (128, 16, 96), (2, 257, 3)]
    products = 0
    for i, (r, k, c) in enumerate(shapes):
        a, b = operands(1300, r, k, c, seed=1000 * i + 7, dtype=dtype)
        checks = check(a, b, a @ b, Tolerance())
        assert n_flagged(checks) == 0, f"{dtype} {(r, k, c)}: {n_flagged(checks)} false positives"
        products += a.shape[0]
    assert products >= 10_000


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundoff_detects_errors_ten_times_the_bound(dtype: torch.dtype) -> None:
    """One error per product, of 10× the smaller of its row and column bounds: flagged (≥ 99 %) at the right place."""
    n, r, k, c = 2000, 19, 40, 23
    a, b = operands(n, r, k, c, seed=11, dtype=dtype)
    clean = a @ b
    gen = torch.Generator().manual_seed(12)
    rows, cols = torch.randint(r, (n,), generator=gen), torch.randint(c, (n,), generator=gen)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    base = check(a, b, clean, Tolerance())
    ar = torch.arange(n)
    size = 11 * torch.minimum(base["row"].bound[ar, rows], base["col"].bound[ar, cols])
    faulty = clean.clone()
    faulty[ar, rows, cols] = (clean[ar, rows, cols].float() + sign * size).to(dtype)
    # Rounding the faulty value to a half type may shrink the error: measure the error actually written.
    written = (faulty[ar, rows, cols].float() - clean[ar, rows, cols].float()).abs()
    eligible = written >= 10 * torch.minimum(base["row"].bound[ar, rows], base["col"].bound[ar, cols])
    checks = check(a, b, faulty, Tolerance())
    hit = checks["row"].bad[ar, rows] | checks["col"].bad[ar, cols]
    assert int(eligible.sum()) > 0.9 * n
    assert float(hit[eligible].float().mean()) >= 0.99
    # Nothing else is flagged.
    other_rows = checks["row"].bad.clone()
    other_rows[ar, rows] = False
    assert not bool(other_rows.any())


def test_extreme_mode_uses_the_absolute_threshold() -> None:
    a, b = operands(4, 6, 8, 5, seed=3, dtype=torch.float32)
    a, b = a / a.abs().amax(), b / b.abs().amax()
    c = a @ b
    small, large = c.clone(), c.clone()
    small[0, 1, 2] += 0.5
    large[0, 1, 2] += 2.0
    tol = Tolerance(mode="extreme")
    assert n_flagged(check(a, b, small, tol)) == 0
    assert n_flagged(check(a, b, large, tol)) == 2
    assert n_flagged(check(a, b, small, Tolerance(mode="extreme", factor=0.1))) == 2


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e20, 7.5])
def test_locate_and_fix_single_element(bad: float) -> None:
    v = randn((3, 11), seed=1, dtype=torch.float64)
    w = checksum_weights(11, v.device, v.dtype)
    ref = v @ w
    faulty = v.clone()
    faulty[:, 4] = bad
    loc, new, ok = locate_and_fix(faulty, ref, Tolerance())
    assert ok.all() and (loc == 4).all()
    torch.testing.assert_close(new, v[:, 4])


def test_locate_and_fix_refuses_two_extreme_elements_and_two_moderate_ones() -> None:
    v = randn((2, 9), seed=2, dtype=torch.float64)
    ref = v @ checksum_weights(9, v.device, v.dtype)
    faulty = v.clone()
    faulty[0, [1, 5]] = math.inf
    # Weighted mean position of the two errors (3·2 + 1·4)/4 = 2.5 is no index. (When it happens to be one, the
    # vector is "fixed" wrongly here and the other direction's re-verification catches it: see repair.)
    faulty[1, 1] -= 3.0
    faulty[1, 3] -= 1.0
    _, _, ok = locate_and_fix(faulty, ref, Tolerance())
    assert not bool(ok[0])
    assert not bool(ok[1])


def test_locate_and_fix_refuses_vectors_it_cannot_locate_without_crashing() -> None:
    """d1 = 0 (d2/d1 is NaN) and d1 = INF with no extreme element (the reference overflowed) are not fixable."""
    v = randn((2, 6), seed=4, dtype=torch.float32)
    ref = v @ checksum_weights(6, v.device, v.dtype)
    ref[0, 1] += 1.0  # d2 ≠ 0, d1 = 0
    ref[1, 0] = math.inf
    loc, _, ok = locate_and_fix(v, ref, Tolerance())
    assert not bool(ok.any())
    assert bool(((loc >= 0) & (loc < 6)).all())


@settings(max_examples=40)
@given(
    n=st.integers(1, 3),
    r=st.integers(2, 37),
    k=st.integers(1, 41),
    c=st.integers(2, 29),
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["inf", "-inf", "nan", "near_inf", "moderate"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_single_error_is_located_and_corrected(n, r, k, c, dtype, kind, seed) -> None:
    a, b = operands(n, r, k, c, seed=seed, dtype=dtype)
    clean = a @ b
    gen = torch.Generator().manual_seed(seed + 1)
    m, i, j = (int(torch.randint(x, (1,), generator=gen)) for x in (n, r, c))
    base = check(a, b, clean, Tolerance())
    big = float(1e4 * max(base["row"].bound[m, i], base["col"].bound[m, j])) + 1.0
    values = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "near_inf": 1e20, "moderate": big}
    faulty = clean.clone()
    faulty[m, i, j] = values[kind]
    if bool(faulty[m, i, j] == clean[m, i, j]):
        return  # a half type rounded the error away
    reports = repair(faulty, check(a, b, faulty, Tolerance()), Tolerance(), correct=True)
    assert len(reports) == 1
    rep = reports[0]
    assert (rep.index, rep.pattern, rep.row, rep.col, rep.action) == ((m,), "0d", i, j, "corrected")
    assert n_flagged(check(a, b, faulty, Tolerance())) == 0
    bound = max(base["row"].bound[m, i], base["col"].bound[m, j])
    assert abs(float(faulty[m, i, j]) - float(clean[m, i, j])) <= 2 * float(bound)


@pytest.mark.parametrize("axis", ["row", "col"])
@pytest.mark.parametrize("value", [math.inf, math.nan, 1e20, -3.0])
def test_whole_row_or_column_is_fixed_by_the_other_direction(axis: str, value: float) -> None:
    a, b = operands(2, 13, 17, 11, seed=5, dtype=torch.float32)
    clean = a @ b
    faulty = clean.clone()
    if axis == "row":
        faulty[1, 4, :] = value
    else:
        faulty[1, :, 6] = value
    reports = repair(faulty, check(a, b, faulty, Tolerance()), Tolerance(), correct=True)
    assert [(r.pattern, r.action) for r in reports] == [("1d", "corrected")]
    assert (reports[0].row, reports[0].col) == ((4, None) if axis == "row" else (None, 6))
    torch.testing.assert_close(faulty, clean, rtol=1e-4, atol=1e-4 * float(clean.abs().amax()))


def test_block_is_recomputed_or_else_uncorrectable() -> None:
    a, b = operands(2, 9, 12, 10, seed=6, dtype=torch.float32)
    clean = a @ b
    faulty = clean.clone()
    faulty[0, 2:5, 3:6] = math.inf
    kept = faulty.clone()
    no_recompute = repair(kept, check(a, b, kept, Tolerance()), Tolerance(), correct=True)
    assert [(r.pattern, r.action) for r in no_recompute] == [("2d", "uncorrectable")]
    assert torch.equal(kept.isinf(), faulty.isinf()), "an uncorrectable matrix is left as found, never half-fixed"
    recomputed = repair(faulty, check(a, b, faulty, Tolerance()), Tolerance(), correct=True, recompute=lambda: a @ b)
    assert [(r.pattern, r.action, r.row, r.col) for r in recomputed] == [("2d", "recomputed", 2, 3)]
    assert torch.equal(faulty, clean)

    def persistent() -> torch.Tensor:
        again = a @ b
        again[0, 2:5, 3:6] = math.inf
        return again

    still = clean.clone()
    still[0, 2:5, 3:6] = math.inf
    reports = repair(still, check(a, b, still, Tolerance()), Tolerance(), correct=True, recompute=persistent)
    assert [r.action for r in reports] == ["uncorrectable"]


def test_detect_mode_reports_and_changes_nothing() -> None:
    a, b = operands(3, 8, 8, 8, seed=8, dtype=torch.float32)
    faulty = a @ b
    faulty[2, 1, 7] = math.nan
    before = faulty.clone()
    reports = repair(faulty, check(a, b, faulty, Tolerance()), Tolerance(), correct=False)
    assert [(r.index, r.row, r.col, r.action) for r in reports] == [((2,), 1, 7, "detected")]
    assert math.isnan(reports[0].value) and reports[0].residual is None
    assert torch.equal(faulty.isnan(), before.isnan()) and torch.equal(faulty.nan_to_num(), before.nan_to_num())


def test_non_finite_reference_is_an_input_fault_not_flagged() -> None:
    a, b = operands(1, 4, 5, 6, seed=9, dtype=torch.float32)
    a[0, 2, 1] = math.inf  # a corrupt input: every reference through row 2 is non-finite
    checks = check(a, b, a @ b, Tolerance())
    assert not bool(checks["row"].bad.any())


LAYOUTS = ("contiguous", "transposed", "heads", "column_slice")


def _laid_out(layout: str, lead: tuple[int, ...], r: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """An (..., R, K) operand with the given memory layout: contiguous; a transposed view (dYᵀ, Pᵀ, Kᵀ); heads split
    out of a projection ((B, T, H, D) viewed as (B, H, T, D)); a column slice of a wider matrix (a fused qkv)."""
    if layout == "contiguous":
        return randn((*lead, r, k), seed, dtype)
    if layout == "transposed":
        return randn((*lead, k, r), seed, dtype).mT
    if layout == "heads":
        return randn((*lead, r, 3, k), seed, dtype).transpose(-3, -2)[..., 1, :, :]
    return randn((*lead, r, 3 * k), seed, dtype)[..., k : 2 * k]


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    lead=st.sampled_from([(), (2,), (2, 3)]),
    r=st.integers(1, 40),
    k=st.integers(1, 40),
    c=st.sampled_from([1, 2, 3, 8, 12]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_weighted_rows_and_times_skinny_equal_the_plain_product_in_every_layout(
    layout: str, lead: tuple[int, ...], r: int, k: int, c: int, dtype: torch.dtype, seed: int
) -> None:
    """The fast paths (column-major weights, transposed views through their contiguous layout) compute A w and A M,
    whatever A's layout: within the summation round-off of the plain product in fp64."""
    from attnchecker.abft import times_skinny, weighted_rows

    a = _laid_out(layout, lead, r, k, seed, dtype)
    m = randn((*lead, k, c), seed + 1, dtype)
    w = checksum_weights(k, a.device, torch.float64)
    u = torch.finfo(dtype).eps
    for got, want, scale in (
        (weighted_rows(a), a.double() @ w, a.double().abs() @ w),
        (times_skinny(a, m), a.double() @ m.double(), a.double().abs() @ m.double().abs()),
    ):
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.all((got.double() - want).abs() <= 2 * k * u * scale + 1e-30)
