"""Whole-step protection (protect(scope="all")): a fault in any forward or backward GEMM of attention and MLP (the
attention core's backward included: attention.backward.checked), injected
below autograd (gemm_injector: a TorchDispatchMode on aten mm/addmm/bmm), is corrected before it reaches a gradient.

Every model GEMM of one training step is hit once (the injection kinds cycle over the calls), and the gradients must
equal the fault-free protected step's to <= 1e-5 relative, every weight finite after the optimizer step."""
from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from gemm_injector import FusedBackwardFault, GemmCall, GemmInjector, is_model_gemm, worst_rel
from model_zoo import ARCHS as ZOO
from model_zoo import batch, build, injected_step, loss_of, train
from torch import nn

import attnchecker
from attnchecker import Policy

ARCHS = ("gpt2", "llama", "bert")
KINDS = ("inf", "nan", "near_inf", "bitflip")


def one_step(arch: str, scope: str | None, injector: GemmInjector, *, eager: bool = False
             ) -> tuple[dict[str, torch.Tensor], bool, list]:
    """One forward/backward/SGD step of a fresh seeded model: (gradients, weights finite after the step, detections).
    scope None: unprotected; eager: its attention unfused (every product an aten bmm)."""
    model = build(arch)
    if eager:
        model.set_attn_implementation("eager")
    guard = attnchecker.protect(model, policy=Policy.full(), scope=scope) if scope else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    grads = injected_step(arch, model, opt, injector)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    detections = guard.detections if guard else []
    if guard:
        guard.close()
    return grads, finite, detections


def model_gemms(arch: str, protected_calls: list[GemmCall]) -> list[GemmCall]:
    """The protected step's GEMM calls that the unprotected model, attention unfused, also makes (same output shape
    and reduction length): the model's own GEMMs, not the checks' checksum products."""
    plain = GemmInjector()
    one_step(arch, None, plain, eager=True)
    signature = {(c.shape, c.k) for c in plain.calls if is_model_gemm(c)}
    return [c for c in protected_calls if (c.shape, c.k) in signature and is_model_gemm(c)]


def uncorrected(arch: str, targets: list[GemmCall], clean: dict[str, torch.Tensor]) -> list:
    """Each target GEMM call corrupted in its own scope="all" step (the kinds in turn): those whose step did not end
    with finite weights, the fault-free gradients (1e-5) and only corrected or recomputed detections."""
    failures = []
    for n, call in enumerate(targets):
        kind = KINDS[n % len(KINDS)]
        inj = GemmInjector(target=call.index, kind=kind, element=7 + 13 * n)
        grads, finite, detections = one_step(arch, "all", inj)
        assert inj.hit == call, "the faulty run made different GEMM calls before the target"
        worst = worst_rel(grads, clean)
        actions = {d.action for d in detections}
        if not (finite and worst <= 1e-5 and detections and actions <= {"corrected", "recomputed"}):
            failures.append((call, kind, worst, [(d.op, d.action) for d in detections]))
    return failures


