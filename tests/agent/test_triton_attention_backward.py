"""The checked attention backward's Triton kernels (kernels/triton_attention_bwd.py) through the engine's glue
(attention/backward/triton_backward.py), run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, which
conftest.py sets when there is no CUDA device).

Clean: dQ, dK, dV equal autograd's through the math reference (the same regenerated dropout mask), for every mask,
GQA and dtype, and nothing is flagged. Faulty: an emulated fault in each of the backward's products (the kernels'
products reach no TorchDispatchMode) is flagged, its block recomputed, and the gradients are the fault-free ones,
bit for bit. And the fast path's claims: a constant number of launches whatever T, no host-device sync.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sync_counter import SyncCounter
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.attention.backward import triton_backward
from attnchecker.checks.deferred import drain
from attnchecker.kernels import triton_attention_bwd as kernels
from attnchecker.kernels.triton_dropout import keep_mask

if not kernels.available():
    pytest.skip("the Triton kernels cannot run here (no CUDA, and the interpreter is off)", allow_module_level=True)

# The interpreter's numpy warnings (overflow in exp, INF - INF) are what the injected faults do.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

KernelFault = triton_backward.KernelFault
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, window: int | None,
              mask: torch.Tensor | None, p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale·QKᵀ + mask)·V through the math, in fp32 from the operands as given, GQA by repeating K and V,
    dropout with the kernels' mask for ``seed``: (out, lse), lse +INF on a row with every key masked."""
    b, h, t, _ = q.shape
    hk, s = k.shape[1], k.shape[2]
    k32, v32 = (x.float().repeat_interleave(h // hk, 1) for x in (k, v))
    z = (q.float() @ k32.mT) * scale
    i, j = torch.arange(t)[:, None], torch.arange(s)[None, :]
    seen = torch.ones(t, s, dtype=torch.bool)
    if causal:
        seen &= j <= i
    if window is not None:
        seen &= i - j < window
    z = z.masked_fill(~seen, -math.inf)
    if mask is not None:
        z = z.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else z + mask.float()
    lse = torch.logsumexp(z, -1)
    probs = torch.softmax(z, -1)
    if p > 0:
        probs = probs * keep_mask(seed, (b, h, t, s), p, q.device) / (1 - p)
    return probs @ v32, torch.where(torch.isfinite(lse), lse, math.inf).detach()


def make(dtype: torch.dtype, *, b: int = 1, h: int = 2, hk: int = 1, t: int = 40, s: int = 40, d: int = 24,
         mask: str = "causal", p: float = 0.0, seed: int = 0, window: int = 7, v_scale: float = 1.0,
         do_max: float | None = None) -> dict[str, Any]:
    """One call's inputs as a forward hands them to the backward, and autograd's gradients through ``reference``
    (fp32, from the operands as given). v_scale: V's; do_max: dO scaled to that largest |element|."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, hk, s, d, generator=g).to(dtype)
    v = (torch.randn(b, hk, s, d, generator=g) * v_scale).to(dtype)
    attn_mask = None
    if mask == "padding":  # key padding: every row keeps its first key
        keep = torch.rand(b, 1, 1, s, generator=g) > 0.3
        keep[..., 0] = True
        attn_mask = keep
    elif mask == "additive":  # a relative bias (ALiBi / T5 style)
        attn_mask = (torch.randn(1, h, t, s, generator=g) * 2).to(dtype)
    how = {"scale": 1 / math.sqrt(d), "causal": mask in ("causal", "window"),
           "window": window if mask == "window" else None, "mask": attn_mask, "p": p, "seed": seed + 1}
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    out32, lse = reference(*leaves, **how)
    do = torch.randn(out32.shape, generator=g)
    do = (do * (do_max / do.abs().max()) if do_max else do).to(dtype)
    grads = torch.autograd.grad(out32, leaves, do.float())
    return {"q": q, "k": k, "v": v, "out": out32.detach().to(dtype), "lse": lse, "do": do, "how": how,
            "want": grads}


def backward(a: dict[str, Any], ctx: Any, *, check: str = "abft", faults: list[KernelFault] | None = None,
             given: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    how = a["how"]
    return triton_backward.backward(a["q"], a["k"], a["v"], a["out"], a["lse"], a["do"], scale=how["scale"],
                                    is_causal=how["causal"], window=how["window"], attn_mask=how["mask"],
                                    dropout_p=how["p"], seed=how["seed"], check=check, faults=faults or [], ctx=ctx,
                                    given=given)


def close(got: tuple[torch.Tensor, ...], a: dict[str, Any], rel: float) -> bool:
    """Each gradient within rel of the largest element of autograd's, plus what its terms can reach (a gradient that
    is 0 in exact arithmetic is round-off through and through)."""
    def top(x: torch.Tensor) -> float:
        return float(torch.linalg.vector_norm(x.double(), dim=-1).max()) if x.numel() else 0.0

    size = a["how"]["scale"] * top(a["do"]) * top(a["v"]) * max(top(a["q"]), top(a["k"])) + top(a["do"])
    return all(bool((g.double() - w.double()).abs().max() <= rel * (float(w.double().abs().max()) + size))
               for g, w in zip(got, a["want"], strict=True))


# Autograd's fp32 gradient against the kernels': fp32 to round-off (the issue's ≤ 1e-5 relative); a half-precision
# call multiplies AP and dS in its dtype and rounds its outputs to it, as FlashAttention does.
REL = {torch.float32: 1e-5, torch.bfloat16: 4 * 2.0**-8, torch.float16: 4 * 2.0**-11}


@settings(max_examples=6, deadline=None)
@given(dtype=st.sampled_from(DTYPES), mask=st.sampled_from(["none", "causal", "window", "padding", "additive"]),
       group=st.sampled_from([1, 2]), b=st.integers(1, 2), t=st.integers(1, 64), extra=st.integers(0, 20),
       d=st.sampled_from([8, 16, 24, 32]), p=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 2**16))
def test_clean_gradients_equal_autograds_through_the_math_and_nothing_flags(
        make_ctx: Any, dtype: torch.dtype, mask: str, group: int, b: int, t: int, extra: int, d: int, p: float,
        seed: int) -> None:
    """B·H ≤ 4, T, S ≤ 64, D ≤ 32. S ≥ T: a causal or windowed row always keeps its own key (a row with none has no
    gradient to compare)."""
    hk = 1 if b == 2 else 2
    a = make(dtype, b=b, h=hk * group, hk=hk, t=t, s=min(64, t + extra), d=d, mask=mask, p=p, seed=seed,
             window=1 + seed % 9)
    ctx, rec = make_ctx()
    got = backward(a, ctx)
    drain(ctx.runtime.deferred)
    assert not rec.detections, rec.detections[:2]
    stats = ctx.runtime.stats
    assert all(stats.checks[op] == 1 for op in kernels.OPS)
    assert all(float(r) <= 1.0 for r in stats.residual_max.values()), stats.residual_max
    assert close(got, a, REL[dtype])


def test_a_seed_on_the_device_draws_the_same_dropout_mask(make_ctx: Any) -> None:
    """The forward keeps its dropout seed on the device (no copy to the host): the kernels read it there, and draw the
    mask an int seed draws."""
    a = make(torch.float32, t=24, s=24, d=16, mask="none", p=0.2)
    ctx, _ = make_ctx()
    want = backward(a, ctx)
    a["how"] = {**a["how"], "seed": torch.tensor([a["how"]["seed"]], dtype=torch.int64)}
    got = backward(a, ctx)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    assert close(got, a, REL[torch.float32])


@pytest.mark.skipif(not kernels.interpreting(), reason="counts device-function calls through the interpreter")
@pytest.mark.parametrize("dtype", DTYPES)
def test_half_precision_takes_the_tensor_core_references_and_both_forms_agree(
        make_ctx: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """bf16 and fp16 checked calls fold their references from tensor-core products with split parts
    (triton_checks.fold_parts; kernels.by_dot), fp32 calls never; with the tensor-core forms switched off
    (by_dot (0, 0)) the same call gives the same gradients, and neither form flags a clean call. Seen by counting the
    device function's calls (plain Python under the interpreter): fails where the launcher ignores by_dot."""
    from attnchecker.kernels import triton_checks as tc

    calls = []
    real = tc.fold_parts

    def counted(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(tc, "fold_parts", counted)
    a = make(dtype, t=40, s=40, d=24, mask="causal")
    ctx, rec = make_ctx()
    fast = backward(a, ctx)
    assert bool(calls) == (dtype != torch.float32)
    calls.clear()
    monkeypatch.setattr(kernels, "by_dot", lambda *_: (0, 0))
    plain = backward(a, ctx)
    assert not calls
    drain(ctx.runtime.deferred)
    assert not rec.detections, rec.detections[:2]
    assert all(torch.equal(x, y) for x, y in zip(fast, plain, strict=True))
    assert close(fast, a, REL[dtype])


@pytest.fixture(scope="module")
def faulty_call() -> dict[str, Any]:
    return _faulty(torch.float32)


@functools.cache
def _faulty(dtype: torch.dtype) -> dict[str, Any]:
    """GQA (2 query heads on 1 KV head), causal, T = S = 32: its clean gradients, and each product's RMS (a finite
    fault of 5 % of it is far above every bound and far below the tripwire)."""
    a = make(dtype, t=32, s=32)
    from attnchecker.checks.context import LayerContext, Runtime

    a["clean"] = backward(a, LayerContext(layer=0, runtime=Runtime()))
    q, k, v, do = (x.float() for x in (a["q"], a["k"], a["v"], a["do"]))
    scale = a["how"]["scale"]

    def rms(x: torch.Tensor) -> float:
        return float(x.square().mean().sqrt())

    a["rms"] = {"scores_bwd": rms(q @ k.mT), "grad_probs": rms(do @ v.mT), "grad_v": rms(a["clean"][2]),
                "grad_k": rms(a["clean"][1]) / scale, "grad_q": rms(a["clean"][0]) / scale}
    return a


PRODUCTS = [("scores_bwd", "keys"), ("scores_bwd", "queries"), ("grad_probs", "keys"), ("grad_probs", "queries"),
            ("grad_v", "keys"), ("grad_k", "keys"), ("grad_q", "queries")]
KINDS = {"inf": ("value", math.inf), "nan": ("value", math.nan), "near_inf": ("value", 1e20),
         "bitflip": ("bitflip", 0.0), "finite": ("add", 0.05)}
# Every product in both passes that makes it, each kind at least twice.
CASES = [(op, side, kind) for i, (op, side) in enumerate(PRODUCTS) for kind in (list(KINDS) * 3)[2 * i:2 * i + 2]]


def fault_at(op: str, side: str, kind: str, rms: float, persistent: bool = False) -> KernelFault:
    """Query head 1 (matrix n = 1) for S, dP and dQ; KV head 0 for dK and dV; inside the causal triangle."""
    how, value = KINDS[kind]
    row, col = {"scores_bwd": (13, 9), "grad_probs": (13, 9), "grad_v": (9, 5), "grad_k": (9, 5),
                "grad_q": (13, 5)}[op]
    return KernelFault(op=op, n=0 if op in ("grad_v", "grad_k") else 1, row=row, col=col, kind=how,
                       value=value * rms if how == "add" else value, side=side, persistent=persistent)


EXPECTED_KIND = {"inf": {"inf", "neg_inf"}, "nan": {"nan"}, "near_inf": {"near_inf"},
                 "bitflip": {"inf", "neg_inf", "near_inf"}, "finite": {"silent"}}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("op", "side", "kind"), CASES)
def test_a_fault_in_each_product_is_flagged_and_its_block_recomputed(
        make_ctx: Any, op: str, side: str, kind: str, dtype: torch.dtype) -> None:
    """In every dtype: bf16 and fp16 take the references on the tensor cores (kernels.by_dot; under the interpreter
    every form), fp32 their fp32 sums."""
    a = _faulty(dtype)
    ctx, rec = make_ctx()
    got = backward(a, ctx, faults=[fault_at(op, side, kind, a["rms"][op])])
    assert not rec.detections  # deferred: nothing is emitted before the step boundary
    drain(ctx.runtime.deferred)
    mine = [d for d in rec.detections if d.op == op]
    assert mine and all(d.action == "recomputed" and d.tier == "abft" for d in rec.detections), rec.detections
    det = mine[0]
    assert det.kind in EXPECTED_KIND[kind], det
    # Located: the batch and head of the faulted matrix, and a vector that holds the element (the query pass checks
    # S and dP tiles by columns, and their rows through Σ_j AP_ij and Σ_j dS_ij, reported where no tile flagged).
    where = {("scores_bwd", "keys"): {(13, None)}, ("grad_probs", "keys"): {(13, None)},
             ("scores_bwd", "queries"): {(None, 9), (13, None)}, ("grad_probs", "queries"): {(None, 9), (13, None)},
             ("grad_v", "keys"): {(9, None)}, ("grad_k", "keys"): {(9, None)}, ("grad_q", "queries"): {(13, None)}}
    assert (det.batch, det.head) == (0, 0 if op in ("grad_v", "grad_k") else 1), det
    assert (det.row, det.col) in where[(op, side)], det
    # The recompute is the fault-free computation: the same gradients, bit for bit.
    assert all(torch.equal(x, y) for x, y in zip(got, a["clean"], strict=True))


# The tiles a 99 KB GPU takes at head dim 256 (kernels.gpu_tiles): 16 × 16, and the rules' tile vectors as long.
SMALL_TILES = kernels.Tiles(16, 2)


@pytest.mark.parametrize(("dtype", "mask", "p"), [(torch.float32, "window", 0.0), (torch.bfloat16, "additive", 0.1)])
def test_the_small_gpus_16_wide_tiles_give_the_same_gradients_and_flag_nothing_clean(
        make_ctx: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, mask: str, p: float) -> None:
    """The backward at the tiles it takes past head dim 128 on a GPU with 99 KB of shared memory a block (sm_86,
    sm_89): T = 40 crosses 3 query and 3 key tiles of 16. The same gradients as autograd's, every op checked once,
    no flag, every clean ratio within its bound."""
    monkeypatch.setattr(kernels, "tiles", lambda *_: SMALL_TILES)
    taken = []
    run = kernels.run

    def run_seen(*args: Any, **kwargs: Any) -> Any:
        taken.append(kwargs.get("tile"))
        return run(*args, **kwargs)

    monkeypatch.setattr(kernels, "run", run_seen)
    a = make(dtype, h=2, hk=1, t=40, s=40, mask=mask, p=p, seed=5)
    ctx, rec = make_ctx()
    got = backward(a, ctx)
    drain(ctx.runtime.deferred)
    assert taken == [SMALL_TILES]
    assert not rec.detections, rec.detections[:2]
    assert all(ctx.runtime.stats.checks[op] == 1 for op in kernels.OPS)
    assert all(float(r) <= 1.0 for r in ctx.runtime.stats.residual_max.values()), ctx.runtime.stats.residual_max
    assert close(got, a, REL[dtype])


@pytest.mark.parametrize(("op", "side"), PRODUCTS)
def test_at_the_small_gpus_16_wide_tiles_a_finite_fault_in_each_product_is_flagged_and_recomputed(
        make_ctx: Any, monkeypatch: pytest.MonkeyPatch, faulty_call: dict[str, Any], op: str, side: str) -> None:
    """A finite error of 5 % of the product's RMS (the hardest kind for a bound) in each product and pass, at the 16 ×
    16 tiles: flagged against the 16-long vectors' bounds, located in its matrix, and the recompute gives the
    fault-free gradients of those tiles bit for bit."""
    monkeypatch.setattr(kernels, "tiles", lambda *_: SMALL_TILES)
    clean_ctx, _ = make_ctx()
    clean = backward(faulty_call, clean_ctx)
    ctx, rec = make_ctx()
    got = backward(faulty_call, ctx, faults=[fault_at(op, side, "finite", faulty_call["rms"][op])])
    drain(ctx.runtime.deferred)
    mine = [d for d in rec.detections if d.op == op]
    assert mine and all(d.action == "recomputed" for d in rec.detections), rec.detections
    assert (mine[0].batch, mine[0].head) == (0, 0 if op in ("grad_v", "grad_k") else 1), mine[0]
    assert all(torch.equal(x, y) for x, y in zip(got, clean, strict=True))


def test_the_gpu_tiles_fit_each_gpus_shared_memory() -> None:
    """32 × 32 on Triton's 3 stages up to head dim 64 everywhere and wherever they fit; 2 stages at head dim 128 on a
    99 KB GPU (3 needed 107 KB there) and at 256 on an A100; 16 × 16 at 256 on a 99 KB GPU. Each choice within the
    limit by the compiled need (SHARED_NEEDED); an unknown limit keeps the tiles of the interpreter and the H200.
    4 warps a program, but 8 on 32 × 32 tiles at 256 and for fp32 inputs (kernels.warps_for: with 4 they spill
    kilobytes there)."""
    limits = {"sm_89": 101376, "sm_80": 166912, "sm_90": 232448}
    want = {(64, "sm_89"): (32, 3, 4), (64, "sm_80"): (32, 3, 4), (64, "sm_90"): (32, 3, 4),
            (128, "sm_89"): (32, 2, 4), (128, "sm_80"): (32, 3, 4), (128, "sm_90"): (32, 3, 4),
            (256, "sm_89"): (16, 2, 4), (256, "sm_80"): (32, 2, 8), (256, "sm_90"): (32, 3, 8)}
    for (d, arch), (block, stages, warps) in want.items():
        got = kernels.gpu_tiles(d, limits[arch])
        assert (got.block, got.stages, got.warps) == (block, stages, warps), (d, arch, got)
        assert kernels.SHARED_NEEDED[(d, block, stages)] <= limits[arch]
    assert kernels.gpu_tiles(96, limits["sm_89"]) == kernels.gpu_tiles(128, limits["sm_89"])
    # fp32 inputs keep 8 warps everywhere: with 4 their checked passes spill kilobytes.
    assert all(kernels.gpu_tiles(d, limits[arch], torch.float32).warps == 8 for d, arch in want)
    assert kernels.gpu_tiles(256) == kernels.Tiles(kernels.BLOCK, 3)
    assert kernels.tiles(256, torch.device("cpu")) == kernels.Tiles(kernels.BLOCK, 3)
    # The key pass's checked programs on 2 warps up to head dim 64 in bf16 and fp16 (KEY_PASS_CHECKED_WARPS: on 4, two
    # warps check its tile's rows again); everything else on the tile's warps.
    for dtype in (torch.bfloat16, torch.float16):
        for d, arch in ((64, "sm_89"), (64, "sm_90"), (32, "sm_80")):
            tile = kernels.gpu_tiles(d, limits[arch], dtype)
            assert kernels.pass_warps(tile, "_key_pass", "abft", kernels.by_dot(dtype, 64)[1]) == 2
            # With its references as fp32 sums it would spill 932 bytes on 2: it keeps 4, as the other passes do.
            assert kernels.pass_warps(tile, "_key_pass", "abft", 0) == tile.warps == 4
            others = [("_key_pass", "tripwire", 0), ("_key_pass", "off", 0), ("_query_pass", "abft", 1)]
            assert {kernels.pass_warps(tile, *other) for other in others} == {4}
        for d, arch in ((128, "sm_90"), (128, "sm_89"), (256, "sm_89")):
            tile = kernels.gpu_tiles(d, limits[arch], dtype)
            assert kernels.pass_warps(tile, "_key_pass", "abft", 3) == tile.warps
    assert kernels.pass_warps(kernels.gpu_tiles(64, limits["sm_90"], torch.float32), "_key_pass", "abft", 0) == 8


@pytest.mark.skipif(not kernels.interpreting(), reason="reads the launches through the interpreter")
@pytest.mark.parametrize("check", ["abft", "tripwire"])
def test_the_checked_key_pass_launches_on_its_own_warps_and_gives_the_same_gradients(make_ctx: Any, check: str
                                                                                      ) -> None:
    """What run() hands Triton: the key pass's checked launches (the first run and its repair) on
    KEY_PASS_CHECKED_WARPS at head dim 64 in bf16, every other launch on the tile's warps. And the gradients are
    autograd's, flagging nothing (the interpreter runs a program whatever its warps; the compile matrix compiles the
    launches as recorded)."""
    from triton.runtime.interpreter import InterpretedFunction

    a = make(torch.bfloat16, t=32, s=32, d=64)
    warps: dict[str, set[int]] = {}
    run = InterpretedFunction.run

    def seen(self: Any, *args: Any, **kwargs: Any) -> Any:
        warps.setdefault(self.fn.__name__, set()).add(kwargs.get("num_warps"))
        return run(self, *args, **kwargs)

    ctx, rec = make_ctx()
    InterpretedFunction.run = seen
    try:
        got = backward(a, ctx, check=check)
    finally:
        InterpretedFunction.run = run
    drain(ctx.runtime.deferred)
    assert not rec.detections
    assert close(got, a, 1e-2)
    tile = kernels.tiles(64, torch.device("cpu"), torch.bfloat16)
    assert warps["_key_pass"] == ({2} if check == "abft" else {tile.warps}) and warps["_query_pass"] == {tile.warps}


def test_a_fault_that_repeats_in_the_recompute_is_uncorrectable(make_ctx: Any, faulty_call: dict[str, Any]) -> None:
    ctx, rec = make_ctx()
    got = backward(faulty_call, ctx, faults=[fault_at("grad_k", "keys", "inf", 1.0, persistent=True)])
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action) for d in rec.detections] == [("grad_k", "uncorrectable")]
    assert torch.isinf(got[1]).any()


