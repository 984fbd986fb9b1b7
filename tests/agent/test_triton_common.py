"""The launchers' host arithmetic (kernels/triton_common.cdiv, next_power_of_2): Triton's own, without its
ConstexprFunction's cost per call. A grid one program short leaves rows unchecked; a tile one power short, features."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnchecker.kernels.triton_common import cdiv, next_power_of_2, triton

pytestmark = pytest.mark.skipif(triton is None, reason="needs triton")


@given(st.integers(0, 2**40), st.integers(1, 2**12))
def test_cdiv_is_tritons(a: int, b: int) -> None:
    assert cdiv(a, b) == triton.cdiv(a, b)
    assert (cdiv(a, b) - 1) * b < a <= cdiv(a, b) * b or a == 0


@given(st.integers(1, 2**40))
def test_next_power_of_2_is_tritons(n: int) -> None:
    p = next_power_of_2(n)
    assert p == triton.next_power_of_2(n)
    assert p >= n and p & (p - 1) == 0 and (p == 1 or p // 2 < n)
