"""PEFT LoRA on the attention projections (unmodified peft LoraLayer on transformers models built from configs with
random weights, and on the nanoGPT-style SDPA model): the projections stay protected, checked against the effective
product, with and without LoRA dropout, merged and unmerged. Faults injected below autograd (gemm_faults) into
the base GEMM, the adapter's A and B GEMMs of a projection are corrected, with loss and gradients equal to the
fault-free step."""

from __future__ import annotations

import math

import pytest
import torch
from gemm_faults import GemmFault, GemmFaults, gemm_shapes
from gemm_injector import GemmInjector, is_model_gemm, worst_rel
from hypothesis import given, settings
from hypothesis import strategies as st
from model_zoo import BATCH, SEQ, batch, build, injected_step, loss_of

import attnchecker

peft = pytest.importorskip("peft", reason="peft is an optional extra: pip install attnchecker[peft]")

TARGETS = {
    "gpt2": ["c_attn", "c_proj"],  # Conv1D (fan_in_fan_out); the MLP's c_proj is wrapped too (and not checked)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "nanogpt": ["c_attn", "c_proj"],
}
RANK = 4
VALUES = {"inf": math.inf, "nan": math.nan, "near_inf": 1e20}


def lora_model(arch: str, *, dropout: float = 0.0, merged: bool = False, seed: int = 0) -> torch.nn.Module:
    model = build(arch, seed=seed)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=6, target_modules=TARGETS[arch], lora_dropout=dropout,
                          init_lora_weights=False, fan_in_fan_out=arch == "gpt2")
    torch.manual_seed(seed + 1)
    wrapped = peft.get_peft_model(model, cfg)
    if merged:
        wrapped.merge_adapter()
        # Merged, the adapters never run and the base is frozen: train the merged weights so there are gradients.
        for p in wrapped.parameters():
            p.requires_grad_(True)
    return wrapped.train()


def step(arch: str, model: torch.nn.Module, faults: list[GemmFault] | None = None):
    """One forward + backward on a fixed batch and a fixed RNG (LoRA dropout draws the same masks every time)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    b = batch(arch, 0)
    hits = None
    if faults is None:
        loss = loss_of(arch, model, b)
    else:
        with GemmFaults(faults) as mode:
            loss = loss_of(arch, model, b)
        hits = mode.hits
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, hits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖₂ / ‖b‖₂ (the protected attention's forward and backward round differently from SDPA's kernel)."""
    diff = torch.linalg.vector_norm(a.double() - b.double())
    return float(diff / torch.linalg.vector_norm(b.double()).clamp_min(1e-30))


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize(("dropout", "merged"), [(0.0, False), (0.1, False), (0.0, True)])
def test_lora_projections_stay_protected_on_clean_data(arch, dropout, merged) -> None:
    model = lora_model(arch, dropout=dropout, merged=merged)
    want_loss, want, _ = step(arch, model)
    with attnchecker.protect(model) as guard:
        ops = {op for site in guard.sites for op in site.ops}
        assert {"q", "k", "v", "scores", "context", "out"} <= ops
        got_loss, got, _ = step(arch, model)
        rep = guard.report()
    assert rep.detected == 0, guard.detections[:1]
    # Every layer checked q/k/v/out once (plus each adapter's A when unmerged, counted under the projection's op).
    assert rep.checks["out"] >= 2
    assert rep.checks["q"] >= 2
    assert rel(got_loss, want_loss) <= 1e-6
    assert set(got) == set(want)
    assert any("lora_B" in n for n in got) or merged
    # The protected attention (unfused forward, flash backward) rounds differently from SDPA's kernel: ~1e-6 on the
    # q/k weight gradients of Llama (RoPE, GQA) with or without LoRA.
    for n in want:
        assert rel(got[n], want[n]) <= 1e-5, n