def test_a_wrong_log_sum_exp_shows_in_the_row_sums_of_ap(make_ctx: Any, faulty_call: dict[str, Any]) -> None:
    """A forward's lse 0.5 off in one row scales that row of the recomputed AP by e^-0.5: every product's checksum is
    consistent with it (each reads the same AP), and so is Σ_j dS_ij = 0 (a uniform scale cancels). Σ_j AP_ij = 1
    is not. Flagged, and uncorrectable here (the recompute reads the same lse: the forward must be run again)."""
    a = dict(faulty_call)
    a["lse"] = a["lse"].clone()
    a["lse"][0, 1, 20] += 0.5
    ctx, rec = make_ctx()
    backward(a, ctx)
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action, d.head, d.row) for d in rec.detections] == [("scores_bwd", "uncorrectable", 1, 20)]


def test_detect_mode_reports_and_launches_no_repair(make_ctx: Any, faulty_call: dict[str, Any]) -> None:
    ctx, rec = make_ctx(mode="detect")
    with launches() as count:
        got = backward(faulty_call, ctx, faults=[fault_at("grad_q", "queries", "nan", 1.0)])
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action) for d in rec.detections] == [("grad_q", "detected")]
    assert torch.isnan(got[0]).any()
    assert count.triton == 4  # δ (with the query blocks' terms), the key blocks' terms, the query pass, the key pass


