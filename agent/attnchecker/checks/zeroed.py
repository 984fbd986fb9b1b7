"""Zero-filled fp32 device memory for the checks' atomics, handed out in slices of larger chunks: one memset a chunk
instead of one a checked call.

The GPU path's kernels accumulate their outcome (a check's ``state``: counts, flags, the worst ratio) and some sums with
atomics, so each call needs memory that is zero when its first kernel starts. Allocated per call, that is a memset per
call: on a scope="all" step between full checks two a Linear (its forward's, its backward's), as many as its tier-1
launches, in a step that a small model leaves launch-bound on a GPU (docs/performance.md §10). Here a chunk is zeroed
once and each slice handed out once: no slice is reused, so nothing has to be zeroed again or ordered against the
kernels that still write or read an earlier slice. A chunk lives as long as any of its slices does (a deferred record
keeps its state slice until the step boundary reads it), so memory is returned as the slices' holders let go, chunk by
chunk.

Requests larger than a quarter chunk (a full check's operand sums on a wide layer) get their own allocation, as
before: they would otherwise keep a chunk, and every slice in it, alive for as long as they live.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["ALIGN_FLOATS", "CHUNK_FLOATS", "ZeroedArena"]

CHUNK_FLOATS = 1 << 18
"""Floats a chunk holds (1 MiB): a tier-1 call takes 16 a GEMM (its state), so a chunk serves a Llama-7B step between
full checks (32 layers, 7 Linears: about 11,000 floats with the attention's) some twenty times over."""


ALIGN_FLOATS = 4
"""Each slice starts on a 16-byte boundary, as an allocation of its own does: Triton specialises a kernel on its pointer
arguments' 16-byte alignment, so a slice off it would compile (and run) another variant of the same kernel."""


class ZeroedArena:
    """Slices of zero-filled fp32 memory, by device. Thread-safe; no host-device sync (a chunk is ``torch.zeros``)."""

    def __init__(self, chunk_floats: int = CHUNK_FLOATS) -> None:
        if chunk_floats < 1:
            raise ValueError(f"ZeroedArena: chunk_floats must be at least 1, got {chunk_floats}")
        self.chunk_floats = chunk_floats
        self._chunks: dict[torch.device, tuple[torch.Tensor, int]] = {}
        self._lock = threading.Lock()
        self.chunks_made = 0
        """Chunks allocated (memsets), over all devices: what a test or a count of launches reads."""

    def take(self, device: torch.device, n: int) -> torch.Tensor:
        """(n,) fp32 zeros on ``device``, never handed out before, 16-byte aligned."""
        if n < 0:
            raise ValueError(f"ZeroedArena.take: n must be at least 0, got {n}")
        if n > self.chunk_floats // 4:
            return torch.zeros(n, device=device, dtype=torch.float32)
        with self._lock:
            buf, used = self._chunks.get(device, (None, 0))
            used = -(-used // ALIGN_FLOATS) * ALIGN_FLOATS
            if buf is None or used + n > buf.numel():
                buf, used = torch.zeros(self.chunk_floats, device=device, dtype=torch.float32), 0
                self.chunks_made += 1
            self._chunks[device] = (buf, used + n)
        return buf[used:used + n]
