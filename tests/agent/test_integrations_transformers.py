"""transformers specifics: masks survive the switch, several guards coexist, the registration left behind is inert."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import attnchecker
from attnchecker import Fault, FaultPlan, Policy

# The model zoo lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import SEQ, batch, build

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def _logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neo", "llama"])
def test_causal_mask_is_kept_under_protection(arch: str) -> None:
    """Without the AttentionMaskInterface registration transformers would drop the causal mask silently: changing
    the last token must not change any earlier position's logits."""
    model = build(arch).eval()
    ids = batch(arch, 0)["ids"]
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 128
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        a, b = _logits(model, ids), _logits(model, changed)
        assert guard.report().checks["scores"] > 0
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_gpt_neo_local_layer_keeps_its_window() -> None:
    """Layer 1 of the zoo's GPT-Neo is local (window 8): a token 12 positions back is outside it."""
    model = build("gpt_neo").eval()
    x = torch.randn(1, SEQ, 64)
    attn = model.transformer.h[1].attn.attention
    assert attn.attention_type == "local"
    want, _ = attn(x)
    changed = x.clone()
    changed[:, 0] += 1.0
    with attnchecker.protect(model, policy=Policy.full()):
        got, _ = attn(x)
        got_changed, _ = attn(changed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Position 12 attends to 5..12 only: the change at position 0 does not reach it (it does reach position 3).
    torch.testing.assert_close(got_changed[:, 12:], got[:, 12:])
    assert not torch.allclose(got_changed[:, 3], got[:, 3])


def test_bert_padding_mask_is_kept_under_protection() -> None:
    model = build("bert").eval()
    b = batch("bert", 0)
    want = _logits(model, b["ids"], attention_mask=b["keep"])
    with attnchecker.protect(model, policy=Policy.full()):
        got = _logits(model, b["ids"], attention_mask=b["keep"])
        unmasked = _logits(model, b["ids"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[1], got[1], atol=1e-4), "the padding mask had no effect"


def test_two_models_protected_at_once_keep_their_own_layers() -> None:
    m1, m2 = build("gpt2", seed=1), build("gpt2", seed=2)
    plan = FaultPlan([Fault(op="scores", layer=1, step=0, kind="inf")])
    g1 = attnchecker.protect(m1, policy=Policy.full(), faults=plan)
    g2 = attnchecker.protect(m2, policy=Policy.full())
    try:
        ids = batch("gpt2", 0)["ids"]
        _logits(m1, ids)
        _logits(m2, ids)
        assert [d.layer for d in g1.detections] == [1]
        assert g2.report().detected == 0
        assert g2.report().checks["scores"] == 2
        g1.close()
        _logits(m2, ids)
        assert g2.report().checks["scores"] == 4
        assert m1.config._attn_implementation == "sdpa"
        assert m2.config._attn_implementation == "attnchecker"
    finally:
        g1.close()
        g2.close()


def test_registration_left_after_close_runs_plain_sdpa() -> None:
    model = build("gpt2").eval()
    ids = batch("gpt2", 0)["ids"]
    want = _logits(model, ids)
    attnchecker.protect(model).close()
    # A user switching to the name by hand, with no guard: the function must still compute plain attention.
    model.set_attn_implementation("attnchecker")
    try:
        torch.testing.assert_close(_logits(model, ids), want, rtol=1e-5, atol=1e-5)
    finally:
        model.set_attn_implementation("sdpa")


def test_eager_model_is_restored_to_eager() -> None:
    model = build("llama", attn_implementation="eager").eval()
    assert model.config._attn_implementation == "eager"
    ids = batch("llama", 0)["ids"]
    want = _logits(model, ids)
    with attnchecker.protect(model, policy=Policy.full()):
        assert model.config._attn_implementation == "attnchecker"
        torch.testing.assert_close(_logits(model, ids), want, rtol=1e-4, atol=1e-5)
    assert model.config._attn_implementation == "eager"


def test_transformers_model_inside_a_wrapper_is_found() -> None:
    """DDP, a LightningModule or a user's wrapper hold the transformers model as a child."""

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = build("gpt2").eval()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids).logits

    wrapper = Wrapper()
    ids = batch("gpt2", 0)["ids"]
    with torch.no_grad():
        want = wrapper(ids)
    plan = FaultPlan([Fault(op="k", layer=0, step=0, kind="nan")])
    with attnchecker.protect(wrapper, policy=Policy.full(), faults=plan) as guard, torch.no_grad():
        assert [s.name for s in guard.sites] == ["lm.transformer.h.0.attn", "lm.transformer.h.1.attn"]
        got = wrapper(ids)
        assert guard.report().corrected == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert wrapper.lm.config._attn_implementation == "sdpa"