@pytest.mark.parametrize(("arch", "kernel"), [*((a, False) for a in ARCHS), ("gpt2", True), ("llama", True)])
def test_a_fault_in_any_forward_or_backward_gemm_is_corrected(arch: str, kernel: bool,
                                                              kernel_everywhere: Callable[[], None]) -> None:
    """kernel: every check through the one-pass kernel (conftest.kernel_everywhere), the Linear checks with their
    operand sums shared between the forward and the backward (gemm.check.linear_sums): Conv1D (GPT-2) and nn.Linear
    (Llama) layouts."""
    if kernel:
        kernel_everywhere()
    recorder = GemmInjector()
    clean, finite, detections = one_step(arch, "all", recorder)
    assert finite and not detections
    # The checked step's gradients are the unprotected model's, to round-off (the attention backward's products run
    # in another order than the fused kernel's).
    plain, _, _ = one_step(arch, None, GemmInjector())
    assert worst_rel(clean, plain) <= 1e-5
    targets = model_gemms(arch, recorder.calls)
    kinds = {(c.phase, c.op) for c in targets}
    # Linear GEMMs both ways and the attention core's forward products; its backward is the fused kernel on encoded
    # operands (attention.backward.encoded: no GEMM of its own to hit, the test below hits its outputs).
    assert {("forward", "bmm"), ("backward", "mm")} <= kinds, kinds
    assert not uncorrected(arch, targets, clean)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_fault_in_the_checked_attention_backward_kernel_is_recomputed(arch: str, which: int) -> None:
    """The attention backward's full check runs the fused kernel on checksum-encoded operands (attention.backward.encoded):
    a fault in its dQ, dK or dV, of each layer in turn, is flagged by the row checksums and recomputed through the
    checked products; the gradients are the fault-free step's (GQA for Llama, the padding mask for BERT)."""
    clean, _, _ = one_step(arch, "all", GemmInjector())
    config = build(arch).config
    head_dim = config.hidden_size // config.num_attention_heads
    op = ("grad_q", "grad_k", "grad_v")[which]
    for call in range(2):  # each of the zoo's two layers
        fault = FusedBackwardFault(call=call, which=which, kind=KINDS[(which + call) % len(KINDS)], element=29,
                                   head_dims=head_dim)
        grads, finite, detections = one_step(arch, "all", fault)
        assert fault.hit
        assert finite and worst_rel(grads, clean) <= 1e-5
        assert [(d.op, d.action, d.tier) for d in detections] == [(op, "recomputed", "abft")], detections


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_the_tiled_path_checks_the_attention_backward_a_block_of_rows_at_a_time(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long context takes the tiled path (T·S >= 512²). The checked products of its backward run a block of query
    rows at a time (O(block·S) memory, as its forward), forced here with 4-row blocks so that the zoo's short
    sequences cross several (causal: GPT-2, Llama; BERT's padding mask, a block's rows of it). The injector, below
    autograd, hits each of those block products in turn (S, dP, the dQ rows, the dK and dV contributions): each fault
    is corrected, the gradients are the fault-free step's. Those products are the encoded kernel's recovery path and
    the full check off the CPU; the encoded kernel is switched off here to reach them on every layer."""
    from attnchecker.attention.backends.tiled_torch import PATH_ENV, TILE_ENV
    from attnchecker.attention.backward import encoded

    monkeypatch.setattr(encoded, "enabled", False)
    monkeypatch.setenv(PATH_ENV, "tiled")
    monkeypatch.setenv(TILE_ENV, "4,4")
    recorder = GemmInjector()
    clean, finite, detections = one_step(arch, "all", recorder)
    assert finite and not detections
    plain, _, _ = one_step(arch, None, GemmInjector())
    assert worst_rel(clean, plain) <= 1e-5
    targets = [c for c in recorder.calls if c.phase == "backward" and c.op == "bmm" and is_model_gemm(c)]
    # Blocks of 4 query rows: S and dP are (B, H, 4, keys), the dQ rows (B, H, 4, D).
    assert sum(c.shape[-2] == 4 for c in targets) >= 2 * 3 * 2, [c.shape for c in targets]
    assert not uncorrected(arch, targets[::3], clean)


def test_attention_scope_lets_an_mlp_gradient_fault_through() -> None:
    """The gap scope="all" closes: the same fault in an MLP weight-gradient GEMM under the default scope."""
    recorder = GemmInjector()
    one_step("gpt2", "all", recorder)
    # GPT-2's MLP c_fc weight gradient: dW (I=64, O=256) = Xᵀ dY over the 48 tokens.
    target = next(c for c in recorder.calls if c.phase == "backward" and c.shape == (64, 256) and c.k == 48)
    plain = GemmInjector()
    one_step("gpt2", "attention", plain)
    index = [c for c in plain.calls if c.phase == "backward" and c.shape == target.shape][0].index
    grads, finite, detections = one_step("gpt2", "attention", GemmInjector(target=index, kind="inf"))
    assert not finite and not detections


def test_close_restores_every_linear_forward() -> None:
    model = build("llama")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    guard = attnchecker.protect(model, scope="all")
    assert all("forward" in vars(m) for m in linears)
    assert {s.integration for s in guard.sites} >= {"linear"}
    assert sum(s.integration == "linear" for s in guard.sites) == len(linears)
    guard.close()
    assert not any("forward" in vars(m) for m in linears)


def test_a_step_that_does_not_check_out_runs_the_plain_linear() -> None:
    """gemm_due follows the out op's schedule: with out pinned to every 2nd step, step 1 makes no linear checks."""
    model = build("gpt2")
    guard = attnchecker.protect(model, policy=Policy(op_periods={"out": 2}, adaptive=False), scope="all")
    for _ in range(2):
        loss_of("gpt2", model, batch("gpt2", 0)).backward()
        guard.step()
    checks = guard.report().checks
    # Step 0 checks each of the 2 layers' c_fc/c_proj MLP GEMMs and the lm_head once; step 1 none.
    assert checks["linear"] == 5
    assert checks["linear_dw"] == checks["linear_dx"] > 0
    guard.close()


def test_unknown_scope_is_refused() -> None:
    with pytest.raises(ValueError, match="scope must be 'attention' or 'all'"):
        attnchecker.protect(build("gpt2"), scope="mlp")


@pytest.mark.parametrize("arch", ZOO)
def test_clean_training_under_scope_all_matches_unprotected_and_flags_nothing(arch: str) -> None:
    model = build(arch)
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    result = train(arch, model, 3, on_step=guard.step)
    reference = train(arch, build(arch), 3)
    assert not guard.detections
    assert guard.report().checks.get("linear_dw", 0) > 0
    assert result.finite_weights
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(result.losses, reference.losses, strict=True))
    guard.close()


