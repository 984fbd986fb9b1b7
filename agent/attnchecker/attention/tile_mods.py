"""FlexAttention's ``score_mod`` and ``block_mask`` (and a varlen call's sliding window) applied to one tile of the
attention scores: what a tiled checked attention needs to compute ``flex_attention``'s function tile by tile.

Used by the PyTorch tile loop (attention/backends/tiled_torch.py) and the checked backward of such a call
(attention/backward/modded.py); a fused kernel can take the same pieces: the key range each query block visits, and
per tile the elements masked and the function applied to the scaled scores.

Semantics, as FlexAttention's: score = score_mod(scale·q·k, b, h, q_idx, kv_idx); an element in a block the BlockMask
leaves out is masked, one in a full block is kept without calling mask_mod, one in a partial block is kept where
mask_mod(b, h, q_idx, kv_idx) is True. The mods are evaluated vectorised over a tile's (b, h, q_idx, kv_idx) ranges with
torch.vmap over the four index dimensions, as FlexAttention's own reference does, so a mod written for flex (scalar
tensors, no data-dependent control flow) runs unchanged.

Legend: B batch, H query heads, Bm/Hm the BlockMask's (1 where it broadcasts), T queries, S keys, Tq/Tk one tile's
rows/keys, Qb/Kb the BlockMask's query/key blocks.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MaskMod", "ScoreMod", "TileMods", "Window", "flex_lse"]

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

EMPTY, PARTIAL, FULL = 0, 1, 2


def _over_bhqk(fn: Callable[..., torch.Tensor], score: bool) -> Callable[..., torch.Tensor]:
    """fn vmapped over (b, h, q_idx, kv_idx) (and the score's matching dims), innermost kv_idx, as FlexAttention's
    reference applies its mods: a mod sees 0-d tensors and returns a 0-d tensor."""
    prefix = (0,) if score else ()
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims)
    return fn


@dataclass(frozen=True, slots=True)
class Window:
    """A varlen call's window (flash-attn's ``window_size``): query i attends key j when
    i + offset - left <= j <= i + offset + right, a negative bound meaning unbounded on that side; offset = S - T
    aligns the window bottom-right, as flash-attn does when a sequence has more keys than queries."""

    left: int
    right: int
    offset: int = 0

    def allows(self, q_idx_Tq1: torch.Tensor, kv_idx_1Tk: torch.Tensor) -> torch.Tensor:
        rel = kv_idx_1Tk - (q_idx_Tq1 + self.offset)
        ok = torch.ones_like(rel, dtype=torch.bool)
        if self.left >= 0:
            ok &= rel >= -self.left
        if self.right >= 0:
            ok &= rel <= self.right
        return ok

    def key_range(self, r0: int, r1: int, s: int) -> tuple[int, int]:
        lo = 0 if self.left < 0 else max(0, r0 + self.offset - self.left)
        hi = s if self.right < 0 else min(s, r1 - 1 + self.offset + self.right + 1)
        return (lo, hi) if lo < hi else (0, 0)


@dataclass(frozen=True, slots=True)
class _Blocks:
    """A BlockMask as dense block states: on the device (Bm, Hm, Qb, Kb) uint8 for the per-element gather, and the same
    on the host for the per-tile decisions (which keys a query block visits, whether a tile calls mask_mod)."""

    states: torch.Tensor
    host: torch.Tensor
    size: tuple[int, int]
    mask_mod: MaskMod


# One host copy per BlockMask: a model builds one per step and every layer's call reads it.
_HOST: weakref.WeakKeyDictionary[Any, _Blocks] = weakref.WeakKeyDictionary()


def _dense(num_BHQ: torch.Tensor, idx_BHQK: torch.Tensor, width: int) -> torch.Tensor:
    """(B, H, Q, width) bool from a BlockMask's (num_blocks, indices) pair: the first num[q] indices of row q."""
    valid = torch.arange(idx_BHQK.shape[-1], device=idx_BHQK.device) < num_BHQ[..., None]
    out = torch.zeros(*num_BHQ.shape, width + 1, dtype=torch.bool, device=num_BHQ.device)
    out.scatter_(-1, torch.where(valid, idx_BHQK.long(), width), True)
    return out[..., :width]


