"""The attention backward with attention dropout under protect(scope="all") (attention/backward/unfused.py): the fused kernel
cannot replay the protected softmax's keep-mask, so autograd differentiates the unfused graph, and its four GEMMs
(dQ, dK, dAP, dV) are checked like a Linear layer's. Faults come from a TorchDispatchMode below autograd
(gemm_injector), chosen by shape: the model's attention products, never the checks' own skinny ones."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from gemm_injector import GemmInjector, worst_rel
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from model_zoo import BATCH, SEQ, batch, build, loss_of
from quiet_period import step_until_due_after_quiet

import attnchecker
from attnchecker import Policy

DROPOUT: dict[str, dict[str, Any]] = {"gpt2": {"attn_pdrop": 0.1}, "llama": {"attention_dropout": 0.1},
                                      "bert": {"attention_probs_dropout_prob": 0.1}}
"""Each model's attention dropout at the value its library defaults to (GPT-2 and BERT: 0.1)."""
HEADS, HEAD_DIM, LAYERS = 4, 16, 2
KINDS = ("inf", "nan", "near_inf", "bitflip")
BACKWARD_OPS = {"grad_q", "grad_k", "grad_v", "grad_probs"}


def _attention_shapes() -> set[tuple[int, ...]]:
    """The attention products' output shapes in backward (B·H batched): dAP (T, S), dQ/dK/dV (T or S, D)."""
    return {(BATCH * HEADS, SEQ, SEQ), (BATCH * HEADS, SEQ, HEAD_DIM)}


def _step(arch: str, model: torch.nn.Module, injector: GemmInjector | None = None
          ) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward on the fixed batch, the dropout keep-mask fixed by the seed (the same in every run)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    b = batch(arch, 0)
    if injector is None:
        loss = loss_of(arch, model, b)
        loss.backward()
    else:
        with injector:
            loss = loss_of(arch, model, b)
            injector.phase = "backward"
            loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", sorted(DROPOUT))
def test_every_attention_backward_gemm_under_dropout_is_corrected(arch: str) -> None:
    model = build(arch, **DROPOUT[arch])
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    recorder = GemmInjector()
    want_loss, want = _step(arch, model, recorder)
    targets = [c for c in recorder.calls
               if c.phase == "backward" and c.op == "bmm" and c.shape in _attention_shapes()]
    assert len(targets) == 4 * LAYERS, [(c.shape, c.k) for c in targets]
    seen: list[str] = []
    for i, call in enumerate(targets):
        before = len(guard.detections)
        injector = GemmInjector(target=call.index, kind=KINDS[i % len(KINDS)], element=5 + 11 * i)
        loss, grads = _step(arch, model, injector)
        assert injector.hit is not None
        events = guard.detections[before:]
        # Backward runs the last layer first.
        layer = LAYERS - 1 - i // 4
        assert [(e.op in BACKWARD_OPS, e.action, e.layer) for e in events] == [(True, "corrected", layer)], events
        seen.append(events[0].op)
        assert loss == want_loss
        assert worst_rel(grads, want) <= 1e-5, (call, events)
    # Each layer's four products, each hit once.
    assert sorted(seen) == sorted(list(BACKWARD_OPS) * LAYERS)
    guard.close()


def test_the_gradients_of_a_clean_step_are_the_unprotected_models() -> None:
    """The checked products are the same GEMMs autograd runs: with the same keep-mask, the unprotected and the
    protected step's gradients agree to round-off (the protected softmax draws its own mask from the same seed)."""
    plain = build("gpt2", **DROPOUT["gpt2"])
    protected = build("gpt2", **DROPOUT["gpt2"])
    guard = attnchecker.protect(protected, policy=Policy.full(), scope="all")
    _, want = _step("gpt2", plain)
    _, grads = _step("gpt2", protected)
    assert guard.report().checks["grad_q"] == LAYERS  # the unfused backward was checked, not left to autograd
    assert not guard.detections
    assert worst_rel(grads, want) <= 1e-5
    guard.close()


