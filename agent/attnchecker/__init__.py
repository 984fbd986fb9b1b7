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
    NoProtectableAttentionError,
    UncorrectableFault,
    UnprotectedAttentionError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)
from .events import Detection
from .guard import FaultCounts, Guard, Report, is_protected, protect, unprotect
from .inject import Fault, FaultPlan
from .policy import Policy, PolicyError

__all__ = [
    "AlreadyProtectedError",
    "AttnCheckerError",
    "Coverage",
    "Detection",
    "Fault",
    "FaultCounts",
    "FaultPlan",
    "Guard",
    "NoProtectableAttentionError",
    "Policy",
    "PolicyError",
    "Report",
    "UncorrectableFault",
    "UnprotectedAttentionError",
    "UnsupportedDeviceError",
    "UnsupportedDtypeError",
    "is_protected",
    "protect",
    "unprotect",
]