def _blocks(block_mask: Any, t: int, s: int) -> _Blocks:
    cached = _HOST.get(block_mask)
    if cached is not None:
        return cached
    q_block, k_block = block_mask.BLOCK_SIZE
    width = max(block_mask.kv_indices.shape[-1], -(-s // k_block))
    partial = _dense(block_mask.kv_num_blocks, block_mask.kv_indices, width)
    states = partial.to(torch.uint8) * PARTIAL
    if block_mask.full_kv_num_blocks is not None:
        full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, width)
        states = torch.where(full, FULL, states)
    rows = -(-t // q_block)
    states = states[..., :rows, :].to(torch.uint8).contiguous()
    # Once per BlockMask (a step's mask is shared by every layer): the tiles a call visits are decided on the host.
    host = states.cpu()  # sync: once per BlockMask, above
    blocks = _Blocks(states=states, host=host, size=(q_block, k_block), mask_mod=block_mask.mask_mod)
    _HOST[block_mask] = blocks
    return blocks


@dataclass(frozen=True, slots=True)
class TileMods:
    """What FlexAttention (or a varlen window) does to the scores of one call of shape (B, H, T, S)."""

    batch: int
    heads: int
    t: int
    s: int
    score_mod: ScoreMod | None = None
    blocks: _Blocks | None = None
    window: Window | None = None

    @classmethod
    def of_flex(cls, block_mask: Any, score_mod: ScoreMod | None, *, batch: int, heads: int, t: int, s: int
                ) -> TileMods:
        """The mods of one ``flex_attention`` call. Raises ValueError for a BlockMask made for other lengths, as
        flex_attention does."""
        blocks = None
        if block_mask is not None:
            if tuple(block_mask.seq_lengths) != (t, s):
                raise ValueError(
                    f"the BlockMask was made for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, the call has "
                    f"({t}, {s}): create it for the call's lengths (create_block_mask), as flex_attention requires")
            mb, mh = block_mask.kv_num_blocks.shape[:2]
            if mb not in (1, batch) or mh not in (1, heads):
                raise ValueError(f"the BlockMask's batch and heads ({mb}, {mh}) do not broadcast to the call's "
                                 f"({batch}, {heads})")
            blocks = _blocks(block_mask, t, s)
        return cls(batch=batch, heads=heads, t=t, s=s, score_mod=score_mod, blocks=blocks)

    @property
    def masks(self) -> bool:
        return self.blocks is not None or self.window is not None

    def key_ranges(self, rows: list[tuple[int, int]]) -> tuple[tuple[int, int], ...] | None:
        """[lo, hi) of the keys each query block (rows r0..r1) may attend: the span of the blocks the BlockMask keeps
        for any of its rows, batches and heads, or the window's reach. None: every key."""
        if self.window is not None:
            return tuple(self.window.key_range(r0, r1, self.s) for r0, r1 in rows)
        if self.blocks is None:
            return None
        q_block, k_block = self.blocks.size
        kept_QbKb = (self.blocks.host > EMPTY).flatten(0, 1).any(0)
        ranges = []
        for r0, r1 in rows:
            cols = kept_QbKb[r0 // q_block : -(-r1 // q_block)].any(0).nonzero()
            ranges.append((0, 0) if len(cols) == 0 else
                          (int(cols[0]) * k_block, min(self.s, (int(cols[-1]) + 1) * k_block)))
        return tuple(ranges)

    def blocked(self, r0: int, r1: int, c0: int, c1: int, device: torch.device) -> torch.Tensor | None:
        """(Bm, Hm, Tq, Tk) bool, True where the element of tile (r0..r1, c0..c1) is masked; None when none is."""
        q_idx = torch.arange(r0, r1, device=device)
        kv_idx = torch.arange(c0, c1, device=device)
        if self.window is not None:
            return ~self.window.allows(q_idx[:, None], kv_idx[None, :])[None, None]
        if self.blocks is None:
            return None
        q_block, k_block = self.blocks.size
        qb, kb = slice(r0 // q_block, -(-r1 // q_block)), slice(c0 // k_block, -(-c1 // k_block))
        region = self.blocks.host[..., qb, kb]
        if bool((region == FULL).all()):
            return None
        states = self.blocks.states[..., q_idx // q_block, :][..., kv_idx // k_block]
        kept = states == FULL
        if bool((region == PARTIAL).any()):
            mb, mh = states.shape[:2]
            fn = _over_bhqk(self.blocks.mask_mod, score=False)
            allowed = fn(torch.arange(mb, device=device), torch.arange(mh, device=device), q_idx, kv_idx)
            kept = kept | ((states == PARTIAL) & allowed.to(torch.bool))
        return ~kept

    def score_fn(self, r0: int, c0: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """score_mod bound to the tile whose first row is r0 and first key c0: (B, H, Tq, Tk) scaled scores in, the
        modified scores out; None without a score_mod."""
        score_mod = self.score_mod
        if score_mod is None:
            return None

        def apply(z_BHTqTk: torch.Tensor) -> torch.Tensor:
            b, h, tq, tk = z_BHTqTk.shape
            dev = z_BHTqTk.device
            fn = _over_bhqk(score_mod, score=True)
            return fn(z_BHTqTk, torch.arange(b, device=dev), torch.arange(h, device=dev),
                      torch.arange(r0, r0 + tq, device=dev), torch.arange(c0, c0 + tk, device=dev))

        return apply


def flex_lse(lse_BHT: torch.Tensor) -> torch.Tensor:
    """The tile loop's row log-sum-exp in FlexAttention's convention: -INF (not +INF) for a row with every key
    masked, as flex_attention returns it."""
    return torch.where(torch.isposinf(lse_BHT), -math.inf, lse_BHT)
