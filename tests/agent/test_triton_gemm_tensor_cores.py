"""The GEMM checks' grouped operand pass on the tensor cores (kernels/triton_gemm_kernels._dot_exact), under Triton's
interpreter on CPU: a bf16 or fp16 operand's products with its fp32 factors as TF32 products of the factors' three
parts, which is what took the pass from issue-bound to about its read's time on sm_90 (bench/triton_gemm_resources.py).

- The parts are TF32 values (their low 13 mantissa bits clear) and add up to the factor exactly, from 2⁻¹⁰⁰ to fp32's
  largest (below, the third part is subnormal, which a tensor core may flush: an error under 2⁻¹²⁶); an INF or NaN
  stays non-finite in their sum.
- So the products are the IEEE ones: the pass's references, and its run sums with weights past 2,048 (three parts),
  are the fp64 products' within fp32 accumulation.
- An fp32 operand its GEMM rounds to bf16 or fp16 (autocast) enters the products rounded as the GEMM rounds it (to
  nearest even; on the integer bits under the interpreter, whose own bf16 conversion truncates), so an autocast
  GEMM's references are of the operands it multiplied.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance
from attnchecker.abft.gemm import verify_gemm
from attnchecker.gemm import device
from attnchecker.kernels import triton_gemm_check as tg
from attnchecker.kernels.triton_common import interpreting, triton

pytestmark = pytest.mark.skipif(not tg.available() or not interpreting(),
                                reason="needs triton's interpreter (TRITON_INTERPRET=1)")

U = 2.0**-24
"""fp32's unit roundoff."""

if triton is not None:
    import triton.language as tl

    from attnchecker.kernels import triton_gemm_kernels as tk

    @triton.jit
    def _parts_kernel(F, Out, N: tl.constexpr):
        """The three parts _dot_exact takes of F (N,): Out (3, N)."""
        at = tl.arange(0, N)
        f = tl.load(F + at)
        f1 = tk._tf32(f)
        rest = f - f1
        f2 = tk._tf32(rest)
        tl.store(Out + at, f1)
        tl.store(Out + N + at, f2)
        tl.store(Out + 2 * N + at, rest - f2)

    @triton.jit
    def _dot_kernel(A, F, Out, R: tl.constexpr, K: tl.constexpr, J: tl.constexpr, TC: tl.constexpr):
        """Out (R, J) = A (R, K) · F (K, J) through _dot_exact, A's values held in fp32."""
        r = tl.arange(0, R)
        k = tl.arange(0, K)
        j = tl.arange(0, J)
        a = tl.load(A + r[:, None] * K + k[None, :]).to(tl.float32)
        f = tl.load(F + k[:, None] * J + j[None, :])
        tl.store(Out + r[:, None] * J + j[None, :], tk._dot_exact(a, f, tl.full([R, J], 0, tl.float32), TC))


    @triton.jit
    def _cast_kernel(X, Out, N: tl.constexpr, CAST: tl.constexpr):
        at = tl.arange(0, N)
        tl.store(Out + at, tk._gemm_operand(tl.load(X + at), CAST))


def _parts(f: torch.Tensor) -> torch.Tensor:
    out = torch.empty(3, f.numel(), dtype=torch.float32)
    _parts_kernel[(1,)](f, out, N=f.numel())
    return out


finite_fp32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
normal_fp32 = finite_fp32.filter(lambda v: v == 0.0 or abs(v) >= 2.0**-100)


@settings(max_examples=25, deadline=None)
@given(values=st.lists(normal_fp32, min_size=16, max_size=16), tiny=st.lists(finite_fp32, min_size=16, max_size=16))
def test_the_parts_are_tf32_values_that_add_up_to_the_factor(values: list[float], tiny: list[float]) -> None:
    """fp32 values from 2⁻¹⁰⁰ to the largest: three parts with the low 13 bits of their mantissas clear (a tensor core
    reads them unrounded), whose sum is the value exactly. Any finite value, subnormals included: the sum is exact."""
    f = torch.tensor(values, dtype=torch.float32)
    parts = _parts(f)
    assert not (parts.view(torch.int32) & 0x1FFF).any(), parts
    assert torch.equal(parts.double().sum(0), f.double())
    g = torch.tensor(tiny, dtype=torch.float32)
    assert torch.equal(_parts(g).double().sum(0), g.double())


