"""The identities a check over the vendor's attention backward would test (abft/given_backward.py), against the CPU's
flash backward in bf16 and fp16, in float64:

- a clean backward (peaky scores, values of a common sign, grouped key heads, causal or not) flags nothing, every
  row under half its bound;
- one wrong element of dV, dK or dQ, extreme or finite (4 × its row's RMS), flags its row in its own identity, and
  d_w / d_e places a finite one at its column;
- the kernel rounds its running sums once per block of queries (dK, dV) or keys (dQ), as the bound's model of it
  says;
- an error in the forward's stored lse, which the backward reads, moves no residual: the identities test the backward
  against its own inputs; the forward's check tests the lse.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker.abft import Tolerance
from attnchecker.abft.given_backward import (
    CPU_FLASH,
    FP32_ACCUMULATION,
    backward_identity_residuals,
    given_backward_rule,
)

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
HALF = (torch.bfloat16, torch.float16)


def _vendor(dtype: torch.dtype, *, t: int, d: int, group: int, causal: bool, seed: int, peaky: float = 1.0,
            v_mean: float = 0.0, lse_shift: float = 0.0) -> dict[str, torch.Tensor]:
    """q, dO (1, 2·group, t, d), k, v (1, 2, t, d) and the CPU flash kernel's forward and backward, its dK and dV
    summed over each key head's group (as a GQA backward returns them). lse_shift: added to the stored lse the
    backward reads."""
    g = torch.Generator().manual_seed(seed)
    h = 2 * group
    q = (torch.randn(1, h, t, d, generator=g) * peaky).to(dtype)
    k = torch.randn(1, 2, t, d, generator=g).to(dtype)
    v = (torch.randn(1, 2, t, d, generator=g) + v_mean).to(dtype)
    do = torch.randn(1, h, t, d, generator=g).to(dtype)
    k_h, v_h = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = d ** -0.5
    out, lse = FORWARD(q, k_h, v_h, 0.0, causal, scale=scale)[:2]
    lse = lse + lse_shift
    dq, dk_h, dv_h = BACKWARD(do, q, k_h, v_h, out, lse, 0.0, causal, scale=scale)
    dk, dv = (x.float().reshape(1, 2, group, t, d).sum(2).to(dtype) for x in (dk_h, dv_h))
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "dq": dq, "dk": dk, "dv": dv,
            "scale": torch.tensor(scale)}


def _residuals(a: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    return backward_identity_residuals(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], a["dq"], a["dk"], a["dv"],
                                       scale=float(a["scale"]), is_causal=causal,
                                       rule=given_backward_rule(a["q"].dtype, Tolerance()),
                                       accumulation=CPU_FLASH(a["q"].shape[-2]))


@settings(max_examples=16, deadline=None)
@given(dtype=st.sampled_from(HALF), causal=st.booleans(), group=st.sampled_from([1, 2]), t=st.integers(1, 48),
       d=st.sampled_from([16, 32]), peaky=st.sampled_from([1.0, 4.0]), v_mean=st.sampled_from([0.0, 1.0]),
       seed=st.integers(0, 2**20))
def test_a_clean_vendor_backward_stays_under_half_of_every_bound(dtype, causal, group, t, d, peaky, v_mean,
                                                                   seed) -> None:
    a = _vendor(dtype, t=t, d=d, group=group, causal=causal, seed=seed, peaky=peaky, v_mean=v_mean)
    r = _residuals(a, causal)
    for name in "vkq":
        assert not r[f"flag_{name}"].any(), name
        assert float((r[f"d_{name}"].abs() / r[f"b_{name}"]).max()) <= 0.5, name


@settings(max_examples=16, deadline=None)
@given(dtype=st.sampled_from(HALF), causal=st.booleans(), group=st.sampled_from([1, 2]),
       which=st.sampled_from(["dq", "dk", "dv"]), kind=st.sampled_from(["nan", "inf", "near_inf", "add"]),
       at=st.floats(0, 1), col=st.integers(0, 15), seed=st.integers(0, 2**20))
def test_one_wrong_gradient_element_flags_its_row_and_a_finite_one_is_placed(dtype, causal, group, which, kind, at,
                                                                              col, seed) -> None:
    t = 32
    a = _vendor(dtype, t=t, d=16, group=group, causal=causal, seed=seed)
    grad = a[which]
    n = int(at * (grad.shape[1] - 1) + 0.5)
    row = int(at * (t - 1))
    if kind == "add":
        rms = float(grad[0, n, row].float().square().mean().sqrt())
        grad[0, n, row, col] += 4 * max(rms, 1e-3)
    else:
        grad[0, n, row, col] = {"nan": math.nan, "inf": math.inf, "near_inf": 1e4 if dtype == torch.float16 else 1e20}[
            kind]
    r = _residuals(a, causal)
    name = which[1]
    assert r[f"flag_{name}"].nonzero().tolist() == [[0, n, row]]
    for other in set("vkq") - {name}:
        assert not r[f"flag_{other}"].any(), other
    if kind == "add":
        d_e, d_w = (float(x) for x in r[f"d_{name}"][0, n, row])
        assert round(d_w / d_e) - 1 == col


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_cpu_flash_backward_rounds_its_sums_once_per_block_where_its_model_says(dtype: torch.dtype,
                                                                                      causal: bool) -> None:
    """The bound's r (CPU_FLASH): at T = 1024 the kernel adds 4 blocks of 256 queries into dK and dV and 2 blocks of
    512 keys into dQ, rounding each time. Emulated so, from its fp32 P and dS, its gradients come out bit for bit
    (a handful of elements apart, where fp32 sums differ in order); rounded once, a quarter or more differ. And the
    rounds the bound counts per key and query are the blocks that hold a query or key it sees."""
    t = 1024
    acc = CPU_FLASH(t)
    a = _vendor(dtype, t=t, d=16, group=1, causal=causal, seed=3)
    q, k, v, o, do = (a[x].float() for x in ("q", "k", "v", "out", "do"))
    scale = float(a["scale"])
    live_TS = torch.ones(t, t, dtype=torch.bool).tril() if causal else torch.ones(t, t, dtype=torch.bool)
    p = torch.where(live_TS, torch.exp(scale * q @ k.mT - a["lse"][..., None]), 0.0)
    ds = p * (do @ v.mT - (do * o).sum(-1, keepdim=True))
    p_r, ds_r = p.to(dtype).float(), ds.to(dtype).float()

    def rounded_per_block(parts: list[torch.Tensor]) -> torch.Tensor:
        run = torch.zeros_like(parts[0])
        for part in parts:
            run = (run + part).to(dtype).float()
        return run

    qb, kb = acc.query_block, acc.key_block
    assert (qb, kb) == (256, 512)
    blocks = {"dv": rounded_per_block([p_r[..., m:m + qb, :].mT @ do[..., m:m + qb, :] for m in range(0, t, qb)]),
              "dk": rounded_per_block([scale * ds_r[..., m:m + qb, :].mT @ q[..., m:m + qb, :]
                                       for m in range(0, t, qb)]),
              "dq": rounded_per_block([scale * ds_r[..., n:n + kb] @ k[..., n:n + kb, :] for n in range(0, t, kb)])}
    once = {"dv": p_r.double().mT @ do.double(), "dk": scale * ds_r.double().mT @ q.double(),
            "dq": scale * ds_r.double() @ k.double()}
    for name in ("dv", "dk", "dq"):
        got = a[name].float()
        assert float((got == blocks[name]).double().mean()) >= 0.99, name
        assert float((got == once[name].to(dtype).float()).double().mean()) <= 0.9, name
    at = torch.arange(t)
    assert torch.equal(acc.key_rounds(t, at, causal), live_TS.reshape(t // qb, qb, t).any(1).sum(0).double())
    assert torch.equal(acc.query_rounds(t, at, causal), live_TS.reshape(t, t // kb, kb).any(2).sum(1).double())
    assert torch.equal(FP32_ACCUMULATION.key_rounds(t, at, causal), torch.ones(t, dtype=torch.float64))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_an_error_in_the_stored_lse_is_not_the_backwards_to_see(dtype: torch.dtype) -> None:
    """lse off by 0.01 everywhere (every P of the forward 1 % off): the vendor's backward reads it, as does the
    check, so no identity moves; the forward's identity A is what catches it."""
    a = _vendor(dtype, t=40, d=16, group=1, causal=True, seed=5, lse_shift=0.01)
    r = _residuals(a, True)
    assert not any(r[f"flag_{name}"].any() for name in "vkq")


def test_only_half_precision_and_round_off_bounds_are_taken() -> None:
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        given_backward_rule(torch.float32, Tolerance())
    with pytest.raises(ValueError, match="round-off"):
        given_backward_rule(torch.bfloat16, Tolerance(mode="extreme"))
