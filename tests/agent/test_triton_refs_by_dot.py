"""The Triton forward's row-check references on the tensor cores (kernels/triton_checks.split3, store_parts,
refs_by_dot), under Triton's interpreter on CPU: a tile's references A·(B e), A·(B w) from the other side's weighted
sums split into three parts of the operands' dtype and one tl.dot, as the kernel makes them in bf16 and fp16.

- The parts carry an fp32 vector at any magnitude fp32 holds (1e-30 to 1e30, fp16 included, whose own range is 6e-8
  to 65504) to within 2⁻²⁵ of its largest element.
- The references are the fp64 product's within fp32 accumulation plus that representation error, the error the
  bound's reference term allows for (abft/tile_terms.py: c_r); a non-finite sum gives a non-finite reference, which
  the check reads as an upstream fault, as with the fp32 references.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.kernels import triton_attention as ta
from attnchecker.kernels import triton_attention_bwd as tab
from attnchecker.kernels import triton_checks as tc
from attnchecker.kernels.triton_common import interpreting, triton

pytestmark = pytest.mark.skipif(not ta.available("cpu") or not interpreting(),
                                reason="needs triton's interpreter (TRITON_INTERPRET=1)")

U = 2.0**-24
"""fp32's unit roundoff."""

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _hypot_kernel(A, X, Y, Z, Out, N: tl.constexpr):
        """What the backward's bound takes: hypot(a·x, a·y, z) as hypot(a·hypot(x, y), z)."""
        at = tl.arange(0, N)
        inner = tab._hypot2(tl.load(X + at), tl.load(Y + at))
        tl.store(Out + at, tab._hypot2(tl.load(A + at) * inner, tl.load(Z + at)))

    @triton.jit
    def _norm3_kernel(X, Y, Z, Out, N: tl.constexpr):
        at = tl.arange(0, N)
        tl.store(Out + at, tc.norm3(tl.load(X + at), tl.load(Y + at), tl.load(Z + at)))

    @triton.jit
    def _refs_kernel(A, E, W, Parts, Scales, Refs, R: tl.constexpr, L: tl.constexpr, AS_FP32: tl.constexpr):
        """store_parts of (E, W) (L,) fp32 into Parts (L, SPLIT_COLUMNS), then refs_by_dot of A (R, L) with them:
        Refs (2, R) fp32, Scales (2,). AS_FP32: A goes into the product as fp32 (bf16 under the interpreter, as the
        kernel's DOT mode 2 does)."""
        rows = tl.arange(0, R)
        cols = tl.arange(0, L)
        a = tl.load(A + rows[:, None] * L + cols[None, :])
        scale_e, scale_w = tc.store_parts(Parts, tl.load(E + cols), tl.load(W + cols), Parts.dtype.element_ty)
        tl.store(Scales, scale_e)
        tl.store(Scales + 1, scale_w)
        if AS_FP32:
            a = a.to(tl.float32)
        ref1, ref2 = tc.refs_by_dot(a, Parts, scale_e, scale_w)
        tl.store(Refs + rows, ref1)
        tl.store(Refs + R + rows, ref2)


    @triton.jit
    def _refs_as_rows_kernel(A, E, W, Refs, R: tl.constexpr, L: tl.constexpr, AS_FP32: tl.constexpr):
        """The backward query pass's form: parts_of (E, W) as the rows of a (16, L) operand, its product with Aᵀ
        (L, R) folded along the columns (fold_rows): Refs (2, R) fp32."""
        rows = tl.arange(0, R)
        cols = tl.arange(0, L)
        a = tl.load(A + rows[:, None] * L + cols[None, :])
        parts, scale_e, scale_w = tc.parts_of(tl.load(E + cols), tl.load(W + cols), A.dtype.element_ty, 16)
        parts_t = tl.trans(parts)
        if AS_FP32:
            a, parts_t = a.to(tl.float32), parts_t.to(tl.float32)
        ref1, ref2 = tc.fold_rows(tl.dot(parts_t, tl.trans(a), input_precision="ieee"), scale_e, scale_w)
        tl.store(Refs + rows, ref1)
        tl.store(Refs + R + rows, ref2)


