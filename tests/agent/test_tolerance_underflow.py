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