def test_tier_one_sees_extreme_gradients_and_recomputes_them(make_ctx: Any, faulty_call: dict[str, Any]) -> None:
    """check="tripwire" (whole-step checks not due): INF, NaN or |x| > 1e10 in dQ, dK, dV only. A finite error is
    the full check's to find, not tier 1's: it passes, as on every other path."""
    a = faulty_call
    ctx, rec = make_ctx()
    got = backward(a, ctx, check="tripwire", faults=[fault_at("grad_v", "keys", "inf", 1.0)])
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [("grad_v", "recomputed", "tripwire")]
    assert all(torch.equal(x, y) for x, y in zip(got, a["clean"], strict=True))
    assert ctx.runtime.stats.trip_checks["grad_q"] == 1 and not ctx.runtime.stats.checks.get("grad_q")
    ctx, rec = make_ctx()
    got = backward(a, ctx, check="tripwire", faults=[fault_at("grad_v", "keys", "finite", a["rms"]["grad_v"])])
    drain(ctx.runtime.deferred)
    assert not rec.detections and not torch.equal(got[2], a["clean"][2])



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tier_one_leaves_gradients_past_1e10_that_the_inputs_give(make_ctx: Any, dtype: torch.dtype) -> None:
    """Diverged training: dO up to 1e12 makes dQ, dK and dV past 1e10 from finite inputs. Tier 1 trips, the recompute
    trips again within what the inputs can give: no event, and the gradients are the computed ones."""
    a = make(dtype, t=32, s=32, do_max=1e12)
    ctx, rec = make_ctx()
    got = backward(a, ctx, check="tripwire")
    drain(ctx.runtime.deferred)
    assert all(float(g.abs().max()) > 1e10 for g in got)
    assert not rec.detections, rec.detections[:2]
    assert close(got, a, REL[dtype])