def test_after_a_quiet_period_the_scheduled_full_check_corrects_the_attention_backward_under_dropout() -> None:
    """The default policy, the path a long clean run takes: the first full check after the schedule went quiet
    checks the dropout attention's backward too."""
    model = build("gpt2", **DROPOUT["gpt2"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all")

    def step(_due: bool) -> None:
        _step("gpt2", model)
        opt.step()

    step_until_due_after_quiet(guard, step, op="out")
    recorder = GemmInjector()
    _, want = _step("gpt2", model, recorder)  # the due step, fault-free: its full check runs, nothing to find
    opt.step()
    assert not guard.detections
    step_until_due_after_quiet(guard, step, op="out")
    target = next(c for c in recorder.calls
                  if c.phase == "backward" and c.op == "bmm" and c.shape == (BATCH * HEADS, SEQ, HEAD_DIM))
    injector = GemmInjector(target=target.index, kind="inf", element=3)
    _, grads = _step("gpt2", model, injector)
    opt.step()
    assert [(e.op in BACKWARD_OPS, e.action) for e in guard.detections] == [(True, "corrected")]
    assert worst_rel(grads, want) <= 1e-5
    guard.close()


def _reference_probs(scores: torch.Tensor, scale: float, mask: torch.Tensor | None, causal: bool,
                     keep: torch.Tensor | None) -> torch.Tensor:
    """scale, mask, safe softmax and dropout as separate autograd ops: what the Function replaces."""
    s = scores * scale
    t, k = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(t, k, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    probs = torch.softmax(s, dim=-1)
    probs = torch.where(torch.isnan(probs), 0.0, probs)  # rows with every key masked: 0, as SDPA
    return probs if keep is None else probs * keep


@settings(max_examples=40, deadline=None)
@given(t=st.integers(1, 12), s=st.integers(1, 12), causal=st.booleans(), mask=st.sampled_from(["none", "pad", "add"]),
       p=st.sampled_from([0.0, 0.1, 0.5]), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_the_softmax_dropout_function_gives_autograds_values_and_gradients(t: int, s: int, causal: bool, mask: str,
                                                                            p: float, dtype: torch.dtype,
                                                                            seed: int) -> None:
    from attnchecker.attention.backends.unfused import _probs_lse

    assume(not (causal and mask != "none"))  # SDPA refuses a mask together with is_causal
    g = torch.Generator().manual_seed(seed)
    scores = (3 * torch.randn(2, 3, t, s, generator=g, dtype=dtype)).requires_grad_()
    attn_mask = None
    if mask == "pad":  # key padding, the first row of batch 0 with every key masked
        attn_mask = torch.rand(2, 1, t, s, generator=g) > 0.3
        attn_mask[0, 0, 0] = False
    elif mask == "add":
        attn_mask = torch.randn(2, 1, t, s, generator=g, dtype=dtype)
    keep = None if p == 0.0 else (torch.rand(2, 3, t, s, generator=g) > p).to(dtype) / (1 - p)
    grad = torch.randn(2, 3, t, s, generator=g, dtype=dtype)
    got, _, _ = _probs_lse(scores, scale=0.3, attn_mask=attn_mask, is_causal=causal, dropout_p=p, keep_BHTS=keep)
    assert got.grad_fn is not None and "SoftmaxDropout" in type(got.grad_fn).__name__
    (d_got,) = torch.autograd.grad(got, scores, grad)
    want = _reference_probs(scores, 0.3, attn_mask, causal, keep)
    (d_want,) = torch.autograd.grad(want, scores, grad)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(d_got, d_want, **tol)


@pytest.mark.parametrize(("phase", "shape"), [("forward", (BATCH * HEADS, SEQ, SEQ)),
                                              ("backward", (BATCH * HEADS, SEQ, HEAD_DIM))])
def test_on_a_tier1_step_a_fault_in_the_dropout_attention_is_caught_and_corrected(phase: str,
                                                                                  shape: tuple[int, ...]) -> None:
    """The default policy's steps between full checks: a dropout attention runs the unfused path there (SDPA would
    run its math backend, which materialises the same products), so tier 1 sees AS itself and the backward GEMMs,
    and a trip's full check corrects the fault where SDPA's own backward would hand the INF to the optimizer."""
    model = build("gpt2", **DROPOUT["gpt2"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, scope="all")

    def step(injector: GemmInjector | None = None) -> dict[str, torch.Tensor]:
        _, grads = _step("gpt2", model, injector)
        opt.step()
        return grads

    def to_a_tier1_step() -> None:
        while guard.check_config.checks("out"):
            step()
        assert guard.check_config.trips("out")

    step()  # the first step checks everything
    to_a_tier1_step()
    recorder = GemmInjector()
    want = step(recorder)
    assert not guard.detections
    target = next(c for c in recorder.calls if c.phase == phase and c.op == "bmm" and c.shape == shape)
    to_a_tier1_step()
    injector = GemmInjector(target=target.index, kind="inf", element=9)
    grads = step(injector)
    assert injector.hit is not None
    ops = {"scores"} if phase == "forward" else BACKWARD_OPS
    assert [(e.op in ops, e.action, e.tier) for e in guard.detections] == [(True, "corrected", "tripwire")]
    assert worst_rel(grads, want) <= 1e-5
    guard.close()


def test_at_a_7b_head_dim_and_t_1024_a_clean_dropout_step_flags_nothing_and_a_fault_is_corrected() -> None:
    """Realistic shapes for the unfused backward's bounds: head dim 128, T = S = 1024 (dS and AP 4 × 1024 × 1024 per
    layer), dropout 0.1, Policy.full(). The clean step's gradients are the unprotected model's (same keep-mask seed),
    with no detection; an INF in its dK is corrected."""
    heads, t = 4, 1024
    cfg = {**DROPOUT["gpt2"], "n_embd": heads * 128, "n_head": heads, "n_layer": 1, "n_positions": t}
    ids = torch.randint(2, 128, (1, t), generator=torch.Generator().manual_seed(5))

    def run(model: torch.nn.Module, injector: GemmInjector | None = None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        with injector if injector is not None else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
            if injector is not None:
                injector.phase = "backward"
            loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    want = run(build("gpt2", **cfg))
    model = build("gpt2", **cfg)
    guard = attnchecker.protect(model, policy=Policy.full(), scope="all")
    recorder = GemmInjector()
    clean = run(model, recorder)
    assert not guard.detections and guard.report().checks["grad_k"] == 1
    assert worst_rel(clean, want) <= 1e-5
    # dV, dQ and dK are all (H, T, 128); autograd runs the context's backward first, then the scores': dK is last.
    same_shape = [c for c in recorder.calls if c.phase == "backward" and c.op == "bmm" and c.shape == (heads, t, 128)]
    injector = GemmInjector(target=same_shape[-1].index, kind="inf", element=123_457)
    grads = run(model, injector)
    assert [(e.op, e.action) for e in guard.detections] == [("grad_k", "corrected")]
    assert worst_rel(grads, clean) <= 1e-5
    guard.close()
