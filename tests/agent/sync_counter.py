"""A TorchFunctionMode that records every call making the host wait for a device tensor's value (.item, .tolist,
bool(), .cpu(), .nonzero(), ...): a test of "no host sync on the fast path" counts them. No tests here."""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SYNCS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.cpu, torch.Tensor.numpy,
                   torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero})


class SyncCounter(TorchFunctionMode):
    """``with SyncCounter() as syncs: ...``; ``syncs.calls`` names each sync in order."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))