@pytest.mark.parametrize(("op", "side"), [("grad_v", "keys"), ("grad_k", "keys"), ("grad_q", "queries")])
def test_tier_one_reports_a_near_inf_gradient_that_comes_back_in_the_recompute(
        make_ctx: Any, faulty_call: dict[str, Any], op: str, side: str) -> None:
    """A persistent fault (it strikes the recompute as well) writing 1e20 into dV, dK or dQ on a tier-1 call, whose
    inputs are finite and hold every gradient many orders under 1e10: no input can give that value, so the call says
    uncorrectable (and the step is skipped). It was taken for diverged training: no event, and a finite 1e20 went to
    the optimizer, which stepped on it."""
    ctx, rec = make_ctx()
    got = backward(faulty_call, ctx, check="tripwire", faults=[fault_at(op, side, "near_inf", 1.0, persistent=True)])
    drain(ctx.runtime.deferred)
    assert max(float(g.abs().max()) for g in got) >= 1e19  # the fault is in the gradients the optimizer gets
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [(op, "uncorrectable", "tripwire")]

@pytest.mark.parametrize("check", ["abft", "tripwire"])
@pytest.mark.parametrize("where", ["operands", "input"])
def test_an_fp16_overflow_under_a_loss_scale_is_not_a_fault(make_ctx: Any, where: str, check: str) -> None:
    """GradScaler's first steps overflow fp16 gradients on purpose (and skip the step). operands: dO finite (its
    largest element 60,000) but dS and AP∘Z rounded to fp16 for their products reach INF, and those products
    follow; input: dO itself holds INF (an upstream gradient overflowed, which that op's own check sees). Nothing is
    reported (gemm.check._overflowed and attention.backward.encoded on the other paths)."""
    if where == "operands":
        a = make(torch.float16, t=32, s=32, d=16, seed=4, v_scale=30.0, do_max=60000.0)
        assert torch.isfinite(a["do"]).all()
    else:
        a = make(torch.float16, t=32, s=32, d=16, seed=4)
        a["do"] = (a["do"].float() * 2.0**15).half()
        assert not torch.isfinite(a["do"]).all()
    ctx, rec = make_ctx()
    got = backward(a, ctx, check=check)
    drain(ctx.runtime.deferred)
    assert not all(bool(torch.isfinite(g).all()) for g in got)
    assert not rec.detections, rec.detections[:2]


