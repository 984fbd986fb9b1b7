"""Packed (varlen) attention, checked per sequence: ``torch.nn.attention.varlen.varlen_attn`` and flash-attn's
``flash_attn_varlen_func`` take documents packed into one (T, H, D) tensor with cumulative sequence lengths; here each
document is its own checked call through the backend contract (attention/backends), so no tile ever crosses a
document boundary: a plain or causal sequence on any backend (the native pass on CPU), a sliding window
(``window_size``) or a returned log-sum-exp in the tile loop, the window applied per tile as FlexAttention's masks are
(attention/tile_mods.py), with the gradient of attention/backward/modded.py.

When neither op is due, the caller's varlen kernel runs (``fused``; tier 1 on its output and row log-sum-exp), as
for FlexAttention; on CPU there is no such kernel (flash attention only), so a protected varlen model runs, and
trains, where the unprotected one cannot.

Legend: T packed query tokens, S packed key tokens, H query heads, Hk key/value heads, D head dim, N sequences.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..checks.context import LayerContext
from .flex import Fused, checked, fused_tier1
from .tile_mods import TileMods, Window, flex_lse
from .tripwire import _emit_trip

__all__ = ["protected_varlen_attention", "window_of"]


def window_of(window_size: tuple[int, int] | list[int] | None, *, causal: bool = False) -> tuple[int, int]:
    """(left, right) of a varlen call: flash-attn's ``causal=True`` is the window (-1, 0), as torch's varlen_attn
    writes it."""
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def protected_varlen_attention(
    q_THD: torch.Tensor,
    k_SHD: torch.Tensor,
    v_SHD: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    *,
    ctx: LayerContext,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    return_lse: bool = False,
    fused: Fused | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``varlen_attn``'s function, checked per sequence. q: (T, H, D), k/v: (S, Hk, D); cu_seq_q / cu_seq_k: (N + 1,)
    int offsets of the sequences (cu_seq_k None: the same as the queries'). window_size (left, right): key j is
    attended by query i of its sequence when i + off - left <= j <= i + off + right (off = S_n - T_n, flash-attn's
    bottom-right alignment), -1 for unbounded; (-1, 0) is causal. Returns out (T, H, D), and with return_lse the row
    log-sum-exp (H, T) fp32 as varlen_attn's (-INF where a row attends no key; tokens outside every sequence: out 0).
    fused: the caller's varlen kernel for this call, returning (out, lse (H, T)). One host-device sync for the
    sequence offsets, and one per sequence on clean input (its flags)."""
    if q_THD.dim() != 3 or k_SHD.dim() != 3 or v_SHD.dim() != 3:
        raise ValueError(f"varlen attention takes packed (T, H, D) tensors; got q {tuple(q_THD.shape)}, "
                         f"k {tuple(k_SHD.shape)}, v {tuple(v_SHD.shape)}")
    t, h, d = q_THD.shape
    hk = k_SHD.shape[1]
    if hk != h and not (enable_gqa and h % hk == 0):
        raise ValueError(f"q has {h} heads and k/v {hk}: pass enable_gqa=True with a divisor head count")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window_of(window_size)
    for name in ("q", "k", "v"):
        ctx.passed.take(name)
    # Tier 1 on the caller's kernel sees the packed call as one batch of one: the q/k norm bound over every key of a
    # head holds for each sequence's keys, a subset.
    as_batch = [x.transpose(0, 1)[None] for x in (q_THD, k_SHD, v_SHD)]
    kept, trip = fused_tier1(*as_batch, ctx=ctx, scale=scale, fused=_as_batch(fused), lse_bound=True)
    if kept is not None:
        out, lse = kept[0][0].transpose(0, 1), kept[1][0]
        return (out, lse) if return_lse else out
    offsets_q = _offsets(cu_seq_q, t, "cu_seq_q")
    offsets_k = offsets_q if cu_seq_k is None else _offsets(cu_seq_k, k_SHD.shape[0], "cu_seq_k")
    if len(offsets_k) != len(offsets_q):
        raise ValueError(f"cu_seq_q has {len(offsets_q) - 1} sequences and cu_seq_k {len(offsets_k) - 1}")
    force = frozenset(("scores", "context")) if trip is not None else frozenset()
    caught = [0]
    outs: list[torch.Tensor] = []
    lses: list[torch.Tensor] = []
    # Tokens before the first sequence and after the last attend nothing: out 0 and lse -INF, as the kernels leave them.
    gap = offsets_q[0]
    if gap:
        outs.append(q_THD.new_zeros(gap, h, v_SHD.shape[-1]))
        lses.append(torch.full((h, gap), -math.inf, device=q_THD.device))
    for n in range(len(offsets_q) - 1):
        q0, q1, k0, k1 = offsets_q[n], offsets_q[n + 1], offsets_k[n], offsets_k[n + 1]
        if q1 == q0:
            continue
        q_d, k_d, v_d = (x[a:b].transpose(0, 1)[None] for x, a, b in
                         ((q_THD, q0, q1), (k_SHD, k0, k1), (v_SHD, k0, k1)))
        mods, causal = _sequence_mods(left, right, q1 - q0, k1 - k0, h)
        out_d, lse_d = checked(q_d, k_d, v_d, ctx=ctx, mods=mods, scale=scale, is_causal=causal, force=force,
                               caught=caught, return_lse=return_lse)
        outs.append(out_d[0].transpose(0, 1))
        if lse_d is not None:
            lses.append(flex_lse(lse_d[0]))
    tail = t - offsets_q[-1]
    if tail:
        outs.append(q_THD.new_zeros(tail, h, v_SHD.shape[-1]))
        lses.append(torch.full((h, tail), -math.inf, device=q_THD.device))
    if trip is not None and not caught[0]:
        _emit_trip(ctx, trip, action="recomputed")
    out = torch.cat(outs) if outs else q_THD.new_zeros(0, h, v_SHD.shape[-1])
    return (out, torch.cat(lses, dim=1)) if return_lse else out


def _as_batch(fused: Fused | None) -> Fused | None:
    """The packed kernel's (out (T, H, D), lse (H, T)) as a batch of one (1, H, T, D), (1, H, T)."""
    if fused is None:
        return None

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = fused()
        return out.transpose(0, 1)[None], lse[None]

    return call


def _offsets(cu: torch.Tensor, total: int, name: str) -> list[int]:
    offsets = [int(x) for x in cu.tolist()]  # sync: the sequence boundaries decide the tiles, once per call
    if len(offsets) < 2 or any(b < a for a, b in itertools.pairwise(offsets)) or offsets[0] < 0 or offsets[-1] > total:
        raise ValueError(f"{name} must be non-decreasing offsets from >= 0 to at most {total} (N + 1 entries); "
                         f"got {offsets[:8]}{'…' if len(offsets) > 8 else ''}")
    return offsets


def _sequence_mods(left: int, right: int, t: int, s: int, heads: int) -> tuple[TileMods | None, bool]:
    """One sequence's mask: none, SDPA's causal (top-left, which is flash-attn's bottom-right when T = S), both plain
    attention any backend takes (the native pass, on CPU), or the window as a per-tile mask (the tile loop)."""
    if (left, right) == (-1, -1):
        return None, False
    if (left, right) == (-1, 0) and t == s:
        return None, True
    return TileMods(batch=1, heads=heads, t=t, s=s, window=Window(left, right, offset=s - t)), False
