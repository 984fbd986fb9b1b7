"""The exceptions ``attnchecker`` raises into user code. One base, so ``except AttnCheckerError`` catches them all.

Detections are data (``Guard.detections``, ``Guard.report()``), not exceptions: the only fault that raises is an
uncorrectable one under ``on_uncorrectable="raise"``. Invalid policies raise ``attnchecker.PolicyError``.
Torch-free on purpose: policy.py (parsed on the transport's thread) imports the base from here.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "AlreadyProtectedError",
    "AttnCheckerError",
    "GuardStateError",
    "NoProtectableAttentionError",
    "QuarantinedDeviceError",
    "QuarantinedDeviceWarning",
    "UncorrectableFault",
    "UnprotectedAttentionError",
    "UnsupportedDeviceError",
    "UnsupportedDtypeError",
]


class AttnCheckerError(Exception):
    """Base of every error ``attnchecker`` raises on purpose."""


class NoProtectableAttentionError(AttnCheckerError, TypeError):
    """``protect()`` found no attention it knows how to protect in the model."""


class AlreadyProtectedError(AttnCheckerError, RuntimeError):
    """The model, or one of its attention modules, already belongs to a live guard."""


class GuardStateError(AttnCheckerError, ValueError):
    """``Guard.load_state_dict`` was given something that is not a guard's state, or was called inside a step."""


class UnsupportedDtypeError(AttnCheckerError, TypeError):
    """The attention runs in a dtype the checksums are not calibrated for."""


class UnsupportedDeviceError(AttnCheckerError, TypeError):
    """The attention's parameters live on a device the engine does not run on."""


class UnprotectedAttentionError(AttnCheckerError, RuntimeError):
    """``protect(..., strict=True)``: some attention op would run unprotected (the message lists which and why)."""


class QuarantinedDeviceError(AttnCheckerError, RuntimeError):
    """``protect(..., strict=True)`` on a device an operator has quarantined on the collector."""


class QuarantinedDeviceWarning(UserWarning):
    """``protect()`` on a device an operator has quarantined on the collector (without ``strict``: it trains on)."""


class UncorrectableFault(AttnCheckerError, RuntimeError):
    """A fault survived correction and recomputation, and the policy says ``on_uncorrectable="raise"``.

    Attributes:
        detections: the uncorrectable records of the forward that raised.
    """

    def __init__(self, message: str, detections: Sequence[object] = ()) -> None:
        super().__init__(message)
        self.detections = list(detections)