def _lora_gemms(arch: str, model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Output shapes of the three GEMMs of layer 0's first LoRA projection: base, A (rank r) and B."""
    shapes = [s for _, s in gemm_shapes(lambda: loss_of(arch, model, batch(arch, 0)))]
    n = BATCH * SEQ
    out_q = {"gpt2": 3 * 64, "llama": 64, "nanogpt": 3 * 64}[arch]
    assert (n, RANK) in shapes
    assert (n, out_q) in shapes
    return {"base": (n, out_q), "A": (n, RANK), "B": (n, out_q)}


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("where", ["base", "A", "B"])
@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_fault_corrected_loss_and_grads_equal_fault_free(arch, where, kind, dropout) -> None:
    model = lora_model(arch, dropout=dropout)
    shapes = _lora_gemms(arch, model)
    want_loss, want, _ = step(arch, model)
    # base and B have the same (N, O) shape: the first such GEMM is the base product, the second is B's.
    nth = 1 if where == "B" else 0
    fault = GemmFault(shapes[where], VALUES[kind], index=5 * shapes[where][1] + 1, nth=nth)
    with attnchecker.protect(model) as guard:
        # Under the injector's dispatch mode too, with nothing to inject: the engine keeps its PyTorch paths under any
        # dispatch mode (the native attention pass is no aten op), so both steps take the same attention path.
        clean_loss, clean, _ = step(arch, model, [])
        got_loss, got, hits = step(arch, model, [fault])
        rep = guard.report()
    assert hits, "the injector hit nothing"
    assert rep.detected >= 1, guard.detections
    assert rep.uncorrectable == 0, guard.detections
    # Equal to the protected fault-free step (the correction restores the product to round-off), and so to the
    # unprotected one within the attention kernels' own rounding difference.
    assert rel(got_loss, clean_loss) <= 1e-6
    assert rel(got_loss, want_loss) <= 1e-6
    for n in want:
        assert torch.isfinite(got[n]).all(), n
        assert rel(got[n], clean[n]) <= 1e-6, (n, rel(got[n], clean[n]))
        assert rel(got[n], want[n]) <= 1e-5, (n, rel(got[n], want[n]))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_merged_lora_fault_in_the_merged_gemm_is_corrected(arch) -> None:
    model = lora_model(arch, merged=True)
    n = BATCH * SEQ
    out_q = {"gpt2": 3 * 64, "llama": 64}[arch]
    with attnchecker.protect(model) as guard:
        clean_loss, clean, _ = step(arch, model)
        got_loss, got, hits = step(arch, model, [GemmFault((n, out_q), math.nan, index=7)])
        rep = guard.report()
    assert hits
    assert rep.detected >= 1
    assert rep.uncorrectable == 0
    assert rel(got_loss, clean_loss) <= 1e-6
    for name in clean:
        assert rel(got[name], clean[name]) <= 1e-6, name


def test_unprotected_lora_fault_poisons_the_step() -> None:
    """The same injection without protection: the loss is not finite (the test above cannot pass by hitting nothing
    that matters)."""
    model = lora_model("llama")
    shapes = _lora_gemms("llama", model)
    loss, _, hits = step("llama", model, [GemmFault(shapes["A"], math.inf, index=3)])
    assert hits
    assert not torch.isfinite(loss)


def test_lora_under_autocast_bf16_has_no_false_positive() -> None:
    model = lora_model("llama", dropout=0.1)
    cfg_scaling = {m.scaling["default"] for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)}
    assert cfg_scaling == {6 / RANK}  # 1.5: not a power of two, so s·z rounds
    with attnchecker.protect(model) as guard:
        for i in range(3):
            torch.manual_seed(i)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of("llama", model, batch("llama", i))
            loss.backward()
        rep = guard.report()
    assert rep.checks["q"] >= 6
    assert rep.detected == 0, guard.detections[:1]


def test_dora_is_left_unprotected_and_said_so() -> None:
    model = build("llama")
    cfg = peft.LoraConfig(r=RANK, target_modules=["q_proj", "v_proj"], use_dora=True)
    model = peft.get_peft_model(model, cfg)
    with attnchecker.protect(model) as guard:
        ops = {op for site in guard.sites for op in site.ops}
    assert "q" not in ops
    assert "v" not in ops
    assert "k" in ops


class _Proj(torch.nn.Module):
    def __init__(self, i: int, o: int, bias: bool) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(i, o, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)


@given(
    i=st.integers(8, 96),
    o=st.integers(4, 96),
    r=st.integers(1, 16),
    alpha=st.floats(0.5, 64.0),
    bias=st.booleans(),
    lora_bias=st.booleans(),
    dropout=st.sampled_from([0.0, 0.3]),
    dtype=st.sampled_from(["fp32", "bf16", "autocast_bf16", "fp16"]),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60)
def test_property_lora_effective_product_has_no_false_positive(
    make_ctx, i, o, r, alpha, bias, lora_bias, dropout, dtype, scale, seed
) -> None:
    """One LoRA Linear checked through Binder.hook_projection on clean data: never flagged, output untouched, across
    shapes, ranks, scalings, dtypes (bf16/fp16 models, bf16 autocast), dropout and an adapter bias."""
    from attnchecker.integrations._common import Binder

    torch.manual_seed(seed)
    model = _Proj(i, o, bias)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"], lora_dropout=dropout,
                          init_lora_weights=False, lora_bias=lora_bias)
    model = peft.get_peft_model(model, cfg).train()
    x = torch.randn(2, 7, i) * scale
    if dtype in ("bf16", "fp16"):
        half = torch.bfloat16 if dtype == "bf16" else torch.float16
        model, x = model.to(half), x.to(half)
    layer = model.base_model.model.q_proj
    ctx, rec = make_ctx()
    binder = Binder(ctx.runtime)
    binder.hook_projection(layer, ctx, op="q")
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast_bf16"):
        got = model(x)
    binder.undo_all()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "autocast_bf16"):
        want = model(x)
    assert not rec.detections, rec.detections[:1]
    assert ctx.runtime.stats.checks["q"] == 2  # A's output and the effective product
    assert torch.equal(got, want)