@pytest.mark.parametrize("check", ["abft", "tripwire"])
@pytest.mark.parametrize("operand", ["k", "v"])
def test_a_non_finite_key_or_value_is_its_producers_fault_not_the_backwards(make_ctx: Any, operand: str,
                                                                           check: str) -> None:
    """A K or V holding a NaN (its projection's check reports it) makes dQ non-finite: the query pass's programs
    flag, read the keys and values they used again (only a program that flagged does), see the NaN, and report
    nothing, as for dO in the test above."""
    a = make(torch.float32, t=32, s=32, d=16, seed=6)
    a[operand] = a[operand].clone()
    a[operand][0, 0, 5, 3] = float("nan")
    ctx, rec = make_ctx()
    got = backward(a, ctx, check=check)
    drain(ctx.runtime.deferred)
    assert not bool(torch.isfinite(got[0]).all())
    assert not rec.detections, rec.detections[:2]


# ------------------------------------------------------------- tier 1 over given gradients (SDPA's, on a GPU step)


def given_backward(a: dict[str, Any], ctx: Any, given: tuple[torch.Tensor, ...],
                   faults: list[KernelFault] | None = None) -> tuple[torch.Tensor, ...]:
    return backward(a, ctx, check="tripwire", faults=faults, given=given)


@pytest.fixture(scope="module")
def two_blocks() -> dict[str, Any]:
    """T = S = 64 (two blocks of queries and of keys), GQA 2 on 1, causal; ``given``: autograd's gradients through
    the math (what another backward, SDPA's, hands tier 1), and ``kernel``: the kernels' own, unchecked."""
    a = make(torch.float32, t=64, s=64, d=16, seed=11)
    a["given"] = tuple(g.to(torch.float32) for g in a["want"])
    a["kernel"] = backward(a, None, check="off")
    return a


