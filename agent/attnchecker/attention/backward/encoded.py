"""The full check of the attention backward, run on the fused kernel with checksum-encoded operands (issue 17).

The checked products of attention.backward.checked materialise S, dP, AP and dS over (B, H, rows, S) and run five GEMMs
where the fused CPU flash-attention backward keeps all of that in its tiles: at the overhead benchmark's GPT-2 layer
they took 2.6× the kernel's time, this 1.6× (bench/encoded_backward.py). Here the fused kernel itself
carries the checksums, the way ABFT encodes a GEMM's operands (Huang & Abraham): columns appended to its operands
come out as checksum columns of its outputs.

With e = ones and w = (1..D)/D over the head dim, c_X = X·[e, w] per row, and zero columns where a product must not
change (the kernel takes one head size for Q, K and V, so all five are D + 5 wide, then zero-padded to a multiple of 8
head dims, WIDTH_MULTIPLE):

  Q' = [Q, c_Q, 0, 0, 0]        K' = [K, 0, 0, c_K, 1]       Q'K'ᵀ = QKᵀ: S, AP, lse unchanged
  V' = [V, 0, 0, 0, 0, 0]       O' = [O, 0, 0, 0, 0, 0]      dP = dO Vᵀ and δ = rowsum(dO ⊙ O) unchanged
  dO' = [dO, c_dO, g₁, g₂, 0]

so that the kernel's outputs are

  dQ' = [dQ, 0, 0, dQ·[e, w], scale·dS·1]   row checksums of dQ, and the row sums of dS
  dK' = [dK, dK·[e, w], 0, 0, 0]            row checksums of dK
  dV' = [dV, dV·[e, w], APᵀg₁, APᵀg₂, 0]    row checksums of dV, and its own round-off bounds (AP ≥ 0)

Verified, per row: each output's two checksums against the sums of its own columns (plain and weighted: a balanced
+e/−e pair shows in the weighted one), and Σ_j dS_ij = Σ_j AP_ij dP_ij − δ_i Σ_j AP_ij = 0, which holds for any
consistent AP, dP and δ: a fault in the kernel's own products (the scores it recomputes, dP, dS) shows there, where
the output checksums, reading the same wrong dS on both sides, agree with it. A flag recomputes the backward through
the checked products (attention.backward.checked), which locate and correct; what they do not find is reported as
recomputed. The bounds are rigorous (any summation order; docs/abft.md, "The encoded attention backward"); the checks
cost O(T·D) and one sync, the kernel D + 5 head dims (padded to a multiple of 8) instead of D.

Legend: B batch, H heads (K/V expanded to H), T query tokens, S key tokens, D head dim.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...abft.tolerance import Tolerance, gamma
from ...checks.caches import engine_caches
from ...checks.context import LayerContext
from ...checks.product import _exact_math, _tolerance
from ...checks.records import _count, _deliver, _record_ratio
from ...events import Detection, kind_of, value_to_wire
from ...kernels.fused_pass import fused_pass
from ...matmul_precision import fp32_matmul_operand_roundoff
from ...tripwire import extreme_value

__all__ = ["ENCODED_OPS", "encoded_backward", "encoded_width", "supports"]

ENCODED_OPS: tuple[str, ...] = ("grad_q", "grad_k", "grad_v", "grad_probs")
"""The checks of one encoded backward: the three outputs' row checksums, and dS's row sums (op ``grad_probs``: the
check that sees the kernel's scores, dP and dS)."""

enabled = True
"""False: the backward's full check runs the checked products (attention.backward.checked) instead; for comparisons
(bench/overhead.py's ``all_full_products``)."""

ENCODED_COLS = 5
"""Head dims the encoded operands carry beyond D (module docstring), before ``_padding``."""

WIDTH_MULTIPLE = 8
"""The encoded width is padded with zero columns to a multiple of this: PyTorch's CPU flash-attention backward runs
its head dim in vector lanes, and at 69 = 64 + 5 it paid a scalar tail per row that cost more than 3 zero columns
(bench/encoded_backward.py prices both side by side: docs/abft.md, "The encoded attention backward"). Zero columns
change no product (module docstring)."""

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
log = logging.getLogger("attnchecker")
_warned: set[str] = set()


def _warn_once(exc: RuntimeError) -> None:
    key = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if key not in _warned:
        _warned.add(key)
        log.warning("attnchecker: the fused attention backward refused the encoded operands (%s); this backward's "
                    "full check runs the checked products instead", key)


def supports(q_BHTD: torch.Tensor) -> bool:
    """Whether the encoded kernel can run: the CPU flash-attention backward in a dtype it takes."""
    return enabled and q_BHTD.device.type == "cpu" and q_BHTD.dtype in _DTYPES


@functools.lru_cache(maxsize=32)
def _sum_weights(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(n, 2): e and w = (1..n)/n, the plain and weighted checksum vectors: abft.checksum_weights scaled to w ≤ 1, so
    that one bound serves both and the checksum columns fit fp16 operands (Q·(1..n) at D = 128 passes 65504)."""
    w = torch.arange(1, n + 1, device=device, dtype=torch.float64) / n
    return torch.stack([torch.ones_like(w), w], dim=-1).to(dtype)


engine_caches.register(_sum_weights)


@functools.lru_cache(maxsize=32)
def _residual_weights(n: int, at: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(at + 2, 2): e and w over an encoded output's first n columns, -1 at its checksum columns at, at+1: the
    output's first at + 2 columns times it are the (plain, weighted) checksum residuals per row. Not wider: a bound
    column after them may hold INF (an overflowed bound, which must stay a loose bound), and 0·INF would be NaN."""
    weights = torch.zeros(at + 2, 2, dtype=torch.float64)
    weights[:n] = _sum_weights(n, torch.device("cpu"), torch.float64)
    weights[at, 0] = weights[at + 1, 1] = -1.0
    return weights.to(device=device, dtype=dtype)


engine_caches.register(_residual_weights)


def encoded_backward(
    layer: LayerContext,
    grad_out_BHTD: torch.Tensor,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    out_BHTD: torch.Tensor,
    lse_BHT: torch.Tensor,
    mask_add: torch.Tensor | None,
    *,
    scale: float,
    is_causal: bool,
    block_q: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of softmax(scale·QKᵀ + mask)·V from the fused kernel on encoded operands, verified; on a flag
    (mode "correct") recomputed and verified through the checked products. One host sync when clean."""
    from .checked import checked_backward

    def products() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        return checked_backward(layer, grad_out_BHTD, q_BHTD, k_BHSD, v_BHSD, out_BHTD, lse_BHT, mask_add,
                                scale=scale, is_causal=is_causal, block_q=block_q)

    t0 = time.perf_counter()
    dt = q_BHTD.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    d = q_BHTD.shape[-1]  # V's too: the kernel takes one head size
    t, s = q_BHTD.shape[-2], k_BHSD.shape[-2]
    inputs = _Inputs(grad_out_BHTD, q_BHTD, k_BHSD, v_BHSD, out_BHTD, lse_BHT, mask_add)
    with _exact_math(q_BHTD):
        (q_e, k_e, v_e, o_e, do_e), side = _encode(inputs, scale=scale, acc=acc)
    t_kernel = time.perf_counter()
    try:
        dq_e, dk_e, dv_e = _BACKWARD(do_e, q_e, k_e, v_e, o_e, lse_BHT, 0.0, is_causal, attn_mask=mask_add,
                                     scale=scale)
    except RuntimeError as exc:
        # A shape or mask this kernel build refuses at D + 5 (none known): the checked products instead, never a
        # crash of the training step.
        _warn_once(exc)
        dq, dk, dv, _ = products()
        return dq, dk, dv
    # The kernel's own time is the backward's, not the check's (its 5 extra head dims are not told apart).
    t0 += time.perf_counter() - t_kernel
    dq, dk, dv = dq_e[..., :d], dk_e[..., :d], dv_e[..., :d]
    with _exact_math(q_BHTD):
        ratios, bounds = _ratios(dq_e, dk_e, dv_e, side, d=d, t=t, s=s, scale=scale, dtype=dt,
                                 acc=acc, tol=_tolerance(layer))
        worst_4 = torch.stack([r.amax() for r in ratios])
        # NaN compares false: a non-finite residual or bound flags.
        flagged_4 = ~(worst_4 <= 1.0)
        if layer.runtime.stats is not None:
            _record_ratio(layer, torch.where(flagged_4, 0.0, worst_4), list(ENCODED_OPS))
    flagged = flagged_4.tolist()  # sync: the one per layer's backward on a checked step; gates the slow path
    seconds = (time.perf_counter() - t0) / len(ENCODED_OPS)
    if not any(flagged):
        for op in ENCODED_OPS:
            _count(layer, op, seconds)
        return dq, dk, dv
    t1 = time.perf_counter()
    checks = list(zip(ENCODED_OPS, flagged, ratios, bounds, strict=True))
    if not all(bool(torch.isfinite(x).all()) for x in inputs[:5]):  # sync: slow path only
        # A non-finite input (an fp16 gradient GradScaler overflowed on purpose, or an upstream fault its own op's
        # check reports) makes a non-finite backward on any path: not this kernel's fault, nothing to recompute.
        result = (dq, dk, dv)
    elif layer.config.mode != "correct":
        for op, bad, ratio, bound in checks:
            if bad:
                _emit_flag(layer, op, _output_of(op, dq, dk, dv), ratio, bound, action="detected")
        result = (dq, dk, dv)
    else:
        fresh = products()
        if not fresh[3]:
            # The checked products found nothing: the fault, if any, was in the fused result thrown away. A flagged
            # output that the fresh one matches (an fp16 overflow both computed, which GradScaler skips the step
            # for, or a bound the data came close to) is not reported.
            for op, bad, ratio, bound in checks:
                old = _output_of(op, dq, dk, dv)
                # dS's row sums show in dQ's rows: compared under dQ's bound.
                same_as = bounds[0] if op == "grad_probs" else bound
                if bad and not _agrees(old, _output_of(op, *fresh[:3]), same_as, side.u_fwd):
                    _emit_flag(layer, op, old, ratio, bound, action="recomputed")
        result = (fresh[0], fresh[1], fresh[2])
    extra = (time.perf_counter() - t1) / len(ENCODED_OPS)
    for op in ENCODED_OPS:
        _count(layer, op, seconds + extra)
    return result


@dataclass(slots=True)
class _Side:
    """What the bounds take from q, k, v, out and dO (accumulation dtype; ``_encode``)."""

    g_BHT: torch.Tensor
    """G_i: bounds |dP_ij - δ_i| for every key j."""
    rho_BHT: torch.Tensor
    """ρ_i ≥ Σ_j AP_ij of the kernel's AP."""
    k_max_BH: torch.Tensor
    g_do_top: torch.Tensor
    """The power of two the dO' bound column g₁ was divided by; g_dk_top: g₂'s."""
    g_dk_top: torch.Tensor
    flushed_v_BH: torch.Tensor
    """What the dV bound column can miss: tiny·Σ_i g₁_i (a low-precision GEMM flushes AP_ij below dtype's normal
    range to zero); flushed_k_BH: the same for g₂, the dK column."""
    flushed_k_BH: torch.Tensor
    u_fwd: float = 0.0
    """The operand rounding of the forward's fp32 products (TF32: 2^-10; IEEE: 0)."""


class _Inputs(NamedTuple):
    """The backward's inputs, as _VerifiedAttention hands them on."""

    do_BHTD: torch.Tensor
    q_BHTD: torch.Tensor
    k_BHSD: torch.Tensor
    v_BHSD: torch.Tensor
    out_BHTD: torch.Tensor
    lse_BHT: torch.Tensor
    mask_add: torch.Tensor | None


def _encode(inputs: _Inputs, *, scale: float, acc: torch.dtype) -> tuple[tuple[torch.Tensor, ...], _Side]:
    """(Q', K', V', O', dO') in the inputs' dtype (module docstring), and what the bounds are made of:

    G_i = 2‖dO_i‖·max_j‖V_j‖ (and a few roundings) bounds |dP_ij - δ_i| for every key j: |dP_ij| ≤ ‖dO_i‖‖V_j‖,
    and |δ_i| = |dO_i·O_i| ≤ ‖dO_i‖‖O_i‖ with ‖O_i‖ ≤ max_j‖V_j‖ (a row of O is a convex combination of V's);
    ρ_i = exp(ε_i) bounds Σ_j AP_ij of the kernel's AP = exp(scale·S + mask - lse): its S is recomputed in another
    order (and, for bf16, unrounded) from the forward's, ε_i = the largest difference that can make over the keys
    not masked away.

    Each operand is read once: on fp32, the pass that makes its checksums and norms (fused_pass) also writes it into
    its encoded buffer, followed by zeros, and only the few encoded columns are written after it. Where the kernel
    declines (other dtypes, no compiler), the sums are made eagerly and the buffers by one concatenation each."""
    do_BHTD, q_BHTD, k_BHSD, v_BHSD, out_BHTD, lse_BHT, mask_add = inputs
    d = q_BHTD.shape[-1]
    dt = q_BHTD.dtype
    u_in = torch.finfo(dt).eps / 2
    u_acc = torch.finfo(acc).eps / 2
    sums = _sum_weights(d, q_BHTD.device, acc)
    width = encoded_width(d)
    (c_q, q_norm_BHT, q_e), (c_k, k_norm_BHS, k_e), (c_do, do_norm_BHT, do_e) = (
        _read_into(x, sums, width, norms=True) for x in (q_BHTD, k_BHSD, do_BHTD))
    _, v_norm_BHS, v_e = _read_into(v_BHSD, None, width, norms=True)
    _, _, o_e = _read_into(out_BHTD, None, width)
    assert c_q is not None and c_k is not None and c_do is not None
    assert q_norm_BHT is not None and k_norm_BHS is not None and do_norm_BHT is not None and v_norm_BHS is not None
    k_max_BH, v_max_BH = k_norm_BHS.amax(-1), v_norm_BHS.amax(-1)
    g_BHT = do_norm_BHT * v_max_BH[..., None] * (2 + 4 * u_in + 2 * gamma(k_BHSD.shape[-2] + 8, acc))
    # ε: the scores' difference, |S| ≤ ‖q_i‖ max‖k_j‖: the forward rounded them to its dtype (bf16: AS is a bf16
    # product; the others form AS in fp32 or wider), scaled and masked them (one rounding each); both sides sum D
    # products in another order; lse carries a few roundings of its own size. An additive mask adds its size to
    # the rounded sum; keys below -200 contribute exp(-200) = 0 on either side.
    # Under TF32 (or oneDNN's bf16 fp32 mode) the forward's fp32 products rounded their operands too: its scores, and
    # its output (so δ), carry that rounding; the kernel here runs in IEEE fp32.
    u_fwd = (fp32_matmul_operand_roundoff(q_BHTD.device) or 0.0) if dt == torch.float32 else 0.0
    u_s = 3 * u_in if dt == torch.bfloat16 else 3 * u_acc + 2 * u_fwd
    s_max_BHT = scale * q_norm_BHT * k_max_BH[..., None]
    if mask_add is not None:
        m = mask_add.to(acc)
        live = torch.where(m > -200.0, m.abs(), 0.0).amax(-1)  # (B|1, H|1, T|1): broadcasts to (B, H, T)
        s_max_BHT = s_max_BHT + live
    lse_abs = torch.where(torch.isfinite(lse_BHT), lse_BHT.to(acc).abs(), 0.0)
    eps_BHT = (u_s + 2 * gamma(d, acc)) * s_max_BHT + 8 * u_acc * (1.0 + lse_abs)
    # Bound columns for dV = APᵀ dO and dK = scale·dSᵀ Q, summed by the kernel over its own AP (≥ 0): g₁ bounds
    # Σ_k |dO_ik| (√D ‖dO_i‖), g₂ Σ_j |dS_ij| Σ_k |Q_ik| over the rows of AP (√D ‖Q_i‖ G_i). Scaled into the
    # inputs' dtype (``_in_range``); the scale is multiplied back after the kernel.
    rho_BHT = torch.exp(eps_BHT)
    g1_BHT, g2_BHT = math.sqrt(d) * do_norm_BHT, math.sqrt(d) * q_norm_BHT * g_BHT
    # Room for the kernel's sums APᵀg ≤ T·max ρ·max g in the dtype's range (``_in_range``).
    room = torch.finfo(dt).max / (8 * max(1, g1_BHT.shape[-1]) * rho_BHT.amax().clamp(1.0, 2.0**40))
    g_do, g_do_top = _in_range(g1_BHT, room)
    g_dk, g_dk_top = _in_range(g2_BHT, room)
    # The kernel's bf16 (and maybe fp16) GEMM for dV' treats AP_ij below the normal range as 0, where the dS_ij it
    # makes of the same AP_ij for dK (times a large dP - δ) is a normal number: the dK bound column misses those
    # terms. Each is at most tiny·g_i. Found by the clean campaign's bf16 BERT with massive activations: dK rows of
    # 1e-26 under a bound column of 1e-29.
    tiny = torch.finfo(dt).smallest_normal
    flushed_v, flushed_k = tiny * g1_BHT.sum(-1), tiny * g2_BHT.sum(-1)
    # The encoded columns (module docstring) after each operand's D; every other column up to the width is 0.
    q_e = _encoded(q_BHTD, width, {d: c_q.to(dt)}, into=q_e)
    k_e = _encoded(k_BHSD, width, {d + 2: c_k.to(dt), d + 4: 1.0}, into=k_e)
    v_e = _encoded(v_BHSD, width, {}, into=v_e)
    o_e = _encoded(out_BHTD, width, {}, into=o_e)
    do_e = _encoded(do_BHTD, width, {d: c_do.to(dt), d + 2: g_do[..., None].to(dt), d + 3: g_dk[..., None].to(dt)},
                    into=do_e)
    side = _Side(g_BHT=g_BHT, rho_BHT=rho_BHT, k_max_BH=k_max_BH, g_do_top=g_do_top, g_dk_top=g_dk_top,
                 flushed_v_BH=flushed_v, flushed_k_BH=flushed_k,
                 u_fwd=u_fwd)
    return (q_e, k_e, v_e, o_e, do_e), side


def _rows_times(x_BHTD: torch.Tensor, w_DN: torch.Tensor | None, *, norms: bool = False
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``_read_into`` without a buffer: x @ w and the norms."""
    prod, norm, _ = _read_into(x_BHTD, w_DN, None, norms=norms)
    return prod, norm


def _read_into(x_BHTD: torch.Tensor, w_DN: torch.Tensor | None, width: int | None, *, norms: bool = False
               ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(x @ w (B, H, T, N) in the accumulation dtype, with norms also an upper bound on ‖x_i‖₂ (B, H, T)): for fp32
    on CPU in one read of x in its own layout (fused_pass: heads split from a projection are read as (B, T, H, D)
    rows, where a product of the (B, H, T, D) view copied them first); eagerly otherwise.

    The norm is sqrt(Σ x²) where that sum can be trusted, else √D·max|x|: squares of values below ~1e-18 underflow
    in fp32 (the gradient rows of padded tokens reach 1e-24, and a norm of 0 made a bound of 0 under a correct dQ),
    and above ~1e18 overflow.

    width: also x in a new buffer of that many head dims (``_buffer``), its columns after D zeroed, written by the same
    read (fused_pass's copy_to); returned third, or None where the kernel declined (``_encoded`` then copies)."""
    inside = x_BHTD.dim() == 4 and x_BHTD.stride(1) < x_BHTD.stride(2)
    x = x_BHTD.transpose(1, 2) if inside else x_BHTD
    buf = None if width is None else _buffer(x_BHTD, width)
    into = None if buf is None else buf.transpose(1, 2) if inside else buf
    sums = fused_pass(x, right=w_DN, row_sq=norms, row_max=norms, copy_to=into)
    if sums is not None:
        prod = None if sums.right is None else sums.right.view(*x.shape[:-1], -1)
        sq = None if sums.row_sq is None else sums.row_sq.view(x.shape[:-1])
        top = None if sums.row_max is None else sums.row_max.view(x.shape[:-1])
    else:
        buf = None  # the kernel declined: nothing written
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = x.to(acc)
        prod = None if w_DN is None else x @ w_DN.to(acc)
        sq = (x * x).sum(-1) if norms else None
        top = x.abs().amax(-1) if norms else None
    norm = None
    if sq is not None and top is not None:
        trusted = (top > _SQUARES_SAFE[0]) & (top < _SQUARES_SAFE[1])
        norm = torch.where(trusted, sq.sqrt(), math.sqrt(x.shape[-1]) * top)
    if inside:
        return (None if prod is None else prod.transpose(1, 2)), (None if norm is None else norm.transpose(1, 2)), buf
    return prod, norm, buf


_SQUARES_SAFE = (1e-18, 1e18)
"""Row maxima between which a row's fp32 sum of squares neither underflows nor overflows (fp32 normals reach
1.2e-38 and 3.4e38; D ≤ 2^10 terms)."""


def _in_range(x_BHT: torch.Tensor, room: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x divided by a power of two (exact), and that divisor, so that x's largest value sits at ``room``: the top of
    the dtype's range less what the kernel's sum APᵀx ≤ T·max ρ·max x needs (ρ ≥ a row sum of its AP). As high as
    it can go, because the rows' small values must not fall below the normal range. A bf16 GEMM flushes subnormal
    operands and products to zero: with x scaled to at most 1, the bound sums of BERT's padded rows (gradients ~1e-17
    beside rows of ~1e20, the clean campaign's bf16 `outliers` run) came out 0, a zero bound under correct dK and dV
    rows. ρ is there for TF32 or bf16 runs with massive activations, whose recomputed AP can sum far past 1 (an
    overflowed sum is an INF bound: it cannot flag, nor can it catch)."""
    top = x_BHT.amax().clamp_min(torch.finfo(x_BHT.dtype).tiny) / room
    top = torch.exp2(torch.ceil(torch.log2(top)))
    return x_BHT / top, top


def encoded_width(d: int) -> int:
    """Head dims of the encoded operands for a head dim d: d + ENCODED_COLS, padded to a multiple of
    WIDTH_MULTIPLE."""
    return d + ENCODED_COLS + _padding(d)


def _padding(d: int) -> int:
    """Zero columns after the ENCODED_COLS ones, to a width that is a multiple of WIDTH_MULTIPLE."""
    return -(d + ENCODED_COLS) % WIDTH_MULTIPLE


def _buffer(x_BHTD: torch.Tensor, width: int) -> torch.Tensor:
    """An uninitialised (B, H, T, width) buffer of x's dtype, stored as (B, T, H, width): the layout SDPA hands the
    kernel (heads split from a projection), which it otherwise copies its gradient input into."""
    if x_BHTD.dim() != 4:
        return x_BHTD.new_empty(*x_BHTD.shape[:-1], width)
    b, h, t, _ = x_BHTD.shape
    return x_BHTD.new_empty(b, t, h, width).transpose(1, 2)


def _encoded(x_BHTD: torch.Tensor, width: int, cols: dict[int, torch.Tensor | float], *,
             into: torch.Tensor | None) -> torch.Tensor:
    """x (..., D) widened to ``width`` head dims: at each offset of ``cols`` its columns (a tensor (..., n), or a
    value for one column), 0 elsewhere. into: a buffer that holds x and zeros already (``_read_into``), where only
    the columns are written; None: one concatenation in ``_buffer``'s layout (torch.cat ran faster than copying x
    and the columns into an empty buffer)."""
    if into is not None:
        for at, col in cols.items():
            if isinstance(col, torch.Tensor):
                into[..., at:at + col.shape[-1]] = col
            else:
                into[..., at] = col
        return into
    d, lead = x_BHTD.shape[-1], x_BHTD.shape[:-1]
    pieces, pos = [x_BHTD], d
    for at, col in sorted(cols.items()):
        if at > pos:
            pieces.append(x_BHTD.new_zeros(*lead, at - pos))
        piece = col.to(x_BHTD.dtype) if isinstance(col, torch.Tensor) else x_BHTD.new_full((*lead, 1), col)
        pieces.append(piece)
        pos = at + piece.shape[-1]
    if width > pos:
        pieces.append(x_BHTD.new_zeros(*lead, width - pos))
    if x_BHTD.dim() != 4:
        return torch.cat(pieces, dim=-1)
    return torch.cat([p.transpose(1, 2) for p in pieces], dim=-1).transpose(1, 2)


def _ratios(
    dq_e: torch.Tensor,
    dk_e: torch.Tensor,
    dv_e: torch.Tensor,
    side: _Side,
    *,
    d: int,
    t: int,
    s: int,
    scale: float,
    dtype: torch.dtype,
    acc: torch.dtype,
    tol: Tolerance,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per op of ENCODED_OPS: (the residual/bound ratio per row, the bound per row). A row's residual is the larger
    of its plain and weighted checksum differences (dS: |Σ_j dS_ij|).

    Each bound is 2× a round-off bound (docs/abft.md, "The encoded attention backward"): the kernel's accumulation
    and ours (calibrated: `sigmas` standard deviations of the modelled error, capped by the rigorous γ over the
    longest sum, in the accumulation dtype), the rounding of the checksum operands and of the outputs to the inputs'
    dtype (u), over a quantity that bounds Σ |terms| of the row: dQ_i: scale·ρ_i·G_i·√D·max‖K_j‖;
    dK_j and dV_j: the bound columns the kernel summed over its own AP. Plus an absolute floor: a bf16 GEMM flushes
    subnormal operands to zero."""
    u_in = torch.finfo(dtype).eps / 2
    u_acc = torch.finfo(acc).eps / 2
    n = s + t + d + 8
    tiny = torch.finfo(dtype).tiny * n
    accumulation = 2 * gamma(n, acc)
    if tol.mode == "roundoff" and tol.calibrated:
        # The calibrated model of abft.tolerance: rounding errors as independent, mean-zero, of variance ≤ u²/3 of
        # the partial sum they round, each partial sum ≤ the row's Σ|terms| (the quantities below). The D outputs'
        # accumulations, the checksum column's and ours add up to a variance ≤ u²·n·B², so `sigmas` standard
        # deviations are sigmas·u·√n·B, capped by the rigorous 2γ_n·B. The roundings to the inputs' dtype (3u_in)
        # stay rigorous: in bf16 they are most of the bound.
        accumulation = min(accumulation, tol.sigmas * u_acc * math.sqrt(n))
    rel = accumulation + 3 * u_in
    slack = 2.0 * (tol.factor if tol.mode == "roundoff" else 1.0)

    def residual(out_e: torch.Tensor, n: int, at: int) -> torch.Tensor:
        # Σ_k w_k out_ik - checksum_i as one product over the row's first at + 2 columns, read in place (fused_pass
        # takes the row stride; a product of the separate slices copied them first).
        prod, _ = _rows_times(out_e[..., :at + 2], _residual_weights(n, at, out_e.device, acc))
        assert prod is not None
        return prod.abs().amax(-1)

    b_q = scale * side.rho_BHT * side.g_BHT * math.sqrt(d) * side.k_max_BH[..., None]
    b_k = scale * (dv_e[..., d + 3].to(acc).abs() * side.g_dk_top * (1 + rel) + side.flushed_k_BH[..., None])
    b_v = dv_e[..., d + 2].to(acc).abs() * side.g_do_top * (1 + rel) + side.flushed_v_BH[..., None]
    ds1 = dq_e[..., d + 4].to(acc).abs()
    b_ds = scale * side.g_BHT * ((side.rho_BHT - 1) + side.rho_BHT * (rel + 2 * u_acc + 2 * side.u_fwd)) + u_in * ds1
    residuals = [residual(dq_e, d, d + 2), residual(dk_e, d, d), residual(dv_e, d, d), ds1]
    bounds = [slack * (rel * b + tiny * (1 + b)) for b in (b_q, b_k, b_v)] + [slack * (b_ds + tiny * (1 + b_ds))]
    if tol.mode == "extreme":
        bounds = [torch.full_like(b, tol.factor * tol.extreme_threshold) for b in bounds]
    return [r / b for r, b in zip(residuals, bounds, strict=True)], bounds


def _output_of(op: str, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """The output a check's flag points at: dS's row sums show in dQ's rows."""
    return {"grad_q": dq, "grad_k": dk, "grad_v": dv, "grad_probs": dq}[op]


def _agrees(old: torch.Tensor, new: torch.Tensor, bound_R: torch.Tensor, u_fwd: float = 0.0) -> bool:
    """Whether a flagged fused output is the checked products' one up to round-off: each row's Σ|old - new| within
    2× its check's bound, plus, under TF32, the products' own operand rounding (they run in the model's matmul
    precision, the kernel in IEEE fp32), leaving out the elements the products did not get finite either. Those are
    an overflow of the operands (fp16 under GradScaler, which skips the step; the two paths overflow in different
    places, the products' fp16 dP before the kernel's fp32 one) or a non-finite input, which its own op's check
    reports: not this kernel's fault. Slow path only."""
    same = (old == new) | ~torch.isfinite(new)
    old_w, new_w = old.to(bound_R.dtype), new.to(bound_R.dtype)
    diff = torch.where(same, 0.0, (old_w - new_w).abs()).sum(-1)
    tol = 2 * bound_R
    if u_fwd:
        tol = tol + 4 * u_fwd * torch.where(same, 0.0, old_w.abs() + new_w.abs()).sum(-1)
    # diff == 0 also where an overflowed bound column left the bound itself non-finite.
    return bool(((diff == 0) | (diff <= tol)).all())  # sync: slow path only


def _emit_flag(layer: LayerContext, op: str, out: torch.Tensor, ratio_R: torch.Tensor, bound_R: torch.Tensor, *,
               action: str) -> None:
    """The event of a flagged encoded check: at the worst row (non-finite first) and its most extreme element.
    out: (B, H, R, N). Slow path only."""
    flat = torch.where(torch.isnan(ratio_R), math.inf, ratio_R).reshape(-1)
    pos = int(flat.argmax())  # sync: slow path only
    b, h, r = (int(i) for i in torch.unravel_index(torch.tensor(pos), ratio_R.shape))
    value, (col,) = extreme_value(out[b, h, r])
    res = float(ratio_R[b, h, r] * bound_R[b, h, r])
    det = Detection(op=op, layer=layer.layer, step=layer.step, pattern="1d", kind=kind_of(value), action=action,
                    batch=b, head=h, row=r, col=col, value=value_to_wire(value),
                    residual=res if math.isfinite(res) else None, bound=float(bound_R[b, h, r]), tier="abft")
    _deliver(layer, det)
