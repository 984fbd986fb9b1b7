"""The attention backend contract: every way of computing a checked attention forward answers the same two questions.

- ``not_supported_reasons(call)``: why this backend cannot take this call, one reason a line ([] = it can). The
  reasons are what a user reads: ``Guard.coverage`` lists, per layer, the backend that ran its calls and why the ones
  ahead of it in the order did not (after xformers' fmha operators and PyTorch's SDPA backend checks).
- ``run(call)``: the call computed with its checks on the step's ops: the output (autograd attached), the row
  log-sum-exp where the backend has it, AP where the call asked for it. Detections reach the runtime through the
  records of ``checks/`` (at once on the CPU backends, at the step boundary from the device: ``checks/deferred.py``).

The pipeline (``attention/pipeline.py``) picks one backend per call with :func:`choose`, in the order of
:data:`BACKENDS` (fastest first; the unfused backend takes every call), or the one ``ATTNCHECKER_ATTENTION`` names.
A named backend that cannot take a call is passed over for the next one that can, with a warning that says why.

Legend: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ...checks.context import LayerContext

if TYPE_CHECKING:
    from ..tile_mods import TileMods

__all__ = ["BACKENDS", "BACKEND_ENV", "AttentionBackend", "AttentionCall", "BackendOutput", "Choice", "choose",
           "requested"]

log = logging.getLogger("attnchecker")

BACKEND_ENV = "ATTNCHECKER_ATTENTION"
"""auto (default): the first backend of BACKENDS that takes the call; one of BACKENDS: that one where it can."""
BACKENDS: tuple[str, ...] = ("triton", "native", "tiled", "unfused")
"""Every backend, in auto's order of preference: the fused Triton kernel (CUDA), the native CPU pass, the PyTorch
tile loop, the unfused path (which takes every call)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCall:
    """One checked attention call, as every backend sees it. q (B, H, T, D); k, v (B, Hk, S, D), Hk dividing H."""

    q_BHTD: torch.Tensor
    k_BHSD: torch.Tensor
    v_BHSD: torch.Tensor
    ctx: LayerContext
    attn_mask: torch.Tensor | None
    """bool (True = attend) or additive float, broadcastable to (B, H, T, S)."""
    is_causal: bool
    scale: float
    dropout_p: float
    return_probs: bool
    """The caller asked for AP (B, H, T, S) too."""
    paper: bool
    """Paper-faithful checksum passing: the q/k/v checksums come from the projections (``ctx.passed``)."""
    force: frozenset[str]
    """Ops verified whatever the step's config says (a tier-1 recovery; their events say tier "tripwire")."""
    injected: bool
    """``attnchecker.inject`` has a fault for this call: it writes into the PyTorch paths' tensors."""
    requested: str
    """What ``ATTNCHECKER_ATTENTION`` asked for: "auto" or a backend's name."""
    caught: list[int]
    """[n]: detections emitted for this call so far (the pipeline's tier-1 event depends on it)."""
    mods: TileMods | None = None
    """A FlexAttention call's score_mod and BlockMask, or a varlen sequence's window (attention/tile_mods.py): the
    scores changed per tile, which only a backend that applies them per tile can take."""
    return_lse: bool = False
    """The caller takes the row log-sum-exp too, as an output with its own gradient (flex_attention's return_aux,
    torchtitan's out_transform, the varlen op)."""

    @property
    def mask_grad(self) -> bool:
        """A mask that requires grad (a learned bias): only a graph through the mask gives its gradient."""
        return self.attn_mask is not None and self.attn_mask.requires_grad and torch.is_grad_enabled()

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(x.requires_grad for x in (self.q_BHTD, self.k_BHSD, self.v_BHSD))


@dataclass(frozen=True, slots=True)
class BackendOutput:
    out_BHTD: torch.Tensor
    """softmax(scale·QKᵀ + mask)·V, verified, with autograd attached."""
    lse_BHT: torch.Tensor | None = None
    """Row log-sum-exp of scale·QKᵀ + mask (+INF on rows with every key masked), where the backend made it."""
    probs_BHTS: torch.Tensor | None = None
    """AP, when the call asked for it (``return_probs``)."""


class AttentionBackend(Protocol):
    name: str
    """One of BACKENDS."""

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Why this backend cannot take ``call`` ([] = it can). No host-device sync, no pass over the tensors."""
        ...

    def run(self, call: AttentionCall) -> BackendOutput:
        ...


def requested() -> str:
    """ATTNCHECKER_ATTENTION: "auto" or one of BACKENDS. Raises ValueError on anything else."""
    mode = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if mode != "auto" and mode not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={mode!r}: use auto or one of {', '.join(BACKENDS)}")
    return mode


@dataclass(frozen=True, slots=True)
class Choice:
    backend: AttentionBackend
    declined: dict[str, tuple[str, ...]]
    """name -> reasons, for every backend tried before the one chosen."""


_warned: set[tuple[str, str]] = set()


def choose(call: AttentionCall, backends: Sequence[AttentionBackend]) -> Choice:
    """The first of ``backends`` (auto's order) that takes ``call``; a backend ATTNCHECKER_ATTENTION names is tried
    first, and passed over with a warning (once per reason) where it cannot take the call."""
    order = list(backends)
    if call.requested != "auto":
        named = [b for b in order if b.name == call.requested]
        order = named + [b for b in order if b.name != call.requested]
    declined: dict[str, tuple[str, ...]] = {}
    for backend in order:
        reasons = backend.not_supported_reasons(call)
        if not reasons:
            return Choice(backend, declined)
        declined[backend.name] = tuple(reasons)
        if backend.name == call.requested and (backend.name, reasons[0]) not in _warned:
            _warned.add((backend.name, reasons[0]))
            log.warning("attnchecker: %s=%s cannot take this call (%s); layer %d runs on the next backend that can",
                        BACKEND_ENV, backend.name, "; ".join(reasons), call.ctx.layer)
    # The unfused backend takes every call but those only the tile loop takes (per-tile mods, a differentiable lse).
    raise RuntimeError(f"no attention backend takes this call: {declined}")