def test_a_non_finite_factor_stays_non_finite() -> None:
    f = torch.tensor([float("inf"), -float("inf"), float("nan")] + [1.0] * 13, dtype=torch.float32)
    total = _parts(f).sum(0)
    assert not total[:3].isfinite().any() and torch.equal(total[3:], f[3:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensor_core_products_are_the_ieee_ones_to_fp32_accumulation(dtype: torch.dtype) -> None:
    """A bf16 or fp16 tile times fp32 factors spanning 40 binades: the tensor-core form's products equal the fp64
    product's within γ_K·Σ|a||f| (fp32 accumulation of exact products), as the IEEE form's do."""
    gen = torch.Generator().manual_seed(3)
    r, k, j = 32, 256, 16
    a = torch.randn(r, k, generator=gen).to(dtype)
    f = (torch.randn(k, j, generator=gen) * torch.exp2(torch.randint(-20, 20, (k, j), generator=gen).float()))
    exact = a.double() @ f.double()
    allowed = k * U * (a.double().abs() @ f.double().abs())
    for tc in (True, False):
        out = torch.empty(r, j, dtype=torch.float32)
        _dot_kernel[(1,)](a, f, out, R=r, K=k, J=j, TC=tc)
        assert ((out.double() - exact).abs() <= allowed).all(), tc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_run_sums_past_2048_columns_take_their_weights_in_parts(dtype: torch.dtype) -> None:
    """Runs of 4,096 columns: weights up to 4,096, past TF32's 2,048 exact integers (WHOLE_RUN), so the pass takes
    them in parts. Each run's sums X·1 and X·(1..4096) are the fp64 ones within fp32 accumulation."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(64, 2 * 4096, generator=gen).to(dtype)
    ws = tg.Workspace(x.device, 1)
    got = tg.operand_pass(x, ws, right_w=2).xw
    assert got is not None
    w = torch.arange(1, 4097, dtype=torch.float64)
    xd = x.double().view(64, 2, 4096)
    want = torch.stack([xd.sum(-1), (xd * w).sum(-1)], -1).reshape(64, 4)
    allowed = 4096 * U * torch.stack([xd.abs().sum(-1), (xd.abs() * w).sum(-1)], -1).reshape(64, 4)
    assert ((got[0].double() - want).abs() <= allowed).all()
    assert np.isfinite(got.numpy()).all()


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(width=32), min_size=64, max_size=64))
def test_an_autocast_operand_is_rounded_as_its_gemm_rounds_it(values: list[float]) -> None:
    """Any fp32 value, ties, INF, NaN and values that round past bf16's largest included: the operand pass's bf16 (on
    the bits, as on the CPU) and fp16 roundings are torch's, which are the GEMM's under autocast."""
    x = torch.tensor(values, dtype=torch.float32)
    for code, dtype in ((3, torch.bfloat16), (2, torch.float16)):
        out = torch.empty_like(x)
        _cast_kernel[(1,)](x, out, N=64, CAST=code)
        assert torch.equal(out.nan_to_num(7.0), x.to(dtype).float().nan_to_num(7.0)), dtype


@pytest.mark.parametrize("n", [256, 1024])
def test_an_autocast_gemm_is_checked_against_the_operands_it_multiplied(n: int) -> None:
    """C = bf16(A)·bf16(B) in bf16, the check given fp32 A and B (a caller handing master weights, not autocast's
    rounded copies as the integrations do): the Triton check's references are of the rounded operands, so its worst clean residual is under 0.7 × the one of
    references from the fp32 operands (verify_gemm's, under the same bound); neither flags. With 1,024 columns the
    rows are checked in 4 runs."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, n, generator=g)
    c = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16()
    tol = Tolerance()
    chk = device.check_product(c, a, b, None, tol)
    worst = float(chk.state[tg.STATE["worst"] : tg.STATE["worst"] + 1].view(torch.float32))
    assert int(chk.state[tg.STATE["flagged"]]) == 0
    cpu = verify_gemm(c, a, b, tol, directions=("row",), groups=device.runs(n, tol))["row"]
    assert cpu.bound2 is not None and not bool(cpu.bad.any())
    cpu_worst = float(torch.maximum(cpu.diff[..., 0].abs() / cpu.bound, cpu.diff[..., 1].abs() / cpu.bound2).max())
    assert 0 < worst < 0.7 * cpu_worst, (worst, cpu_worst)
