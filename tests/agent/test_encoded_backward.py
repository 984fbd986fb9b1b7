"""The attention backward's full check on the fused kernel itself, through checksum-encoded operands
(attnchecker.attention.backward.encoded, protect(scope="all") on a step whose whole-step checks are due).

Clean: nothing flagged, and the gradients are the plain fused kernel's (hypothesis over dtypes, shapes, masks and the
strided layouts heads split from a projection have). Faulty: an injector below autograd corrupts the kernel's outputs
(gemm_injector.FusedBackwardFault) or, for the products that never leave the kernel, the inputs of that one call (an
additive mask element: one score; a V element: one column of dP). Each is flagged, the backward is recomputed through
the checked products, and the gradients are the fault-free ones."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from gemm_injector import FusedBackwardFault
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.attention.backward import encoded as encoded_backward
from attnchecker.attention.backward.encoded import ENCODED_OPS
from attnchecker.attention.backward.encoded import encoded_backward as run_encoded

aten = torch.ops.aten
FUSED_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def attention(dtype: torch.dtype, b: int, h: int, t: int, s: int, d: int, *, mask: str, strided: bool, seed: int,
              spread: float = 1.0) -> dict[str, Any]:
    """q, k, v, the fused forward's out and lse, dO and the additive mask of one attention, as the engine hands them
    to the backward. strided: q/k/v split from one projection output and dO in (B, T, H, D) order, as in a model."""
    g = torch.Generator().manual_seed(seed)

    def heads(n: int, rows: int, parts: int) -> list[torch.Tensor]:
        if not strided:
            return [(torch.randn(b, h, rows, d, generator=g) * spread).to(dtype) for _ in range(parts)]
        base = (torch.randn(b, rows, parts * h * d, generator=g) * spread).to(dtype)
        return [base[..., i * h * d:(i + 1) * h * d].view(b, rows, h, d).transpose(1, 2) for i in range(parts)]

    (q,), (k, v) = heads(h, t, 1), heads(h, s, 2)
    causal = mask == "causal"
    mask_add = None
    if mask == "padding":
        keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
        keep[0, ..., max(1, s // 2):] = False
        mask_add = torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, -math.inf)
    elif mask == "bias":  # a learned relative bias (ALiBi/T5 style): finite, of several units
        mask_add = (torch.randn(1, h, t, s, generator=g) * 4).to(dtype)
    scale = 1.0 / math.sqrt(d)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask_add,
                                                                 scale=scale)[:2]
    do = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2) if strided else \
        torch.randn(b, h, t, d, generator=g).to(dtype)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "mask": mask_add, "scale": scale,
            "causal": causal}


def fused(a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return FUSED_BACKWARD(a["do"], a["q"], a["k"], a["v"], a["out"], a["lse"], 0.0, a["causal"], attn_mask=a["mask"],
                          scale=a["scale"])


def encoded(ctx: Any, a: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    return run_encoded(ctx, a["do"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["mask"], scale=a["scale"],
                       is_causal=a["causal"])


def close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], a: dict[str, Any], rel: float) -> bool:
    """Each gradient within rel of the reference's largest element, or of the size its terms can have: a gradient
    that is 0 in exact arithmetic (dQ over a single key: softmax ignores a shift) is round-off through and through,
    and any other summation order changes all of it."""
    def top(x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x.double(), dim=-1).max()) if x.numel() else 0.0

    size = a["scale"] * top(a["do"]) * top(a["v"]) * max(top(a["q"]), top(a["k"])) + top(a["do"])
    return all(bool((g.double() - w.double()).abs().max() <= rel * (float(w.double().abs().max()) + size))
               for g, w in zip(got, want, strict=True))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 40),
       s=st.integers(1, 40), d=st.sampled_from([8, 16, 24, 64]), mask=st.sampled_from(["none", "causal", "padding",
                                                                                        "bias"]),
       strided=st.booleans(), spread=st.sampled_from([0.1, 1.0, 4.0]), seed=st.integers(0, 2**16))
def test_clean_backward_flags_nothing_and_gives_the_fused_kernels_gradients(make_ctx: Any, dtype: torch.dtype, b: int,
                                                                            h: int, t: int, s: int, d: int, mask: str,
                                                                            strided: bool, spread: float,
                                                                            seed: int) -> None:
    a = attention(dtype, b, h, t, s if mask != "causal" else t, d, mask=mask, strided=strided, seed=seed,
                  spread=spread)
    ctx, rec = make_ctx()
    got = encoded(ctx, a)
    assert not rec.detections, rec.detections[:1]
    stats = ctx.runtime.stats
    assert {op for op, n in stats.checks.items() if n} == set(ENCODED_OPS)
    assert all(float(r) <= 1.0 for r in stats.residual_max.values()), stats.residual_max
    # The kernel at D + 5 head dims sums the real ones in another order at most: a few units of round-off.
    assert close(got, fused(a), a, 8 * torch.finfo(dtype).eps)


def test_clean_backward_at_a_realistic_size_keeps_a_wide_margin(make_ctx: Any) -> None:
    """GPT-2-small's attention (12 heads of 64) at T = 1024, causal, fp32 and bf16: the worst clean ratio stays far
    below 1 (what the dashboard's margin panel shows)."""
    for dtype in (torch.float32, torch.bfloat16):
        a = attention(dtype, 1, 12, 1024, 1024, 64, mask="causal", strided=True, seed=3)
        ctx, rec = make_ctx()
        encoded(ctx, a)
        assert not rec.detections
        assert max(float(r) for r in ctx.runtime.stats.residual_max.values()) < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_rows_of_any_magnitude_stay_clean(make_ctx: Any, dtype: torch.dtype) -> None:
    """Padded tokens' gradient rows reach 1e-24 (the clean campaign's BERT at T = 512), and diverging runs' 1e18: in
    fp32 their squares underflow or overflow, and a norm of 0 made a bound of 0 under a correct dQ (a false
    "recomputed" in the campaign). The norms fall back on √D·max|x| there. And a batch element whose gradients are
    all ~1e-20 beside one with rows of ~1e18 (the campaign's bf16 BERT) must keep its dK/dV bound columns above the
    range a bf16 GEMM flushes to zero."""
    a = attention(dtype, 2, 2, 40, 40, 16, mask="padding", strided=True, seed=7)
    do = a["do"].float().clone()
    do[0, :, :10] *= 1e-24
    do[0, :, 10:] *= 1e-20
    do[1, :, 5:9] *= 1e18
    a["do"] = do.to(dtype)
    ctx, rec = make_ctx()
    got = encoded(ctx, a)
    assert not rec.detections, rec.detections[:2]
    assert close(got, fused(a), a, 8 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("mask_value", [-88.0, -96.0])
def test_keys_a_mask_pushes_below_the_normal_range_stay_clean(make_ctx: Any, mask_value: float) -> None:
    """bf16, padded keys whose additive mask (-88 to -96) leaves AP_ij ~1e-40, below the normal range, under
    gradients of ~1e10: the kernel's bf16 GEMM for dV' flushes those AP_ij to zero, and with them the dK bound
    column's terms, while dS_ij = AP_ij·(dP_ij - δ_i) is a normal number that reaches dK. The clean campaign's bf16
    BERT with massive activations flagged such dK rows (1e-26 under a bound column of 1e-29) until the bound took
    tiny·Σ_i g_i for the terms a flush can drop."""
    g = torch.Generator().manual_seed(0)
    d, t = 32, 64
    scale = 1 / math.sqrt(d)
    q, k, v = (torch.randn(1, 2, t, d, generator=g).bfloat16() for _ in range(3))
    mask = torch.zeros(1, 1, 1, t)
    mask[..., 48:] = mask_value
    mask = mask.bfloat16()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask, scale=scale)[:2]
    do = (torch.randn(1, 2, t, d, generator=g) * 1e10).bfloat16()
    a = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "mask": mask, "scale": scale, "causal": False}
    ctx, rec = make_ctx()
    encoded(ctx, a)
    assert not rec.detections, [(det.op, det.row) for det in rec.detections]


