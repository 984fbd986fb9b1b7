"""Packed (varlen) attention, checked per sequence (attention/varlen.py): the protected call computes varlen_attn's
function (flash-attn's windows, GQA, sequences of any length, tokens outside every sequence), with the math
reference's gradients; no tile crosses a document boundary; faults in any document are corrected; clean calls never
flag. torch's varlen_attn itself has no CPU kernel, so the reference is per-sequence math."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.varlen import varlen_attn
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.attention.varlen import protected_varlen_attention
from attnchecker.inject import Fault

H, HK, D = 4, 2, 16
LENS = (70, 1, 130, 0, 40)


def offsets(lens: tuple[int, ...], start: int = 0) -> torch.Tensor:
    return torch.tensor([start, *(start + sum(lens[: i + 1]) for i in range(len(lens)))], dtype=torch.int32)


def seeded(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def packed(total: int, seed: int, dtype: torch.dtype = torch.float32, h: int = H, hk: int = HK):
    return seeded((total, h, D), seed, dtype), seeded((total, hk, D), seed + 1, dtype), seeded((total, hk, D),
                                                                                               seed + 2, dtype)


def reference(q, k, v, cu_q, cu_k, window, scale=None):
    """Each sequence on its own, materialised in fp64, flash-attn's bottom-right window; 0 outside every sequence."""
    h = q.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for n in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[n], cq[n + 1], ck[n], ck[n + 1]
        if q1 == q0:
            continue
        qd = q[q0:q1].double().transpose(0, 1)
        kd, vd = (x[k0:k1].double().transpose(0, 1).repeat_interleave(h // x.shape[1], 0) for x in (k, v))
        s = qd @ kd.mT * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        i, j = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0), torch.arange(k1 - k0)[None]
        ok = torch.ones(s.shape[-2:], dtype=torch.bool)
        if window[0] >= 0:
            ok &= j >= i - window[0]
        if window[1] >= 0:
            ok &= j <= i + window[1]
        pieces.append((q0, q1, (torch.softmax(s.masked_fill(~ok, -math.inf), -1).nan_to_num(0.0) @ vd)))
    for q0, q1, o in pieces:
        out = torch.cat([out[:q0], o.transpose(0, 1), out[q1:]])
    return out


def grads_of(fn, inputs, g):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    (out.double() * g).sum().backward()
    return out.detach(), [x.grad for x in leaves]


WINDOWS = [(-1, -1), (-1, 0), (24, 0), (10, 6)]


@pytest.mark.parametrize("window", WINDOWS)
def test_varlen_call_equals_the_reference_forward_and_gradients(make_ctx, window: tuple[int, int]) -> None:
    cu = offsets(LENS, start=3)
    total = int(cu[-1]) + 5  # 3 tokens before the first sequence, 5 after the last: outside every sequence
    q, k, v = packed(total, 0)
    g = seeded((total, H, D), 9, torch.float64)
    ctx, rec = make_ctx()
    got, grads = grads_of(lambda *x: protected_varlen_attention(*x, cu, cu, ctx=ctx, window_size=window,
                                                                enable_gqa=True), (q, k, v), g)
    want, ref_grads = grads_of(lambda *x: reference(*x, cu, cu, window), (q, k, v), g)
    assert rec.detections == []
    # One checked call per non-empty sequence.
    assert ctx.runtime.stats.checks["scores"] == ctx.runtime.stats.checks["context"] == 4
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for name, a, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_varlen_keys_longer_than_queries_align_bottom_right(make_ctx) -> None:
    """A sequence with more keys than queries (a prefix of cached keys): flash-attn's causal window ends at the last
    key for the last query."""
    cu_q, cu_k = offsets((5, 12)), offsets((9, 20))
    q = seeded((17, H, D), 1)
    k, v = seeded((29, HK, D), 2), seeded((29, HK, D), 3)
    ctx, rec = make_ctx()
    got, lse = protected_varlen_attention(q, k, v, cu_q, cu_k, ctx=ctx, window_size=(-1, 0), enable_gqa=True,
                                          return_lse=True)
    assert rec.detections == [] and lse.shape == (H, 17)
    torch.testing.assert_close(got.double(), reference(q, k, v, cu_q, cu_k, (-1, 0)), rtol=1e-5, atol=1e-5)


class ScoreShapes(TorchDispatchMode):
    """The (rows, keys) of every product of q and k: a product that spans two documents is one a tile made."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # q·kᵀ: (…, rows, D) @ (…, D, keys); the checksum products against D-long weight vectors are 2·g wide.
        if (func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default) and args[0].shape[-1] == D
                and out.shape[-1] > D):
            self.shapes.append(tuple(out.shape[-2:]))
        return out


def test_no_tile_crosses_a_document_boundary(make_ctx) -> None:
    cu = offsets(LENS)
    q, k, v = packed(int(cu[-1]), 2)
    ctx, _ = make_ctx()
    with ScoreShapes() as seen, torch.no_grad():
        protected_varlen_attention(q, k, v, cu, cu, ctx=ctx, window_size=(-1, 0), enable_gqa=True)
    assert seen.shapes and max(max(s) for s in seen.shapes) <= max(LENS), seen.shapes


@pytest.mark.parametrize(("op", "kind", "persistent"), [("scores", "inf", True), ("scores", "nan", False),
                                                        ("context", "near_inf", True), ("context", "bitflip", False)])
def test_a_fault_in_a_packed_document_is_corrected(make_ctx, op: str, kind: str, persistent: bool) -> None:
    """A causal sequence is plain attention, which the backend order gives to any backend (a call attnchecker.inject
    targets: the unfused path at these sizes, which corrects in place; the tile loop would recompute a transient
    fault). Either way out and gradients are the clean call's."""
    cu = offsets((70, 130, 60))
    q, k, v = packed(int(cu[-1]), 4)
    g = seeded(tuple(q.shape), 5, torch.float64)
    clean_ctx, _ = make_ctx()
    want, want_grads = grads_of(lambda *x: protected_varlen_attention(*x, cu, cu, ctx=clean_ctx, window_size=(-1, 0),
                                                                      enable_gqa=True), (q, k, v), g)
    # Each document is a computation of the op: a transient fault lands in the first, a persistent one in every one.
    fault = Fault(op=op, layer=0, step=0, kind=kind, batch=0, head=3, row=50, col=20 if op == "scores" else 7,
                  persistent=persistent, seed=2)
    ctx, rec = make_ctx(faults=[fault])
    got, grads = grads_of(lambda *x: protected_varlen_attention(*x, cu, cu, ctx=ctx, window_size=(-1, 0),
                                                                enable_gqa=True), (q, k, v), g)
    assert [(d.op, d.head, d.row) for d in rec.detections] == [(op, 3, 50)] * (3 if persistent else 1)
    assert {d.action for d in rec.detections} <= {"corrected", "recomputed"}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}