def in_layout(g_BHTD: torch.Tensor, layout: str) -> torch.Tensor:
    """g's values in a vendor's layout: "contiguous" (B, H, T, D); "vendor", a (B, H, T, D) view of a (B, T, H, D)
    buffer (FlashAttention's and the CPU flash kernel's gradients, in their inputs' layout); "packed", that view of
    one half of a (B, T, H, 2·D) buffer (rows not adjacent)."""
    if layout == "contiguous":
        return g_BHTD.clone()
    b, h, t, d = g_BHTD.shape
    buf = torch.full((b, t, h, d if layout == "vendor" else 2 * d), 7.0, dtype=g_BHTD.dtype)
    view = buf[..., :d].transpose(1, 2)
    view.copy_(g_BHTD)
    return view


def test_a_given_gradient_is_written_in_place_only_where_its_elements_are_distinct() -> None:
    """kernels._writable: the repair writes a given gradient through its strides where every element is its own and a
    row's features are adjacent (contiguous, the vendor's (B, T, H, D) layout, one half of a wider buffer); an
    expanded view (a write through it would land in several elements) or features a stride apart are copied first."""
    g = torch.randn(1, 2, 8, 4)
    vendor = g.transpose(1, 2).contiguous().transpose(1, 2)
    half = torch.randn(1, 8, 2, 8)[..., :4].transpose(1, 2)
    for kept in (g, vendor, half):
        assert kernels._writable(kept) is kept
    for copied in (g[:, :1].expand(1, 2, 8, 4), torch.randn(1, 2, 8, 8)[..., ::2]):
        got = kernels._writable(copied)
        assert got is not copied and got.is_contiguous() and torch.equal(got, copied)


@pytest.mark.parametrize("layout", ["contiguous", "vendor", "packed"])
@pytest.mark.parametrize(("which", "at", "kind"), [(0, (0, 1, 40, 3), "inf"), (1, (0, 0, 9, 5), "nan"),
                                                   (2, (0, 0, 50, 0), "near_inf"), (1, (0, 0, 33, 7), "bitflip")])