@pytest.mark.parametrize("arch", ("gpt2", "llama"))
def test_bf16_autocast_under_scope_all_flags_nothing_and_trains(arch: str) -> None:
    model = build(arch)
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    result = train(arch, model, 3, on_step=guard.step, autocast=torch.bfloat16)
    assert not guard.detections, [(d.op, d.layer, d.residual, d.bound) for d in guard.detections[:5]]
    assert guard.report().checks.get("linear", 0) > 0
    assert result.finite_weights and all(math.isfinite(x) for x in result.losses)
    guard.close()


@pytest.mark.parametrize("pattern", ("row", "col"))
def test_a_corrupted_row_or_column_is_located_with_one_fast_direction(pattern: str) -> None:
    """A clean check verifies one direction only (gemm.check.FAST_DIRECTIONS); a whole corrupted row (or column) of
    a forward, input-gradient and weight-gradient GEMM needs the direction across it to be located, which the slow
    path computes after the flag. Each is corrected in place (not recomputed: one direction alone would see several
    faults in one vector and fall back to recomputing) to the fault-free gradients."""
    recorder = GemmInjector()
    clean, _, _ = one_step("gpt2", "all", recorder)
    targets = model_gemms("gpt2", recorder.calls)
    # GPT-2's MLP c_fc: forward (48, 256), input gradient (48, 64), weight gradient (64, 256), over 48 tokens.
    picks = [next(c for c in targets if c.phase == phase and c.shape == shape)
             for phase, shape in (("forward", (48, 256)), ("backward", (48, 64)), ("backward", (64, 256)))]
    for n, call in enumerate(picks):
        inj = GemmInjector(target=call.index, kind=("inf", "bitflip", "near_inf")[n], element=5 + 17 * n,
                           pattern=pattern)
        grads, finite, detections = one_step("gpt2", "all", inj)
        assert inj.hit == call
        assert finite and detections and worst_rel(grads, clean) <= 1e-5, (call, detections)
        assert [(d.action, d.pattern) for d in detections] == [("corrected", "1d")], detections