def test_an_overflowed_bound_column_is_a_loose_bound_not_a_flag(make_ctx: Any, monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """A bound column can overflow where the recomputed AP sums far past 1 (TF32 with massive activations): the
    residuals must not read it (0·INF is NaN, which flags). The clean campaign's TF32 BERT reported 46 correct dV
    rows as recomputed that way. Forced here by scaling the columns past the dtype's range."""
    def overflowing(x: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every row at the largest one's value (a looser bound, still a bound), half the dtype's range: finite, so
        # dP = dO'·V'ᵀ (where it meets V's zero columns) stays clean, but a key whose AP column sums past 2 overflows.
        half = torch.finfo(torch.float32).max / 2
        return torch.full_like(x, half), x.amax() / half

    monkeypatch.setattr(encoded_backward, "_in_range", overflowing)
    a = attention(torch.float32, 1, 2, 32, 32, 16, mask="none", strided=False, seed=8, spread=4.0)
    inputs = encoded_backward._Inputs(a["do"], a["q"], a["k"], a["v"], a["out"], a["lse"], a["mask"])
    encoded_ops, _ = encoded_backward._encode(inputs, scale=a["scale"], acc=torch.float32)
    assert torch.isinf(FUSED_BACKWARD(*encoded_ops[4:], *encoded_ops[:4], a["lse"], 0.0, False, attn_mask=None,
                                      scale=a["scale"])[2]).any()  # the case is real: some bound column overflowed
    ctx, rec = make_ctx()
    got = encoded(ctx, a)
    assert not rec.detections
    assert ctx.runtime.stats.checks.get("scores_bwd", 0) == 0  # not flagged: nothing was recomputed
    assert close(got, fused(a), a, 8 * torch.finfo(torch.float32).eps)


def test_a_tf32_forward_stays_clean(make_ctx: Any) -> None:
    """Under TF32 (emulated: fp32 products on operands rounded to 10 mantissa bits) the forward's scores and output
    carry that rounding and the kernel recomputes the scores in IEEE fp32: the clean campaign's TF32 GPT-2 flagged
    Σ_j dS_ij before the bound took the forward's operand rounding (here: ratios up to 1.0 over these seeds without
    it)."""
    from attnchecker.emulate import emulate_fp32_matmul

    worst = 0.0
    for seed in range(5):
        for t in (16, 64):
            a = attention(torch.float32, 2, 4, t, t, 32, mask="causal", strided=True, seed=seed, spread=0.5)
            q, k, v = a["q"], a["k"], a["v"]
            with emulate_fp32_matmul("tf32"):
                s = (q @ k.mT) * a["scale"]
                s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
                a["lse"] = torch.logsumexp(s, -1)
                a["out"] = torch.softmax(s, -1) @ v
                ctx, rec = make_ctx()
                encoded(ctx, a)
            assert not rec.detections, rec.detections[:2]
            worst = max(worst, float(ctx.runtime.stats.residual_max["grad_probs"]))
    assert worst < 0.5


def _hit(kind: str, value: torch.Tensor, size: float) -> torch.Tensor:
    if kind == "finite":
        return value + size
    from gemm_injector import corrupt

    return corrupt(value, kind)


class OutputFault(TorchDispatchMode):
    """One element of output ``which`` of the first fused backward, in its real head dims (``head_dims``): a value
    from gemm_injector.corrupt, or ``finite``: ``rms`` times the output's RMS added; ``balanced``: +rms and -rms RMS
    on two elements of one row, which the plain checksum cannot see."""

    def __init__(self, which: int, kind: str, head_dims: int, rms: float = 8.0) -> None:
        super().__init__()
        self.which, self.kind, self.head_dims, self.rms, self.hit = which, kind, head_dims, rms, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is FUSED_BACKWARD and not self.hit:
            grad = out[self.which][..., :self.head_dims]
            row = grad[0, 0, grad.shape[-2] // 2]
            size = self.rms * float(grad.float().square().mean().sqrt())
            if self.kind == "balanced":
                row[0] += size
                row[-1] -= size
            else:
                row[3] = _hit(self.kind, row[3], size)
            self.hit = True
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf", "bitflip", "finite", "balanced"])
def test_a_fault_in_an_output_is_flagged_and_recomputed_through_the_checked_products(
        make_ctx: Any, dtype: torch.dtype, which: int, kind: str) -> None:
    """Finite errors: 8× the output's RMS in fp32; in bf16 the bounds are looser (the kernel's products and ours
    round to 8 bits, and dQ/dK's bound takes the largest key's norms), and 128× is what this shape detects
    (docs/abft.md, "The encoded backward", has the measured thresholds)."""
    if kind == "bitflip" and dtype != torch.float32:
        pytest.skip("gemm_injector's bit flip is of an fp32 value")
    a = attention(dtype, 2, 4, 48, 48, 32, mask="causal", strided=True, seed=which)
    clean = fused(a)
    ctx, rec = make_ctx()
    fault = OutputFault(which, kind, head_dims=32, rms=8.0 if dtype == torch.float32 else 128.0)
    with fault:
        got = encoded(ctx, a)
    assert fault.hit
    op = ENCODED_OPS[which]
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [(op, "recomputed", "abft")], rec.detections
    det = rec.detections[0]
    # Located at the corrupted row (dK, dV: a key row; the injector hit row T/2 of batch 0, head 0).
    assert (det.batch, det.head, det.row) == (0, 0, 24)
    # The checked products' gradients: the fault-free ones, to their round-off against the fused kernel's.
    assert close(got, clean, a, 1e-5 if dtype == torch.float32 else 2e-2)


class InsideFault(TorchDispatchMode):
    """Corrupts an input of the first fused backward only, which is how a fault in a product that never leaves the
    kernel looks from outside: ``score``: one element of the additive mask (so one recomputed score, S_ij + 3);
    ``dp``: one element of V (dP = dO Vᵀ wrong in one column for every row; dV does not read V)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.hit = where, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is FUSED_BACKWARD and not self.hit:
            self.hit = True
            if self.where == "score":
                mask = kwargs["attn_mask"].clone()
                mask[0, 1, 7, 5] += 3.0
                kwargs["attn_mask"] = mask
            else:
                v = args[3].clone()
                v[0, 1, 5, 2] += 3.0
                args = (*args[:3], v, *args[4:])
        return func(*args, **kwargs)


@pytest.mark.parametrize("where", ["score", "dp"])
def test_a_fault_inside_the_kernel_shows_in_the_row_sums_of_ds(make_ctx: Any, where: str) -> None:
    """The outputs' checksums are consistent with such a fault (both sides read the same wrong dS); Σ_j dS_ij = 0,
    which holds for any AP consistent with the forward's output, is not."""
    a = attention(torch.float32, 1, 2, 24, 24, 16, mask="bias", strided=False, seed=5)
    clean = fused(a)
    ctx, rec = make_ctx()
    fault = InsideFault(where)
    with fault:
        got = encoded(ctx, a)
    assert fault.hit
    assert ("grad_probs", "recomputed") in {(d.op, d.action) for d in rec.detections}, rec.detections
    assert all(d.action == "recomputed" for d in rec.detections)
    assert close(got, clean, a, 1e-5)


def test_detect_mode_reports_and_keeps_the_kernels_result(make_ctx: Any) -> None:
    a = attention(torch.float32, 1, 2, 16, 16, 16, mask="none", strided=False, seed=2)
    ctx, rec = make_ctx(mode="detect")
    with OutputFault(0, "inf", head_dims=16):
        got = encoded(ctx, a)
    assert [(d.op, d.action) for d in rec.detections] == [("grad_q", "detected")]
    assert torch.isinf(got[0]).any()


def test_an_fp16_overflow_both_paths_compute_is_not_reported(make_ctx: Any) -> None:
    """GradScaler's first steps overflow fp16 gradients on purpose (and skip the step): the encoded check flags the
    INF, the checked products compute the same overflow, and nothing is reported (gemm.check._overflowed)."""
    a = attention(torch.float16, 1, 2, 32, 32, 16, mask="causal", strided=False, seed=4)
    a["do"] = (a["do"].float() * 2.0**15).half()
    assert not torch.isfinite(fused(a)[2]).all()
    ctx, rec = make_ctx()
    encoded(ctx, a)
    assert not rec.detections, rec.detections[:2]


def test_off_the_cpu_or_when_disabled_the_checked_products_run(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 1, 4, 8)
    assert encoded_backward.supports(q)
    assert not encoded_backward.supports(q.to(torch.int32))
    monkeypatch.setattr(encoded_backward, "enabled", False)
    assert not encoded_backward.supports(q)


def test_the_model_injector_hits_the_encoded_kernel() -> None:
    """gemm_injector.FusedBackwardFault (used on whole models) sees the encoded call as the plain one."""
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime

    seen: list[Any] = []
    ctx = LayerContext(layer=0, runtime=Runtime(step=0, config=CheckConfig(), injector=None,
                                                on_detection=seen.append, stats=OpStats()))
    a = attention(torch.float32, 1, 2, 16, 16, 16, mask="causal", strided=True, seed=9)
    fault = FusedBackwardFault(call=0, which=1, kind="nan", element=3)
    with fault:
        encoded(ctx, a)
    assert fault.hit and [(d.op, d.action) for d in seen] == [("grad_k", "recomputed")]


def test_a_kernel_that_refuses_the_encoded_operands_falls_back_to_the_checked_products(
        make_ctx: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The training step never fails because of the encoding: if the kernel build refuses D + 5 head dims (or a mask
    with them), the checked products run, with one warning."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("head dim not supported")

    monkeypatch.setattr(encoded_backward, "_BACKWARD", refuse)
    monkeypatch.setattr(encoded_backward, "_warned", set())
    a = attention(torch.float32, 1, 2, 24, 24, 16, mask="causal", strided=True, seed=6)
    ctx, rec = make_ctx()
    with caplog.at_level("WARNING", logger="attnchecker"):
        got = encoded(ctx, a)
        encoded(ctx, a)
    assert not rec.detections
    assert close(got, fused(a), a, 1e-5)
    assert ctx.runtime.stats.checks["scores_bwd"] == 2  # the products ran, twice
    assert sum("refused the encoded operands" in r.message for r in caplog.records) == 1


def test_under_tf32_a_flag_on_a_clean_output_is_not_reported(make_ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovery's checked products run in the model's matmul precision (TF32 here, emulated), the kernel in IEEE
    fp32: their outputs differ by TF32's rounding, which the comparison must allow for, or a flag on a correct output
    (a bound the data came close to; forced here) is reported as a recomputed fault."""
    from attnchecker.emulate import emulate_fp32_matmul

    real = encoded_backward._ratios

    def flag_dv(*args: Any, **kwargs: Any) -> Any:
        ratios, bounds = real(*args, **kwargs)
        return [*ratios[:2], ratios[2] * 0 + 2.0, ratios[3]], bounds

    monkeypatch.setattr(encoded_backward, "_ratios", flag_dv)
    a = attention(torch.float32, 2, 4, 48, 48, 32, mask="causal", strided=True, seed=12)
    with emulate_fp32_matmul("tf32"):
        ctx, rec = make_ctx()
        encoded(ctx, a)
    assert ctx.runtime.stats.checks["scores_bwd"] > 0  # flagged, and recomputed through the products
    assert not rec.detections, [(det.op, det.row) for det in rec.detections]


def test_the_calibrated_bound_catches_a_few_rms_error_the_rigorous_one_misses(make_ctx: Any,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, GPT-2-like heads at T = 512: 2× the output's RMS in one element of dQ. The calibrated accumulation term
    (sigmas·u·√n instead of 2γ_n) flags it; the rigorous bound alone does not, which is the sensitivity the
    calibrated term buys (docs/abft.md, "Sensitivity")."""
    from attnchecker.abft.tolerance import Tolerance

    a = attention(torch.float32, 1, 4, 512, 512, 64, mask="causal", strided=True, seed=13)
    caught = {}
    for calibrated in (True, False):
        monkeypatch.setattr(encoded_backward, "_tolerance", lambda layer, c=calibrated: Tolerance(calibrated=c))
        ctx, rec = make_ctx(mode="detect")
        with OutputFault(0, "finite", head_dims=64, rms=2.0):
            encoded(ctx, a)
        caught[calibrated] = [det.op for det in rec.detections]
    assert caught == {True: ["grad_q"], False: []}
