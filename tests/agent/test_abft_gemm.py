"""attnchecker.abft.gemm: one GEMM C = A·B (+ bias) verified against references from its operands, repaired in place
(the math under whole-step protection: Linear forward, dX = dY·W, dW = dYᵀ·X)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance, checksum_weights, repair
from attnchecker.abft.gemm import OperandSums, exact_gemm_elements, verify_gemm

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return a @ b if bias is None else torch.addmm(bias, a, b)


def flagged(checks: dict) -> int:
    return int(sum(int(chk.bad.sum()) for chk in checks.values()))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       with_bias=st.booleans(), transposed=st.booleans(), seed=st.integers(0, 10_000),
       directions=st.sampled_from([("row", "col"), ("row",), ("col",)]))
def test_clean_gemms_are_never_flagged(m: int, k: int, n: int, dtype: torch.dtype, with_bias: bool,
                                       transposed: bool, seed: int, directions: tuple[str, ...]) -> None:
    # transposed: A is a strided view (dYᵀ in the weight gradient), as the backward check passes it.
    a = randn((k, m), seed, dtype).T if transposed else randn((m, k), seed, dtype)
    b = randn((k, n), seed + 1, dtype)
    bias = randn((n,), seed + 2, dtype) if with_bias else None
    c = product(a, b, bias)
    checks = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=directions)
    assert set(checks) == set(directions)
    assert flagged(checks) == 0


@settings(max_examples=40, deadline=None)
@given(m=st.integers(2, 40), k=st.integers(2, 70), n=st.integers(2, 40), dtype=st.sampled_from(DTYPES),
       with_bias=st.booleans(), kind=st.sampled_from(["inf", "nan", "near_inf", "add"]), seed=st.integers(0, 10_000))
def test_single_fault_is_located_and_corrected_to_the_clean_product(
    m: int, k: int, n: int, dtype: torch.dtype, with_bias: bool, kind: str, seed: int
) -> None:
    a, b = randn((m, k), seed, dtype), randn((k, n), seed + 1, dtype)
    bias = randn((n,), seed + 2, dtype) if with_bias else None
    clean = product(a, b, bias)
    c = clean.clone()
    g = torch.Generator().manual_seed(seed)
    i, j = int(torch.randint(m, (1,), generator=g)), int(torch.randint(n, (1,), generator=g))
    # "add": a finite silent error far above round-off (1000x the element scale).
    c[i, j] = {"inf": math.inf, "nan": math.nan, "near_inf": 3e20 if dtype != torch.float16 else 6e4}.get(
        kind, float(c[i, j]) + 1000.0 * math.sqrt(k))
    checks = verify_gemm(c, a, b, Tolerance(), bias_N=bias)
    assert flagged(checks) > 0
    # Either direction alone (the fast path's) flags it too, at the same vector as the full check.
    for d in ("row", "col"):
        one = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=(d,))
        assert torch.equal(one[d].bad, checks[d].bad)
    reports = repair(c[None], checks, Tolerance(), correct=True, recompute=lambda: product(a, b, bias)[None],
                     exact=lambda key, r, cc: exact_gemm_elements(a, b, r, cc, bias))
    assert [r.action for r in reports] in (["corrected"], ["recomputed"])
    assert (reports[0].row, reports[0].col) in ((i, j), (None, None))
    # The repaired element is its dot product recomputed in the accumulation dtype: equal to the GEMM's own value up
    # to the summation order (a few ulps of the output dtype, relative to the operand scale).
    scale = float(a.float().norm(dim=-1).max() * b.float().norm(dim=0).max()) + 1.0
    ulp = torch.finfo(dtype).eps
    assert torch.isfinite(c).all()
    assert (c.float() - clean.float()).abs().max() <= 4 * ulp * scale


def test_detect_mode_reports_and_leaves_the_product_alone() -> None:
    a, b = randn((8, 16), 0, torch.float32), randn((16, 12), 1, torch.float32)
    c = a @ b
    c[3, 5] = math.inf
    before = c.clone()
    reports = repair(c[None], verify_gemm(c, a, b, Tolerance()), Tolerance(), correct=False)
    assert [(r.action, r.row, r.col) for r in reports] == [("detected", 3, 5)]
    assert torch.equal(c.isinf(), before.isinf())


def test_a_block_fault_is_recomputed() -> None:
    a, b = randn((8, 16), 0, torch.float32), randn((16, 12), 1, torch.float32)
    clean = a @ b
    c = clean.clone()
    c[2:4, 3:6] = math.nan
    reports = repair(c[None], verify_gemm(c, a, b, Tolerance()), Tolerance(), correct=True,
                     recompute=lambda: (a @ b)[None])
    assert [(r.action, r.pattern) for r in reports] == [("recomputed", "2d")]
    assert torch.equal(c, clean)


def test_shapes_that_do_not_form_a_product_are_refused() -> None:
    a, b = torch.ones(4, 5), torch.ones(5, 6)
    with pytest.raises(ValueError, match="do not form C = A·B"):
        verify_gemm(torch.ones(4, 7), a, b, Tolerance())
    with pytest.raises(ValueError, match="2-D operands"):
        verify_gemm(torch.ones(1, 4, 6), a, b, Tolerance())
    with pytest.raises(ValueError, match="do not form C = A·B"):
        verify_gemm(torch.ones(2, 4, 6), torch.ones(3, 4, 5), torch.ones(2, 5, 6), Tolerance())
    with pytest.raises(ValueError, match="bias goes with a 2-D product"):
        verify_gemm(torch.ones(2, 4, 6), torch.ones(2, 4, 5), torch.ones(2, 5, 6), Tolerance(), bias_N=torch.ones(6))
    with pytest.raises(ValueError, match="directions must be"):
        verify_gemm(torch.ones(4, 6), a, torch.ones(5, 6), Tolerance(), directions=("diagonal",))


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), m=st.integers(2, 24), k=st.integers(2, 24),
       n=st.integers(2, 24), dtype=st.sampled_from(DTYPES), kind=st.sampled_from(["inf", "nan", "clean"]),
       seed=st.integers(0, 10_000))
def test_batched_products_are_verified_and_repaired_per_matrix(batch: int, heads: int, m: int, k: int, n: int,
                                                               dtype: torch.dtype, kind: str, seed: int) -> None:
    """(B, H) batches, as the attention backward products are checked; A a transposed view (Pᵀ, dSᵀ)."""
    a = randn((batch, heads, k, m), seed, dtype).mT
    b = randn((batch, heads, k, n), seed + 1, dtype)
    clean = a @ b
    c = clean.clone()
    if kind != "clean":
        c[batch - 1, heads - 1, m // 2, n // 3] = math.inf if kind == "inf" else math.nan
    checks = verify_gemm(c, a, b, Tolerance())
    assert flagged(checks) == (0 if kind == "clean" else 2)
    reports = repair(c, checks, Tolerance(), correct=True, recompute=lambda: a @ b,
                     exact=lambda key, r, cc: exact_gemm_elements(a[key], b[key], r, cc))
    assert [(r.index, r.action) for r in reports] == ([] if kind == "clean" else
                                                      [((batch - 1, heads - 1), "corrected")])
    scale = float(a.float().norm(dim=-1).max() * b.float().norm(dim=-2).max()) + 1.0
    assert (c.float() - clean.float()).abs().max() <= 4 * torch.finfo(dtype).eps * scale


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 700), cols=st.sampled_from([1, 3, 512, 1500]), seed=st.integers(0, 10_000),
       transposed=st.booleans())
def test_column_norms_and_skinny_products_match_their_plain_forms(rows: int, cols: int, seed: int,
                                                                   transposed: bool) -> None:
    """col_norms reduces a block of rows at a time on CPU and times_skinny takes a transposed view through its
    contiguous layout: the same values as the one-op forms (to fp32 round-off), whatever the shape or layout."""
    from attnchecker.abft import col_norms, times_skinny

    a = randn((cols, rows), seed, torch.float32).T if transposed else randn((rows, cols), seed, torch.float32)
    torch.testing.assert_close(col_norms(a), torch.linalg.vector_norm(a.double(), dim=0).float(), rtol=1e-5, atol=0)
    m = randn((cols, 2), seed + 1, torch.float32)
    torch.testing.assert_close(times_skinny(a, m), (a.double() @ m.double()).float(), rtol=1e-4, atol=1e-4)
    batch = torch.stack([a, 2 * a, -a])  # (3, rows, cols): blocked along the rows of every matrix at once
    torch.testing.assert_close(col_norms(batch), torch.linalg.vector_norm(batch.double(), dim=-2).float(), rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_checks_carry_the_bound_on_d2(lead: tuple[int, ...]) -> None:
    """d2 flags too (a pattern balanced for the plain sum), so its bound travels with the check: the margin histogram
    takes the larger of |d1|/bound and |d2|/bound2 (records._worst_ratio), for a 2-D product as for a batch."""
    a, b = randn((*lead, 5, 7), 0, torch.float32), randn((*lead, 7, 4), 1, torch.float32)
    for directions in (("row",), ("row", "col")):
        for d, chk in verify_gemm(a @ b, a, b, Tolerance(), directions=directions).items():
            assert chk.bound2 is not None and chk.bound2.shape == chk.bound.shape, d
            assert (chk.bound2 > chk.bound).all()


def _operand_side(a: torch.Tensor, b: torch.Tensor, direction: str) -> OperandSums:
    """What a caller that read A and B itself passes (gemm.check.linear_sums makes these in its kernel reads)."""
    a32, b32 = a.float(), b.float()
    if direction == "row":
        v_K2 = b32 @ checksum_weights(b.shape[-1], b.device, torch.float32)
        ref = a32 @ v_K2
    else:
        v_K2 = (checksum_weights(a.shape[-2], a.device, torch.float32).mT @ a32).mT
        ref = (v_K2.mT @ b32).mT
    # The norm of the vector the reference dotted the other operand with: the bound's reference term.
    return OperandSums(ref=ref, a_norm=torch.linalg.vector_norm(a32, dim=-1),
                       b_norm=torch.linalg.vector_norm(b32, dim=-2), ref_norm=torch.linalg.vector_norm(v_K2, dim=-2))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       direction=st.sampled_from(["row", "col"]), with_bias=st.booleans(), kernel=st.booleans(),
       fault=st.sampled_from([None, "inf", "nan", "add"]), seed=st.integers(0, 10_000))
def test_a_check_given_its_operand_side_flags_what_the_full_check_flags(
    m: int, k: int, n: int, dtype: torch.dtype, direction: str, with_bias: bool, kernel: bool, fault: str | None,
    seed: int
) -> None:
    """verify_gemm(operand_sums=...) reads only C: the same vectors flagged and the same bound as the check that
    makes the operand side itself, in either direction, with the one-pass kernel reading C or without."""
    from attnchecker.kernels import fused_pass

    a, b = randn((m, k), seed, dtype), randn((k, n), seed + 1, dtype)
    bias = randn((n,), seed + 2, dtype) if with_bias else None
    c = product(a, b, bias)
    if fault is not None:
        c.view(-1)[seed % c.numel()] = {"inf": math.inf, "nan": math.nan}.get(fault, 1000.0 * math.sqrt(k))
    one_pass = fused_pass.fused_pass if kernel else None
    plain = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=(direction,))[direction]
    given_side = verify_gemm(c, a, b, Tolerance(), bias_N=bias, directions=(direction,), one_pass=one_pass,
                             operand_sums=_operand_side(a, b, direction))[direction]
    assert torch.equal(plain.bad, given_side.bad)
    assert int(plain.bad.sum()) == (0 if fault is None else 1)
    torch.testing.assert_close(given_side.bound, plain.bound, rtol=1e-4, atol=0.0)


def test_operand_sums_go_with_one_direction_only() -> None:
    a, b = randn((4, 5), 0, torch.float32), randn((5, 3), 1, torch.float32)
    with pytest.raises(ValueError, match="one direction"):
        verify_gemm(a @ b, a, b, Tolerance(), operand_sums=_operand_side(a, b, "row"))


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 24), k=st.integers(1, 48), groups=st.integers(2, 5), run=st.integers(1, 40),
       dtype=st.sampled_from(DTYPES), with_bias=st.booleans(), lead=st.booleans(), seed=st.integers(0, 10_000))
def test_rows_in_runs_are_each_runs_own_subproduct_check(m: int, k: int, groups: int, run: int, dtype: torch.dtype,
                                                         with_bias: bool, lead: bool, seed: int) -> None:
    """verify_gemm(groups=g) checks row i as g runs of n/g columns (vector i·g + h): each run's reference, residual
    and bound are those of the sub-product A·B[:, run h] (+ its bias) checked on its own, and a product with an
    error in one run flags that vector only."""
    n = groups * run
    shape = (2,) if lead and not with_bias else ()
    a, b = randn((*shape, m, k), seed, dtype), randn((*shape, k, n), seed + 1, dtype)
    bias = randn((n,), seed + 2, dtype) if with_bias else None
    c = product(a, b, bias)
    tol = Tolerance()
    got = verify_gemm(c, a, b, tol, bias_N=bias, directions=("row",), groups=groups)["row"]
    assert got.groups == groups and got.bad.shape[-1] == m * groups
    for h in range(groups):
        cols = slice(h * run, (h + 1) * run)
        want = verify_gemm(c[..., cols], a, b[..., cols], tol, bias_N=None if bias is None else bias[cols],
                           directions=("row",))["row"]
        # The same residuals up to the sums' own order (well inside the bound), the same bound.
        gap = (got.diff[..., h::groups, :] - want.diff).abs().amax(-1)
        assert bool((gap <= 0.01 * want.bound).all()), (gap, want.bound)
        torch.testing.assert_close(got.bound[..., h::groups], want.bound, rtol=1e-5, atol=0.0)
    assert not bool(got.bad.any())
    i, h = seed % m, (seed // m) % groups
    c[..., i, h * run + seed % run] += 8 * float(got.bound.reshape(-1, m * groups)[0, i * groups + h]) + 1.0
    bad = verify_gemm(c, a, b, tol, bias_N=bias, directions=("row",), groups=groups)["row"].bad
    assert bad.reshape(-1, m * groups)[0].nonzero().flatten().tolist() == [i * groups + h]


def test_runs_go_with_the_rows_and_divide_them() -> None:
    a, b = randn((4, 8), 0, torch.float32), randn((8, 12), 1, torch.float32)
    c = a @ b
    with pytest.raises(ValueError, match="rows only"):
        verify_gemm(c, a, b, Tolerance(), groups=3)
    with pytest.raises(ValueError, match="divide"):
        verify_gemm(c, a, b, Tolerance(), directions=("row",), groups=5)
    with pytest.raises(ValueError, match="eagerly"):
        verify_gemm(c, a, b, Tolerance(), directions=("row",), groups=3, wide_norms=True)
