"""Products of tiny values (vanishing gradients: a saturated softmax's dS, dO of a dead head) must not be flagged:
the operand norms and the calibrated variance are squares, which underflow in fp32 long before the values do (an
element below ~1e-19 squares below fp32's smallest normal; u²·‖A‖²·‖B‖² underflows once |C| < ~1e-15). Found by the
clean training campaign (bench/clean_campaign.py: grad_v/grad_k/grad_q of a model with massive activations)."""
from __future__ import annotations

import pytest
import torch

from attnchecker.abft import Tolerance
from attnchecker.abft.gemm import verify_gemm


def _flagged(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    checks = verify_gemm(c, a, b, Tolerance())
    return any(bool(chk.bad.any()) for chk in checks.values())


@pytest.mark.parametrize(("scale_a", "scale_b"), [(1e-13, 1e-13), (1e-24, 1.0), (1.0, 1e-30), (1e-20, 1e-6)],
                         ids=["both-1e-13", "a-1e-24", "b-1e-30", "a-1e-20-b-1e-6"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_clean_products_of_tiny_values_are_not_flagged(scale_a: float, scale_b: float, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 64, 96, generator=g) * scale_a
    b = torch.randn(4, 96, 80, generator=g) * scale_b
    if dtype != torch.float32:
        # Half dtypes: operands and product in the dtype, as autocast runs them (fp16 flushes most of these to 0
        # or to subnormals, which is part of what must not be flagged).
        a, b = a.to(dtype), b.to(dtype)
    c = a @ b
    assert not _flagged(c, a, b)


def test_an_error_of_a_few_rms_among_tiny_values_is_still_flagged() -> None:
    # The fix must not blind the check at small scales where the values are still normal fp32 numbers.
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 96, generator=g) * 1e-13
    b = torch.randn(96, 80, generator=g) * 1e-13
    c = a @ b
    c[5, 7] += 4 * c.double().pow(2).mean().sqrt().float()  # in fp64: the squares underflow fp32
    assert _flagged(c, a, b)


@pytest.mark.parametrize("scale", [1e-5, 1e-6, 1e-7])
def test_fp16_products_of_subnormal_gradients_are_not_flagged_by_the_weighted_checksum(scale: float) -> None:
    # fp16 gradients without loss scaling sit in the subnormal range (below 6.1e-5): each output carries up to half a
    # subnormal step of absolute error, which the weighted checksum d2 sums with weights up to n.
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(4, 64, 96, generator=g) * scale).half()
    b = torch.randn(4, 96, 80, generator=g).half()
    assert not _flagged(a @ b, a, b)


@pytest.mark.parametrize("product", ["gemm", "flushed_by_hand"])
def test_bf16_products_whose_subnormal_operands_were_flushed_are_not_faults(product: str) -> None:
    """bf16 GEMMs may treat operands below bf16's smallest normal (1.2e-38) as zero: this machine's AVX512-BF16 CPU
    kernels do. In the clean campaign's diverged bf16 run a dS row whose one nonzero was 8e-39 gave a dK row of 0
    where the exact product is 1e-37; the float64 re-check of the flagged product (gemm.check: references and norms in
    float64, no fp32 norm floor) flagged it, and it was reported near-INF and uncorrectable. flushed_by_hand: the
    product such a backend computes, made explicitly, so the test does not depend on this CPU. Faults far above what
    a flush can change are still caught: in the float64 check (1e-30), and by the engine (1e-10, corrected)."""
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
    from attnchecker.gemm.check import check_gemms

    tiny = torch.finfo(torch.bfloat16).tiny
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 4, 64, 64, generator=g)
    a[:, :, 30] = 0.0
    a[:, :, 30, 7] = 8e-39
    a[:, :, 41] = (0.1 + 0.8 * torch.rand(64, generator=g)) * tiny  # a whole row of subnormals
    a = a.bfloat16()
    b = (torch.randn(2, 4, 64, 32, generator=g) * 50).bfloat16()
    subnormal = (a != 0) & (a.abs() < tiny)
    assert bool(subnormal[:, :, 30].any()) and bool(subnormal[:, :, 41].all())
    if product == "gemm":
        c = a @ b
    else:
        c = (a.masked_fill(subnormal, 0.0).float() @ b.float()).bfloat16()
        assert c[:, :, 30].abs().max() == 0 and (a.double() @ b.double())[:, :, 30].abs().max() > 1e-38

    def exact_flags(c: torch.Tensor) -> bool:
        checks = verify_gemm(c, a, b, Tolerance(), wide_norms=True, exact_sums=True)
        return any(bool(chk.bad.any()) for chk in checks.values())

    assert not exact_flags(c)
    ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig(), stats=OpStats()))
    assert check_gemms(ctx, [("grad_k", c, a, b, None)]) == 0
    faulty = c.clone()
    faulty[0, 0, 30, 3] = 1e-30
    assert exact_flags(faulty)
    faulty[0, 0, 30, 3] = 1e-10
    assert check_gemms(ctx, [("grad_k", faulty, a, b, None)]) == 1
    torch.testing.assert_close(faulty, c, rtol=0.0, atol=1e-12)