@settings(max_examples=10)
@given(lens=st.lists(st.integers(0, 60), min_size=1, max_size=5), window=st.sampled_from(WINDOWS),
       dtype=st.sampled_from(list(TOL)), seed=st.integers(0, 2**16))
def test_clean_varlen_calls_never_flag(make_ctx, lens, window, dtype, seed) -> None:
    cu = offsets(tuple(lens))
    q, k, v = packed(int(cu[-1]), seed, dtype)
    ctx, rec = make_ctx()
    out = protected_varlen_attention(q, k, v, cu, cu, ctx=ctx, window_size=window, enable_gqa=True)
    assert rec.detections == []
    torch.testing.assert_close(out.double(), reference(q, k, v, cu, cu, window), rtol=TOL[dtype], atol=TOL[dtype])


def test_offsets_that_do_not_fit_the_packed_tensor_are_refused(make_ctx) -> None:
    q, k, v = packed(10, 6)
    ctx, _ = make_ctx()
    with pytest.raises(ValueError, match="cu_seq_q must be non-decreasing offsets"):
        protected_varlen_attention(q, k, v, torch.tensor([0, 6, 4, 12]), None, ctx=ctx, enable_gqa=True)


class PackedAttention(torch.nn.Module):
    """A plain module over packed documents calling torch's varlen_attn, which has no CPU kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

    def forward(self, x_TC: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(-1, 4, 8) for t in self.qkv(x_TC).split(32, -1))
        return self.out(varlen_attn(q, k, v, cu, cu, 64, 64, window_size=(-1, 0)).reshape(-1, 32))


def test_a_module_calling_torchs_varlen_attn_trains_protected_on_cpu() -> None:
    """varlen_attn's op reaches the checked engine through the SDPA integration's TorchFunctionMode."""
    import attnchecker
    from attnchecker import Policy

    torch.manual_seed(0)
    model = PackedAttention()
    cu = offsets((40, 24, 64))
    x = torch.randn(128, 32)
    with pytest.raises(NotImplementedError):
        model(x, cu)
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        out = model(x, cu)
        out.square().mean().backward()
        guard.step()
        assert guard.coverage.complete, guard.coverage.gaps()
        assert {e.path for e in guard.coverage.protected if e.op == "scores"} == {"varlen"}
        assert guard.report().checks["scores"] == 3  # one checked call per document
    q, k, v = (t.view(-1, 4, 8) for t in model.qkv(x).split(32, -1))
    want = model.out(reference(q, k, v, cu, cu, (-1, 0)).float().reshape(-1, 32))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


class FlashPacked(PackedAttention):
    """The same through flash-attn's call convention (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale=, causal=)."""

    def forward(self, x_TC: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(-1, 4, 8) for t in self.qkv(x_TC).split(32, -1))
        out = flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, softmax_scale=0.25, causal=True)  # noqa: F821
        return self.out(out.reshape(-1, 32))


def test_flash_attn_varlen_func_is_routed_by_its_call_convention(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash-attn is CUDA-only and not installed here: a stand-in module whose function fails as the real one does on
    CPU gives the model the name to call. Protected, the call never reaches it (routed by name to the checked engine,
    with flash-attn's arguments); unprotected, it fails; unprotect restores the name."""
    import types

    import attnchecker
    from attnchecker import Policy

    def flash_attn_varlen_func(*args, **kwargs):
        raise RuntimeError("FlashAttention only supports CUDA")

    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)
    monkeypatch.setitem(globals(), "flash_attn_varlen_func", flash_attn_varlen_func)
    torch.manual_seed(0)
    model = FlashPacked()
    cu, x = offsets((40, 24, 64)), torch.randn(128, 32)
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        out = model(x, cu)
        out.square().mean().backward()
        guard.step()
        assert guard.coverage.complete, guard.coverage.gaps()
        assert guard.report().checks["context"] == 3
    assert globals()["flash_attn_varlen_func"] is flash_attn_varlen_func
    with pytest.raises(RuntimeError, match="only supports CUDA"):
        model(x, cu)
    q, k, v = (t.view(-1, 4, 8) for t in model.qkv(x).split(32, -1))
    want = model.out(reference(q, k, v, cu, cu, (-1, 0), scale=0.25).float().reshape(-1, 32))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
