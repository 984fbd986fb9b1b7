"""Whether the whole step is protected (protect(scope="all")) and its GEMMs checked on this step: asked by the
attention's backward (attention.backward.fused) and decided here, below both it and gemm.linear, which registers the
guards."""
from __future__ import annotations

from ..checks.context import Runtime
from ..policy import WHOLE_STEP_SCHEDULE

__all__ = ["gemm_due", "gemm_trips", "whole_step", "whole_step_checked", "whole_step_due", "whole_step_trips"]


# Runtimes (by id) of the guards attached with scope="all": the attention backward asks whether its guard is one.
_WHOLE_STEP: set[int] = set()


def whole_step(runtime: Runtime) -> bool:
    """Whether this guard protects the whole step (scope="all"), whatever this step checks."""
    return id(runtime) in _WHOLE_STEP


def whole_step_due(runtime: Runtime) -> bool:
    """Whether this guard protects the whole step (scope="all") and its GEMMs are checked on the current step."""
    return id(runtime) in _WHOLE_STEP and gemm_due(runtime)


def gemm_due(runtime: Runtime) -> bool:
    """Whether the whole-step GEMMs are fully checked on the current step: the one place that decides, so it can
    follow a tier/schedule of its own later. Today they ride on the output projection's schedule (the adaptive
    scheduler's ``out`` op: the last GEMM of a layer, checked when the layer is; ``WHOLE_STEP_SCHEDULE``)."""
    return runtime.config.checks(WHOLE_STEP_SCHEDULE)


def gemm_trips(runtime: Runtime) -> bool:
    """Whether the whole-step GEMMs get tier 1 on the current step: the tripwire is on and their full check is not due
    (the ``out`` op's, as in ``gemm_due``). An INF, NaN or near-INF output then recovers through the full check."""
    return runtime.config.trips(WHOLE_STEP_SCHEDULE)


def gemm_tier(runtime: Runtime) -> str | None:
    """The tier of the whole-step GEMMs on the current step: "abft" (``gemm_due``), "tripwire" (``gemm_trips``), or
    None (neither: the module's own forward and autograd's backward)."""
    return "abft" if gemm_due(runtime) else "tripwire" if gemm_trips(runtime) else None


def whole_step_trips(runtime: Runtime) -> bool:
    """Whether this guard protects the whole step and its GEMMs get tier 1 (not the full check) on this step."""
    return id(runtime) in _WHOLE_STEP and gemm_trips(runtime)


def whole_step_checked(runtime: Runtime) -> bool:
    """Whether this guard protects the whole step and its GEMMs get a check on this step, in full or by tier 1 (not
    under mode "off", nor with the tripwire off on a step the full check is not due)."""
    return whole_step_due(runtime) or whole_step_trips(runtime)
