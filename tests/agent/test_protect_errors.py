"""protect() refuses what it cannot protect, with errors that say what to do."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker import (
    AlreadyProtectedError,
    AttnCheckerError,
    NoProtectableAttentionError,
    Policy,
    PolicyError,
    UnsupportedDeviceError,
    UnsupportedDtypeError,
)

# The model zoo lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import NanoGPT, build


def test_protect_without_attention_lists_what_is_supported() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(NoProtectableAttentionError) as e:
        attnchecker.protect(model)
    msg = str(e.value)
    for supported in ("transformers", "GPT-2", "BERT", "GPT-Neo", "scaled_dot_product_attention", "MultiheadAttention"):
        assert supported in msg
    assert not attnchecker.is_protected(model)
    assert isinstance(e.value, AttnCheckerError)


def test_protect_non_module_is_refused() -> None:
    with pytest.raises(NoProtectableAttentionError, match=r"torch\.nn\.Module"):
        attnchecker.protect(object())  # type: ignore[arg-type]


def test_protect_twice_is_refused_until_closed() -> None:
    model = NanoGPT()
    guard = attnchecker.protect(model)
    try:
        with pytest.raises(AlreadyProtectedError, match="already protected"):
            attnchecker.protect(model)
        # A part of a protected model is protected too.
        with pytest.raises(AlreadyProtectedError, match="already protected"):
            attnchecker.protect(model.h[0])
        assert attnchecker.is_protected(model)
        assert attnchecker.is_protected(model.h[0])
    finally:
        guard.close()
    assert not attnchecker.is_protected(model)
    attnchecker.protect(model).close()


def test_protect_float64_model_raises_unsupported_dtype() -> None:
    model = NanoGPT().double()
    with pytest.raises(UnsupportedDtypeError, match=r"float64.*model\.float\(\)"):
        attnchecker.protect(model)
    # Refused cleanly: nothing stays attached.
    assert not attnchecker.is_protected(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_protect_meta_device_raises_unsupported_device() -> None:
    with torch.device("meta"):
        model = NanoGPT()
    with pytest.raises(UnsupportedDeviceError, match="meta"):
        attnchecker.protect(model)
    assert not attnchecker.is_protected(model)


@pytest.mark.parametrize(("kwargs"), [{"collector": "127.0.0.1:8000"}, {"token": "secret"}])
def test_protect_with_bad_streaming_arguments_raises(kwargs: dict[str, str]) -> None:
    # Streaming is wired (issue 5): a collector must be a URL or "offline", and a token needs a collector.
    model = NanoGPT()
    with pytest.raises(ValueError, match="collector"):
        attnchecker.protect(model, **kwargs)
    assert not attnchecker.is_protected(model)


def test_protect_bad_policy_names_the_field() -> None:
    model = NanoGPT()
    with pytest.raises(PolicyError, match=r"policy\.mode"):
        attnchecker.protect(model, policy={"mode": "sometimes"})
    with pytest.raises(PolicyError, match="Policy"):
        attnchecker.protect(model, policy="full")  # type: ignore[arg-type]
    assert not attnchecker.is_protected(model)


def test_guard_set_policy_validates_now_and_applies_at_the_next_step() -> None:
    model = NanoGPT()
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        with pytest.raises(PolicyError, match=r"policy\.period"):
            guard.set_policy({"period": 0})
        guard.set_policy(Policy.full(mode="detect", version=7))
        assert guard.policy.mode == "correct"
        assert guard.check_config.mode == "correct"
        guard.step()
        assert guard.policy.version == 7
        assert guard.check_config.mode == "detect"


def test_unprotect_closes_the_guard() -> None:
    model = build("nanogpt")
    guard = attnchecker.protect(model)
    assert attnchecker.unprotect(model) is True
    assert guard.closed
    assert not attnchecker.is_protected(model)
    assert attnchecker.unprotect(model) is False