def test_tier_one_over_given_gradients_recomputes_only_the_tripped_block(
        make_ctx: Any, two_blocks: dict[str, Any], which: int, at: tuple[int, ...], kind: str, layout: str) -> None:
    """An extreme value in the given dQ, dK or dV (below autograd, in SDPA's output on a GPU) trips the block that
    holds it: that block is recomputed by the kernels (dK and dV together: one key program owns both), reported at
    the step boundary as recomputed by tier 1, and every other element is the given gradient, bit for bit. In the
    vendor's own layout the repair writes into its tensors in place (no copy) and nowhere else in their buffers."""
    a = two_blocks
    given = [in_layout(g, layout) for g in a["given"]]
    bases = [g._base if g._base is not None else g for g in given]
    before = [b.clone() for b in bases]
    value = given[which][at]
    given[which][at] = {"inf": math.inf, "nan": math.nan, "near_inf": 3e20,
                        "bitflip": (value.view(torch.int32) ^ (1 << 30)).view(torch.float32)}[kind]
    assert not abs(float(given[which][at])) <= 1e10
    ctx, rec = make_ctx()
    got = given_backward(a, ctx, tuple(given))
    assert all(g is w for g, w in zip(got, given, strict=True))
    if layout == "packed":  # the other half of each row, and the fault's own buffer elsewhere, untouched
        for i, (base, old) in enumerate(zip(bases, before, strict=True)):
            assert torch.equal(base[..., a["given"][i].shape[-1]:], old[..., a["given"][i].shape[-1]:])
    assert not rec.detections
    drain(ctx.runtime.deferred)
    op = ("grad_q", "grad_k", "grad_v")[which]
    assert [(d.op, d.action, d.tier, d.batch, d.head) for d in rec.detections] == [
        (op, "recomputed", "tripwire", 0, at[1])], rec.detections
    assert rec.detections[0].row == at[2]
    block = slice(at[2] // 32 * 32, at[2] // 32 * 32 + 32)
    for i, (g, want_given, kernel) in enumerate(zip(got, a["given"], a["kernel"], strict=True)):
        owned = (which == 0) == (i == 0)  # the query program owns dQ; the key program dK and dV
        for h in range(g.shape[1]):
            here = g[0, h]
            mine = owned and (h == at[1] or which != 0)
            assert torch.equal(here[block], kernel[0, h][block] if mine else want_given[0, h][block])
            rest = torch.ones(g.shape[2], dtype=torch.bool)
            rest[block] = False
            assert torch.equal(here[rest], want_given[0, h][rest])


def test_tier_one_over_clean_given_gradients_returns_them_in_three_launches_without_a_sync(
        make_ctx: Any, two_blocks: dict[str, Any]) -> None:
    """Clean: the given gradients come back untouched, nothing is reported, tier 1 is counted for the three outputs.
    The launches: the tier-1 pass over the gradients, which makes δ too for the repair (no launch of its own), and
    the two repair launches (whose programs return at once); no host-device sync."""
    a = two_blocks
    ctx, rec = make_ctx()
    with SyncCounter() as syncs, launches() as count:
        got = given_backward(a, ctx, a["given"])
    assert syncs.calls == [], syncs.calls
    if kernels.interpreting():
        assert count.triton == 3
    drain(ctx.runtime.deferred)
    assert not rec.detections
    assert all(torch.equal(g, w) for g, w in zip(got, a["given"], strict=True))
    assert all(ctx.runtime.stats.trip_checks[op] == 1 for op in triton_backward.TRIP_OPS)


def test_a_fault_that_comes_back_in_the_recompute_of_a_given_block_is_reported(
        make_ctx: Any, two_blocks: dict[str, Any]) -> None:
    """A NaN in the given dK, and the kernels' recompute of that block gives INF again (a persistent emulated fault)
    from finite inputs, which cannot give it: the block holds what this backward cannot repair, reported
    uncorrectable (before the bound on what the inputs can give: "detected", as if an input had brought it)."""
    a = two_blocks
    given = [g.clone() for g in a["given"]]
    given[1][0, 0, 40, 2] = math.nan
    ctx, rec = make_ctx()
    got = given_backward(a, ctx, tuple(given), faults=[KernelFault(op="grad_k", n=0, row=40, col=2, persistent=True)])
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action, d.tier) for d in rec.detections] == [("grad_k", "uncorrectable", "tripwire")], \
        rec.detections
    assert not bool(torch.isfinite(got[1]).all())


def test_given_gradients_of_a_non_finite_key_are_its_producers_to_report(make_ctx: Any) -> None:
    """K holding a NaN makes the given dQ (and dV) non-finite: the tripped programs read their inputs, see the NaN,
    and report nothing (its projection's check does), as the kernels' own tier 1."""
    a = make(torch.float32, t=32, s=32, d=16, seed=6)
    a["k"] = a["k"].clone()
    a["k"][0, 0, 5, 3] = float("nan")
    leaves = [x.float().requires_grad_() for x in (a["q"], a["k"], a["v"])]
    out, _ = reference(*leaves, **a["how"])
    given = torch.autograd.grad(out, leaves, a["do"].float())
    assert not bool(torch.isfinite(given[0]).all())
    ctx, rec = make_ctx()
    given_backward(a, ctx, given)
    drain(ctx.runtime.deferred)
    assert not rec.detections, rec.detections[:2]


def test_given_gradients_of_a_non_finite_output_are_its_producers_to_report(make_ctx: Any) -> None:
    """O holding a NaN in query row 9 (the forward's output, which its own check reports) makes that row's δ, so its
    dQ and the dK of the keys it sees, non-finite. The tier-1 pass makes δ itself for the repair: the query program
    that trips on dQ sees its NaN δ, the key program that trips on dK asks whether O was finite (its launch is still
    making δ); both report nothing, and the gradients come back as given."""
    a = make(torch.float32, t=64, s=64, d=16, seed=6)
    a = {**a, "out": a["out"].clone()}
    a["out"][0, 0, 9, 4] = float("nan")
    given = [g.to(torch.float32).clone() for g in a["want"]]
    given[0][0, 0, 9, :] = float("nan")
    given[1][0, 0, 3, :] = float("nan")
    ctx, rec = make_ctx()
    got = given_backward(a, ctx, tuple(given))
    drain(ctx.runtime.deferred)
    assert not rec.detections, rec.detections[:2]
    assert bool(got[0][0, 0, 9].isnan().all()) and bool(got[1][0, 0, 3].isnan().all())
    a["out"][0, 0, 9, 4] = a["out"][0, 0, 9, 5]  # the same faults with a finite O: both reported, as recomputed
    ctx, rec = make_ctx()
    given_backward(a, ctx, tuple(g.clone() for g in given))
    drain(ctx.runtime.deferred)
    assert sorted(d.op for d in rec.detections) == ["grad_k", "grad_q"], rec.detections