def _refs(a_RL: torch.Tensor, e_L: torch.Tensor, w_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(refs (2, R), parts (L, SPLIT_COLUMNS) as stored, scales (2,)) from the kernel."""
    r, n = a_RL.shape
    parts = torch.full((n, tc.SPLIT_COLUMNS), math.nan, dtype=a_RL.dtype)
    scales = torch.empty(2)
    refs = torch.empty(2, r)
    _refs_kernel[(1,)](a_RL, e_L, w_L, parts, scales, refs, R=r, L=n,
                       AS_FP32=ta.dot_mode(a_RL.dtype, None) == 2)
    return refs, parts, scales


def _vector(n: int, seed: int, magnitude: float, spread: float) -> torch.Tensor:
    """(n,) fp32 with random signs, magnitudes spread over 10^±spread around magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x *= 10.0 ** (spread * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1))
    return (x * magnitude).float()


@settings(max_examples=30)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), n=st.sampled_from([16, 32, 64]),
       exponent=st.integers(-30, 30), spread=st.sampled_from([0.0, 2.0, 8.0]), seed=st.integers(0, 2**20))
def test_the_parts_carry_an_fp32_vector_at_any_magnitude(dtype, n, exponent, spread, seed) -> None:
    x = _vector(n, seed, 10.0**exponent, spread)
    _, parts, scales = _refs(torch.zeros(16, n, dtype=dtype), x, x)
    assert bool((parts[:, 6:] == 0).all())
    for col, scale in ((0, scales[0]), (3, scales[1])):
        # A power of 2 that takes the largest element into [1, 2).
        assert math.log2(float(scale)).is_integer()
        assert 1.0 <= float(x.abs().max() / scale) < 2.0
        back = parts[:, col:col + 3].double().sum(-1) * float(scale)
        assert bool(((back - x.double()).abs() <= 2.0**-25 * float(x.abs().max())).all()), (back, x)


@settings(max_examples=30)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), r=st.sampled_from([16, 64]),
       n=st.sampled_from([16, 64, 128]), exponent=st.integers(-30, 30), spread=st.sampled_from([0.0, 3.0]),
       cancel=st.booleans(), seed=st.integers(0, 2**20))