def test_mixed_adapter_batch_is_a_counted_fallback() -> None:
    """adapter_names= gives each adapter a sub-batch: the call runs unchecked, and the coverage map says so."""
    from attnchecker.integrations._common import Binder

    torch.manual_seed(0)
    model = peft.get_peft_model(_Proj(16, 8, True), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.eval()
    layer = model.base_model.model.q_proj
    binder = Binder(attnchecker.checks.context.Runtime(step=0, stats=attnchecker.checks.context.OpStats()))
    ctx = binder.new_context()
    binder.add_site(ctx, "q_proj", "sdpa", ("q",), paths={"q": binder.hook_projection(layer, ctx, op="q")})
    layer(torch.randn(2, 3, 16), adapter_names=["default", "__base__"])
    cov = binder.coverage()
    binder.undo_all()
    reason = "peft LoRA call with adapter_names= (mixed-adapter batch) runs unchecked"
    assert cov.fallbacks == {(0, "q", reason): 1}
    assert ctx.runtime.stats.checks["q"] == 0


@pytest.mark.parametrize("mode", ["off", "skip"])
def test_lora_hook_does_nothing_when_nothing_is_due(make_ctx, mode) -> None:
    """Mode off, or a step whose schedule checks neither op: no check runs and the output is the module's own."""
    from attnchecker.integrations._common import Binder

    torch.manual_seed(0)
    model = peft.get_peft_model(_Proj(16, 8, True), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    x = torch.randn(2, 3, 16)
    want = model(x)
    config = {"mode": "off"} if mode == "off" else {"checked_ops": frozenset({"scores"})}
    ctx, rec = make_ctx(**config)
    binder = Binder(ctx.runtime)
    binder.hook_projection(model.base_model.model.q_proj, ctx, op="q")
    got = model(x)
    binder.undo_all()
    assert torch.equal(got, want)
    assert ctx.runtime.stats.checks["q"] == 0
    assert not rec.detections


ALL_SCOPE_RANK = 6
"""A LoRA rank no checksum product shares a shape with (those have 1, 2 or 2·g columns), so the adapter's GEMMs are
told apart from the checks' own products by shape alone."""


def _lora_all_scope_step(arch: str, mode: GemmInjector, *, scope: str | None = "all", eager: bool = False
                         ) -> tuple[dict[str, torch.Tensor], bool, list]:
    """One SGD step of a LoRA model (every Linear of attention and MLP adapted, the base frozen) under ``mode``:
    (gradients, weights finite after the step, detections). scope None: unprotected."""
    targets = {"gpt2": ["c_attn", "c_proj", "c_fc"],
               "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}[arch]
    model = build(arch)
    cfg = peft.LoraConfig(r=ALL_SCOPE_RANK, lora_alpha=6, target_modules=targets, init_lora_weights=False,
                          fan_in_fan_out=arch == "gpt2")
    torch.manual_seed(1)
    model = peft.get_peft_model(model, cfg).train()
    if eager:
        model.base_model.model.set_attn_implementation("eager")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    guard = attnchecker.protect(model, optimizer=opt, scope=scope) if scope else None
    try:
        grads = injected_step(arch, model, opt, mode)
        return grads, all(bool(torch.isfinite(p).all()) for p in model.parameters()), list(
            guard.detections) if guard else []
    finally:
        if guard:
            guard.close()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_adapter_gemms_are_corrected_under_scope_all(arch: str) -> None:
    """protect(scope="all") on a LoRA model: the adapters' own GEMMs (x·Aᵀ, (x·Aᵀ)·Bᵀ forward; their dX and dW, the
    only weight gradients a LoRA step makes) are ordinary Linear GEMMs to the whole-step checks. Each one, hit by
    the shape-chosen injector below autograd (INF, NaN, 3e20, an exponent flip), is corrected: the adapter gradients
    equal the fault-free step's, the weights stay finite."""
    recorder = GemmInjector()
    clean, finite, detections = _lora_all_scope_step(arch, recorder)
    assert finite and not detections
    plain, _, _ = _lora_all_scope_step(arch, GemmInjector(), scope=None)
    assert worst_rel(clean, plain) <= 1e-5
    signatures = GemmInjector()
    _lora_all_scope_step(arch, signatures, scope=None, eager=True)
    lora_shaped = {(c.shape, c.k) for c in signatures.calls
                   if is_model_gemm(c) and (ALL_SCOPE_RANK in c.shape or c.k == ALL_SCOPE_RANK)}
    targets = [c for c in recorder.calls if (c.shape, c.k) in lora_shaped]
    assert {c.phase for c in targets} == {"forward", "backward"}
    failures = []
    for n, call in enumerate(targets):
        kind = ("inf", "nan", "near_inf", "bitflip")[n % 4]
        inj = GemmInjector(target=call.index, kind=kind, element=7 + 13 * n)
        grads, finite, detections = _lora_all_scope_step(arch, inj)
        assert inj.hit == call
        worst = worst_rel(grads, clean)
        if not (finite and worst <= 1e-5 and detections
                and all(d.action in ("corrected", "recomputed") for d in detections)):
            failures.append((call, kind, worst, [(d.op, d.action) for d in detections]))
    assert not failures, failures