class _ScaledLinear(nn.Linear):
    """A Linear subclass with a forward of its own (as quantized layers have): x Wᵀ + b is not what it computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * super().forward(x)


def test_a_linear_subclass_with_its_own_forward_keeps_it_and_is_listed_unprotected(caplog) -> None:
    """scope="all" replaces a Linear's forward by the checked x Wᵀ + b; a subclass that computes something else keeps
    its own forward (the model computes what it did unprotected) and is listed in Guard.coverage, with a warning."""
    model = build("gpt2")
    mlp = model.transformer.h[0].mlp
    mlp.extra = _ScaledLinear(64, 64)
    inner = mlp.forward
    mlp.forward = lambda x: mlp.extra(inner(x))  # the custom layer on the model's path
    x = batch("gpt2", 0)
    want = loss_of("gpt2", model, x).detach()
    with caplog.at_level("WARNING", logger="attnchecker"):
        guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    try:
        assert "transformer.h.0.mlp.extra" in caplog.text
        assert "forward" not in vars(mlp.extra)  # not wrapped
        gaps = [e for e in guard.coverage.unprotected if e.name == "transformer.h.0.mlp.extra"]
        assert {e.op for e in gaps} == {"linear", "linear_dx", "linear_dw"}
        got = loss_of("gpt2", model, x).detach()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        guard.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fp16_gradscaler_overflow_steps_are_not_faults(arch: str) -> None:
    """fp16 autocast with GradScaler at a high initial scale: its first steps' backward GEMMs overflow fp16 on purpose
    (the scaler skips those steps and lowers the scale). Under scope="all" these are no faults: no event, and the run
    is the unprotected one, step for step (the same losses and final scale)."""

    def run(scope: str | None) -> tuple[list[float], float, list]:
        model = build(arch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
        guard = attnchecker.protect(model, optimizer=opt, scope=scope) if scope else None
        losses = []
        for step in range(8):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(arch, model, batch(arch, step))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
        detections = list(guard.detections) if guard else []
        if guard:
            guard.close()
        return losses, scaler.get_scale(), detections

    want, want_scale, _ = run(None)
    got, scale, detections = run("all")
    assert detections == []
    assert scale == want_scale < 2.0**24  # the scaler did back off: overflow steps happened
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_an_inf_in_a_half_gemm_is_still_a_fault_where_the_exact_value_fits(dtype: torch.dtype) -> None:
    """The overflow rule only excuses INF where the exact product is past the dtype's range: a planted INF over an
    ordinary value is corrected, an INF the exact product gives is left alone. bf16 reaches its range (3.4e38) only in
    diverged training: the clean campaign's bf16 `outliers` run, whose weight gradient of ~1e37 activations overflowed
    and was reported near-INF and uncorrectable."""
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
    from attnchecker.gemm.check import _overflowed, check_gemms

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=gen).to(dtype), torch.randn(32, 24, generator=gen).to(dtype)
    c = (a.float() @ b.float()).to(dtype)
    want = c.clone()
    c[3, 5] = float("inf")
    assert not _overflowed(c, a, b, None)
    ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig(), stats=OpStats()))
    assert check_gemms(ctx, [("linear_dw", c, a, b, None)]) == 1
    torch.testing.assert_close(c, want)
    # Finite operands whose products pass the dtype's largest value in places (fp16 ~1e5 > 65504, bf16 ~1e39).
    big_a, big_b = (a * 4000, b * 4) if dtype == torch.float16 else (a * 1e20, b * 1e19)
    assert bool(torch.isfinite(big_a).all() and torch.isfinite(big_b).all())
    c_big = (big_a.double() @ big_b.double()).to(dtype)
    assert not bool(torch.isfinite(c_big).all())
    assert _overflowed(c_big, big_a, big_b, None)
    assert check_gemms(ctx, [("linear_dw", c_big, big_a, big_b, None)]) == 0


@pytest.mark.parametrize("scale", [1e17, 1e18])
def test_huge_finite_products_of_diverged_bf16_training_are_not_faults(scale: float, make_ctx) -> None:
    """A diverged bf16 run computes gradients of 1e35-1e37, which bf16 holds (up to 3.4e38). Their fp32 checksums,
    weighted by 1..n, overflow, and INF - INF flagged the correct product as near-INF and uncorrectable (the clean
    campaign's bf16 `outliers` run). Summed in float64 the product is consistent: not reported. A fault in such a
    product is still reported."""
    from attnchecker.gemm.check import check_gemms

    g = torch.Generator().manual_seed(0)
    a = (torch.randn(64, 512, generator=g) * scale).bfloat16()
    b = (torch.randn(512, 256, generator=g) * scale).bfloat16()
    c = (a.float() @ b.float()).bfloat16()  # as a bf16 GEMM computes it: fp32 accumulation, one rounding
    assert bool(torch.isfinite(c).all()) and float(c.float().abs().max()) > 1e35
    ctx, rec = make_ctx()
    assert check_gemms(ctx, [("linear_dw", c, a, b, None)]) == 0
    assert rec.detections == []
    bad = c.clone()
    bad[3, 5] = (bad[3, 5].float() + 0.5 * c.float().abs().max()).bfloat16()
    assert check_gemms(ctx, [("linear_dw", bad, a, b, None)]) == 1
    (det,) = rec.detections
    assert (det.op, det.kind) == ("linear_dw", "near_inf")
