"""protect() -> close() leaves the model exactly as it was: forward, state_dict keys, attention implementation,
hooks and attributes."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker import Policy

# The model zoo lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import ARCHS, batch, build, loss_of


def _snapshot(model: nn.Module) -> dict[str, Any]:
    """Everything protect() could touch on the modules, as plain comparable data."""
    modules = {}
    for name, m in model.named_modules():
        modules[name] = (
            type(m),
            sorted(m.__dict__),
            len(m._forward_hooks),
            len(m._forward_pre_hooks),
            len(m._forward_hooks_with_kwargs),
            len(m._forward_hooks_always_called),
            len(m._backward_hooks),
        )
    config = getattr(model, "config", None)
    return {
        "modules": modules,
        "attn_implementation": getattr(config, "_attn_implementation", None),
        "config": copy.deepcopy(vars(config)) if config is not None else None,
        "state_dict": list(model.state_dict()),
        "fastpath": torch.backends.mha.get_fastpath_enabled(),
    }


def _forward(arch: str, model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return loss_of(arch, model, batch(arch, 0))


@pytest.mark.parametrize("arch", [*ARCHS, "torch_encoder_seq_first"])
def test_protect_close_round_trip_restores_model(arch: str) -> None:
    model = build(arch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = _snapshot(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    want = _forward(arch, model)

    guard = attnchecker.protect(model, policy=Policy.full(), optimizer=opt)
    assert guard.sites, "nothing was protected"
    if getattr(model, "config", None) is not None and arch != "gpt_neo":
        assert model.config._attn_implementation == "attnchecker"
    during = _forward(arch, model)
    assert guard.report().checks["scores"] > 0
    assert list(model.state_dict()) == before["state_dict"], "protection must not add state"
    guard.close()
    guard.close()  # idempotent

    assert _snapshot(model) == before
    assert not opt._optimizer_step_pre_hooks
    assert not opt._optimizer_step_post_hooks
    assert not attnchecker.is_protected(model)
    torch.testing.assert_close(_forward(arch, model), want, rtol=0, atol=0)
    torch.testing.assert_close(during, want, rtol=1e-5, atol=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_context_manager_closes_on_error() -> None:
    model = build("nanogpt")
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), attnchecker.protect(model):
        raise RuntimeError("boom")
    assert _snapshot(model) == before


def test_forward_error_inside_attention_leaves_no_mode_active() -> None:
    model = build("nanogpt")
    proj = model.h[0].attn.c_proj

    def boom(_x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with attnchecker.protect(model, policy=Policy.full()):
        proj.forward = boom  # raises after the protected SDPA call, inside the attention module's forward
        with pytest.raises(RuntimeError, match="boom"):
            model(batch("nanogpt", 0)["ids"])
        del proj.forward
        # The TorchFunctionMode left with the failed forward (always-called hook).
        assert torch._C._len_torch_function_stack() == 0
        model(batch("nanogpt", 0)["ids"])
