"""The native CPU backend: the tile contract in one C pass per query block (kernels/fused_attention.c), its rows
verified where their sums are made (native_rules.py); a flagged call is recomputed through the PyTorch tile loop
(tiled_torch.py), which checks both directions and locates and repairs a fault that repeats. Auto takes it at every
T·S where it applies: it is faster than the unfused path at every size measured (docs/performance.md §5)."""
from __future__ import annotations

import os

from ...kernels import fused_attention
from . import AttentionCall, BackendOutput
from .tiled_torch import KERNEL_BLOCK_Q, TILE_BUDGET, TILE_ENV, mods_reasons, run_tiled, tile_reasons

__all__ = ["NativeBackend"]


class NativeBackend:
    name = "native"

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tile_reasons(call) + mods_reasons(call, "the native pass")
        if call.injected:
            reasons.append("attnchecker.inject has a fault for this call, and it writes into the PyTorch paths' "
                           "tensors (the kernel's own faults: fused_attention.emulated_faults)")
        if os.environ.get(TILE_ENV) is not None:
            reasons.append(f"{TILE_ENV} asks for the PyTorch loop's tile sizes")
        s = call.k_BHSD.shape[-2]
        if KERNEL_BLOCK_Q * s > TILE_BUDGET:
            reasons.append(f"a block of {KERNEL_BLOCK_Q} x S = {s} scores is over the tile budget ({TILE_BUDGET})")
        return reasons + fused_attention.not_supported_reasons(
            call.q_BHTD, call.k_BHSD, call.v_BHSD, is_causal=call.is_causal, scale=call.scale,
            attn_mask=call.attn_mask)

    def run(self, call: AttentionCall) -> BackendOutput:
        return run_tiled(call, kernel=True)
