"""abft/given_forward.py on its own: the identities a full check over the vendor's attention forward tests, and their
bounds, in float64 with torch (the reference of kernels/triton_given_check.py).

- Every clean row of the vendor's forward (the CPU flash kernel) is within both bounds, over dtypes, lengths, causal
  or not, grouped heads, peaky scores and values of one sign (hypothesis).
- Identity B is written normalised: a shift of the row's log-sum-exp moves A alone, never B.
- One output element moved by its bound's worth flags B; a log-sum-exp moved by A's bound flags A.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance
from attnchecker.abft.given_forward import given_rule, identity_residuals
from attnchecker.attention import vendor

HALF = (torch.bfloat16, torch.float16)


def _forward(dtype: torch.dtype, t: int, d: int, group: int, causal: bool, scale_q: float, v_mean: float, seed: int
             ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, 2 * group, t, d, generator=g) * scale_q).to(dtype)
    k = torch.randn(1, 2, t, d, generator=g).to(dtype)
    v = (torch.randn(1, 2, t, d, generator=g) + v_mean).to(dtype)
    got = vendor.forward(q, k, v, is_causal=causal, scale=d ** -0.5)
    assert got is not None
    return q, k, v, got.out_BHTD, got.lse_BHT


def _residuals(q, k, v, out, lse, causal, dtype, tol=None):  # type: ignore[no-untyped-def]
    return identity_residuals(q, k, v, out, lse, scale=q.shape[-1] ** -0.5, is_causal=causal,
                              rule=given_rule(dtype, tol or Tolerance()))


def test_the_rule_takes_half_precision_and_round_off_bounds_only() -> None:
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        given_rule(torch.float32, Tolerance())
    with pytest.raises(ValueError, match="round-off"):
        given_rule(torch.bfloat16, Tolerance(mode="extreme"))
    loose, tight = given_rule(torch.bfloat16, Tolerance(factor=2.0)), given_rule(torch.bfloat16, Tolerance())
    assert all(a == 2 * b for a, b in zip(loose.scalars(), tight.scalars(), strict=True))


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(HALF), t=st.integers(1, 300), d=st.sampled_from([16, 64, 128]),
       group=st.sampled_from([1, 2]), causal=st.booleans(), scale_q=st.sampled_from([1.0, 4.0]),
       v_mean=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 2**20))
def test_every_clean_row_of_the_vendor_forward_is_within_both_bounds(dtype, t, d, group, causal, scale_q, v_mean,
                                                                     seed) -> None:
    q, k, v, out, lse = _forward(dtype, t, d, group, causal, scale_q, v_mean, seed)
    r = _residuals(q, k, v, out, lse, causal, dtype)
    assert not r["flag_a"].any() and not r["flag_b"].any()
    assert float((r["r_a"] / r["b_a"]).max()) < 0.8
    assert float((r["d_c"].abs() / r["b_c"]).max()) < 0.5


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(HALF), t=st.integers(2, 100), causal=st.booleans(), shift=st.floats(-3.0, 3.0),
       seed=st.integers(0, 2**20))
def test_a_shifted_log_sum_exp_moves_identity_a_alone(dtype, t, causal, shift, seed) -> None:
    """Every P' of a row scales by e^(-shift): a·(O·c) and Σ P'(v·c) scale alike, so B's residual stays within its
    bound, while A sees exactly the shift."""
    q, k, v, out, lse = _forward(dtype, t, 32, 1, causal, 1.0, 0.0, seed)
    r = _residuals(q, k, v, out, lse + shift, causal, dtype)
    assert not r["flag_b"].any()
    torch.testing.assert_close(r["a"], torch.full_like(r["a"], math.exp(-shift)), rtol=1e-2, atol=0.0)
    assert bool(r["flag_a"].all()) == (abs(shift) > 0.01)


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(HALF), t=st.integers(2, 200), causal=st.booleans(), row=st.floats(0, 1),
       col=st.integers(0, 31), factor=st.sampled_from([2.0, 10.0]), seed=st.integers(0, 2**20))
def test_an_output_error_past_its_bound_flags_its_row_in_b_alone(dtype, t, causal, row, col, factor, seed) -> None:
    q, k, v, out, lse = _forward(dtype, t, 32, 1, causal, 1.0, 0.0, seed)
    clean = _residuals(q, k, v, out, lse, causal, dtype)
    i = int(row * (t - 1))
    # The error that moves B's plain sum (c = e) by factor × its bound, in float64 on a float64 copy of the output.
    out64 = out.double()
    out64[0, 1, i, col] += factor * float(clean["b_c"][0, 1, i, 0]) / float(clean["a"][0, 1, i])
    r = identity_residuals(q, k, v, out64, lse, scale=32 ** -0.5, is_causal=causal, rule=given_rule(dtype, Tolerance()))
    assert r["flag_b"].nonzero().tolist() == [[0, 1, i]]
    assert not r["flag_a"].any()
