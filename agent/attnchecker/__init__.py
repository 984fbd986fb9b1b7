"""ATTNChecker: fault-tolerant attention for training. ``protect(model)`` wraps the attention of an unmodified model
with ABFT checksums that detect and correct INF/NaN/near-INF and silent errors while it trains.

    guard = attnchecker.protect(model, optimizer=opt)   # or: with attnchecker.protect(model) as guard: ...
    ...train...
    guard.report(); guard.close()
"""

from __future__ import annotations

from .coverage import Coverage
from .errors import (
    AlreadyProtectedError,
    AttnCheckerError,
    GuardStateError,
    NoProtectableAttentionError,
    QuarantinedDeviceError,
    QuarantinedDeviceWarning,
    UncorrectableFault,
    UnprotectedAttentionError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)
from .events import Detection
from .inject import Fault, FaultPlan
from .policy import Policy, PolicyError
from .runtime.guard import FaultCounts, Guard, Report, is_protected, protect, unprotect

# The trainer callbacks import transformers / lightning when they exist: loaded on first use, so that
# `import attnchecker` stays light for a plain PyTorch training script.
_LAZY = {"AttnCheckerCallback", "AttnCheckerLightningCallback"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        from . import callbacks

        return getattr(callbacks, name)
    raise AttributeError(f"module 'attnchecker' has no attribute {name!r}")


__all__ = [
    "AlreadyProtectedError",
    "AttnCheckerCallback",
    "AttnCheckerError",
    "AttnCheckerLightningCallback",
    "Coverage",
    "Detection",
    "Fault",
    "FaultCounts",
    "FaultPlan",
    "Guard",
    "GuardStateError",
    "NoProtectableAttentionError",
    "Policy",
    "PolicyError",
    "QuarantinedDeviceError",
    "QuarantinedDeviceWarning",
    "Report",
    "UncorrectableFault",
    "UnprotectedAttentionError",
    "UnsupportedDeviceError",
    "UnsupportedDtypeError",
    "is_protected",
    "protect",
    "unprotect",
]