def test_a_given_half_precision_gradient_past_its_range_is_not_a_fault(make_ctx: Any) -> None:
    """GradScaler's overflow steps: given fp16 gradients hold INF where the true values pass 65504. The tier-1 pass
    sees the INF (it reads the gradients as stored), the repair's recompute rounds past the range again from finite
    sums: the dtype's INF, not a fault; nothing is reported. A genuine INF in a finite block still is."""
    a = make(torch.float16, t=32, s=32, d=16, seed=4, v_scale=30.0, do_max=60000.0)
    given = tuple(g.half() for g in a["want"])
    assert not all(bool(torch.isfinite(g).all()) for g in given)
    assert all(bool(torch.isfinite(g).all()) for g in a["want"])
    ctx, rec = make_ctx()
    given_backward(a, ctx, given)
    drain(ctx.runtime.deferred)
    assert not rec.detections, rec.detections[:2]
    b = make(torch.float16, t=32, s=32, d=16, seed=4)
    planted = [g.half() for g in b["want"]]
    assert all(bool(torch.isfinite(g).all()) for g in planted)
    planted[2][0, 0, 7, 1] = math.inf
    ctx, rec = make_ctx()
    given_backward(b, ctx, tuple(planted))
    drain(ctx.runtime.deferred)
    assert [(d.op, d.action) for d in rec.detections] == [("grad_v", "recomputed")], rec.detections



def test_a_given_half_precision_gradient_that_a_fault_rounds_past_its_range_is_uncorrectable(make_ctx: Any) -> None:
    """The overflow steps' exemption holds only for values the inputs can give. An INF planted in finite given fp16
    gradients trips tier 1; the repair's recompute writes 1e20 into that block again (a persistent fault), which
    rounds to fp16's INF: past what the inputs can give, so uncorrectable, not the dtype's range (no event)."""
    b = make(torch.float16, t=32, s=32, d=16, seed=4)
    planted = [g.half() for g in b["want"]]
    planted[2][0, 0, 7, 1] = math.inf
    ctx, rec = make_ctx()
    got = given_backward(b, ctx, tuple(planted), faults=[KernelFault(op="grad_v", n=0, row=7, col=1, value=1e20,
                                                                     persistent=True)])
    drain(ctx.runtime.deferred)
    assert torch.isinf(got[2][0, 0, 7, 1])
    assert [(d.op, d.action) for d in rec.detections] == [("grad_v", "uncorrectable")], rec.detections


# ------------------------------------------------------------------------------------------------- the fast path


class _Count(TorchDispatchMode):
    """aten ops made outside the kernels (each a kernel launch on a GPU), and Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.aten, self.triton, self.inside = 0, 0, False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if not self.inside and func.is_view is False and func.name() not in _METADATA:
            self.aten += 1
        return func(*args, **(kwargs or {}))


_METADATA = {"aten::empty.memory_format", "aten::empty_strided", "aten::empty_like", "aten::detach", "aten::lift_fresh"}
"""Allocations and detach: no kernel."""


@contextmanager
def launches() -> Iterator[_Count]:
    """Count while the block runs; the interpreter's own tensor handling inside a launch is not counted."""
    from triton.runtime.interpreter import InterpretedFunction

    count = _Count()
    run = InterpretedFunction.run

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("warmup"):
            return run(self, *args, **kwargs)
        count.triton += 1
        count.inside = True
        try:
            return run(self, *args, **kwargs)
        finally:
            count.inside = False

    InterpretedFunction.run = counted
    try:
        with count:
            yield count
    finally:
        InterpretedFunction.run = run


@pytest.mark.skipif(not kernels.interpreting(), reason="counts launches through the interpreter")
def test_a_checked_backward_makes_the_same_few_launches_at_any_length(make_ctx: Any) -> None:
    """6 Triton launches (δ and the query blocks' terms, the key blocks' terms, query pass, key pass, and the passes'
    repair, whose programs return at once when clean) and a
    fixed number of small aten ops for the deferred records (7 here; the margin histogram is updated at the step
    boundary), at T = 32 and T = 64 (1 and 2 blocks of queries and of keys, 2 and 8 tiles): nothing runs per tile
    or per block on the host."""
    counts = []
    for t in (32, 32, 64):  # the first call also fills a per-device cache (the status word's bits)
        a = make(torch.float32, t=t, s=t, d=16, h=2, hk=1)
        ctx, _ = make_ctx()
        with launches() as count:
            backward(a, ctx)
        counts.append((count.triton, count.aten))
    assert counts[1] == counts[2], counts
    assert counts[1][0] == 6 and counts[1][1] <= 10, counts


def test_the_checked_backward_never_waits_for_the_device(make_ctx: Any) -> None:
    """No host-device sync from the call to its return (flags, summaries and the repair's outcome stay on the device);
    the records are read at the step boundary, in one sync (checks/deferred.py). A fault changes nothing here: the
    repair is launched either way."""
    a = make(torch.bfloat16, t=24, s=24, d=16, mask="padding", p=0.1)
    for faults in ([], [KernelFault(op="grad_q", n=0, row=3, col=2, side="queries")]):
        ctx, _ = make_ctx()
        with SyncCounter() as syncs:
            backward(a, ctx, faults=faults or None)
        assert syncs.calls == [], syncs.calls