def test_the_references_are_the_fp64_product_s_within_the_bound_s_reference_term(dtype, r, n, exponent, spread,
                                                                                cancel, seed) -> None:
    """A (R, L) as the kernel's tiles hold it (bf16 or fp16 values; P̃ in [0, 1] or Q); the sums at any magnitude,
    with cancellation (w = e - mean: its products cancel to far below their own size) or without. Both forms: A·parts
    folded along its rows (refs_by_dot, the forward), and partsᵀ·Aᵀ folded along its columns (fold_rows, the
    backward's query pass)."""
    a = torch.randn(r, n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    e = _vector(n, seed + 1, 10.0**exponent, spread)
    w = e - e.mean() if cancel else _vector(n, seed + 2, 10.0**exponent, spread)
    refs, _, _ = _refs(a, e, w)
    as_rows = torch.empty(2, r)
    _refs_as_rows_kernel[(1,)](a, e, w, as_rows, R=r, L=n, AS_FP32=ta.dot_mode(dtype, None) == 2)
    a64 = a.double()
    for got, x in [*zip(refs, (e, w), strict=True), *zip(as_rows, (e, w), strict=True)]:
        exact = a64 @ x.double()
        # fp32 accumulation in any order, and the parts' representation error (2⁻²⁵·max|x| per element).
        allowed = 2 * n * U * (a64.abs() @ x.double().abs()) + U / 2 * a64.abs().sum(-1) * float(x.abs().max())
        assert bool(((got.double() - exact).abs() <= allowed).all()), (got, exact)


@settings(max_examples=40)
@given(a_x_y=st.lists(st.integers(-18, 18), min_size=3, max_size=3), z=st.integers(-45, 38),
       zeros=st.integers(0, 7), seed=st.integers(0, 2**20))
def test_the_backward_bounds_hypot_scales_by_a_power_of_2_without_under_or_overflow(a_x_y, z, zeros, seed) -> None:
    """The backward's bounds take sqrt((a·x)² + (a·y)² + z²) of standard deviations (a per vector, x, y per block) as
    hypot(a·hypot(x, y), z), each hypot scaled by a power of 2 near its larger term (triton_checks.pow2_scale):
    within 4 ulp of fp64's, with z from subnormal to 1e38 and zeros anywhere, where the plain squares under- or
    overflow fp32."""
    g = torch.Generator().manual_seed(seed)
    n = 16
    terms = [(torch.rand(n, generator=g, dtype=torch.float64) + 0.5) * 10.0**e for e in (*a_x_y, z)]
    for i in range(3):
        if zeros >> i & 1:
            terms[i + 1][::2] = 0.0
    a, x, y, zz = (t.float() for t in terms)
    out = torch.empty(n)
    _hypot_kernel[(1,)](a, x, y, zz, out, N=n)
    a, x, y, zz = (t.double() for t in (a, x, y, zz))
    exact = torch.sqrt((a * x) ** 2 + (a * y) ** 2 + zz**2)
    assert bool(((out.double() - exact).abs() <= 4 * 2.0**-23 * exact).all()), (out, exact)


@settings(max_examples=40)
@given(exponents=st.lists(st.integers(-45, 38), min_size=3, max_size=3), zeros=st.integers(0, 7),
       seed=st.integers(0, 2**20))
def test_the_forward_bounds_norm3_holds_at_every_magnitude(exponents, zeros, seed) -> None:
    """triton_checks.norm3, the forward's standard deviation as a norm of norms, scaled by a power of 2 near the
    largest term: within 4 ulp of fp64's from subnormals to 1e38, zeros anywhere; an INF term gives INF and a NaN
    gives NaN."""
    g = torch.Generator().manual_seed(seed)
    n = 16
    x, y, z = ((torch.rand(n, generator=g, dtype=torch.float64) + 0.5) * 10.0**e for e in exponents)
    for i, t in enumerate((x, y, z)):
        if zeros >> i & 1:
            t[::2] = 0.0
    x, y, z = x.float(), y.float(), z.float()
    x[1], y[3], z[5] = math.inf, math.nan, math.inf
    out = torch.empty(n)
    _norm3_kernel[(1,)](x, y, z, out, N=n)
    exact = torch.sqrt(x.double() ** 2 + y.double() ** 2 + z.double() ** 2)
    assert out[1] == math.inf and math.isnan(out[3]) and out[5] == math.inf
    keep = exact.isfinite()
    assert bool(((out.double() - exact).abs()[keep] <= 4 * 2.0**-23 * exact[keep]).all()), (out, exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_sum_gives_non_finite_references(dtype, bad) -> None:
    a = torch.randn(16, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    e = _vector(16, 4, 1.0, 0.0)
    e[5] = bad
    refs, _, _ = _refs(a, e, _vector(16, 5, 1.0, 0.0))
    assert not bool(refs[0].isfinite().any())
    assert bool(refs[1].isfinite().all())


@pytest.mark.parametrize("refs_by_dot", [None, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_kernel_takes_the_form_of_references_asked_for_and_either_gives_a_clean_call(monkeypatch, dtype,
                                                                                          refs_by_dot) -> None:
    """Checks.refs_by_dot None: bf16 and fp16 calls make their row references on the tensor cores (under the
    interpreter on every tile), fp32 calls in fp32; False: fp32 whatever the dtype (bench_checks' A/B, and the way
    back should a GPU's tensor cores disagree). Seen by counting the calls of the device function (plain Python under
    the interpreter); both forms give a call that flags nothing and the same output."""
    calls = []
    real = tc.refs_by_dot

    def counted(*args):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(tc, "refs_by_dot", counted)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g).to(dtype) for _ in range(3))
    got = ta.forward(q, k, v, scale=0.25, is_causal=True, blocks=ta.Blocks(16, 16, 16, 4, 1),
                     checks=ta.Checks(mode="full", repair=False, refs_by_dot=refs_by_dot))
    assert bool(calls) == (refs_by_dot is None and dtype != torch.float32)
    assert got.status[:2].tolist() == [0.0, 0.0]
    assert 0.0 < float(got.status[2:].max()) < 1.0
    plain = ta.forward(q, k, v, scale=0.25, is_causal=True, blocks=ta.Blocks(16, 16, 16, 4, 1),
                       checks=ta.Checks(mode=None))
    assert torch.equal(got.out_BHTD, plain.out_BHTD)
