"""The coverage map is never silent and never wrong: every op of every zoo model is listed with its path; what is
left unprotected (a LoRA variant, a quantized projection, an nn.MultiheadAttention option, a run-time fallback) is
listed with its reason, warned about once, refused under strict=True; and a fault injected below autograd is corrected
exactly where the map says "protected" and not where it says "unprotected"."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from gemm_faults import GemmFault, GemmFaults
from model_zoo import ARCHS, BATCH, SEQ, batch, build, loss_of
from torch import nn

import attnchecker
from attnchecker.checks.context import OPS
from attnchecker.coverage import Coverage, OpCoverage

EXPECTED_PATHS = {
    "gpt2": "q,k,v,out:hook scores,context:transformers",
    "bert": "q,k,v,out:hook scores,context:transformers",
    "roberta": "q,k,v,out:hook scores,context:transformers",
    "llama": "q,k,v,out:hook scores,context:transformers",
    "gpt_neo": "q,k,v,out:hook scores,context:gpt_neo",
    "nanogpt": "q,k,v,out:hook scores,context:sdpa",
    "torch_encoder": "q,k,v,scores,context,out:torch_mha",
}


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_models_are_fully_covered(arch, caplog) -> None:
    model = build(arch)
    with caplog.at_level(logging.WARNING, logger="attnchecker"), attnchecker.protect(model, strict=True) as guard:
        cov = guard.coverage
        wire = guard.run_info()["config"]["coverage"]
        rep = guard.report().as_dict()["coverage"]
    assert cov.complete
    assert len(cov.protected) == 2 * len(OPS)
    assert {(e.layer, e.op) for e in cov.entries} == {(layer, op) for layer in (0, 1) for op in OPS}
    assert wire == {"protected": 12, "unprotected": 0, "layers": [f"0-1 {EXPECTED_PATHS[arch]}"], "gaps": []}
    assert rep["protected"] == 12
    assert rep["unprotected"] == 0
    assert len(rep["entries"]) == 12
    assert not [r for r in caplog.records if "unprotected" in r.getMessage()]


def _dora_llama() -> nn.Module:
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"], use_dora=True, init_lora_weights=False)
    return peft.get_peft_model(build("llama"), cfg)


def test_lora_variant_is_listed_warned_once_and_refused_when_strict(caplog) -> None:
    model = _dora_llama()
    with caplog.at_level(logging.WARNING, logger="attnchecker"), attnchecker.protect(model) as guard:
        cov = guard.coverage
        wire = guard.run_info()["config"]["coverage"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "attnchecker" and "unprotected" in r.getMessage()]
    assert len(warnings) == 1
    assert "layers 0-1 q,out: peft LoRA variant Dora" in warnings[0]
    assert {(e.layer, e.op) for e in cov.unprotected} == {(layer, op) for layer in (0, 1) for op in ("q", "out")}
    assert {e.path for e in cov.protected} == {"hook", "transformers"}
    assert wire["protected"] == 8
    assert wire["unprotected"] == 4
    assert wire["layers"] == ["0-1 k,v:hook scores,context:transformers"]
    before = {n: dict(m._forward_hooks) for n, m in model.named_modules()}
    with pytest.raises(attnchecker.UnprotectedAttentionError, match="q,out: peft LoRA variant Dora"):
        attnchecker.protect(model, strict=True)
    assert not attnchecker.is_protected(model)
    assert {n: dict(m._forward_hooks) for n, m in model.named_modules()} == before


def test_map_is_true_to_what_a_fault_below_autograd_shows() -> None:
    """Llama with DoRA on q/o: an INF in v_proj's GEMM (listed protected) is corrected; one in q_proj's base GEMM
    (listed unprotected) is not. Shapes: q_proj (B*T, 64) is the first such GEMM of layer 0, v_proj (B*T, 32) the
    second (k/v have 2 of 4 heads; k_proj is the first)."""
    model = _dora_llama().train()
    n = BATCH * SEQ
    with attnchecker.protect(model) as guard:
        assert any(e.op == "v" and e.layer == 0 and e.protected for e in guard.coverage.entries)
        with GemmFaults([GemmFault((n, 32), math.inf, index=40, nth=1)]) as mode:
            loss = loss_of("llama", model, batch("llama", 0))
        assert mode.hits
        assert torch.isfinite(loss)
        assert [(d.op, d.layer, d.action) for d in guard.detections] == [("v", 0, "corrected")]
        assert not any(e.op == "q" and e.protected for e in guard.coverage.entries)
        with GemmFaults([GemmFault((n, 64), math.inf, index=40, nth=0)]) as mode:
            loss = loss_of("llama", model, batch("llama", 0))
        assert mode.hits
        assert not torch.isfinite(loss)
        assert not [d for d in guard.detections if d.op == "q"]


class QuantLinear(nn.Module):
    """A stand-in for a weight-only quantized projection: int8 weight, per-row scale."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.randint(-127, 128, (o, i), dtype=torch.int8))
        self.register_buffer("scale", torch.full((o, 1), 0.01))
        self.in_features, self.out_features = i, o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.float() * self.scale).T


class QuantAttention(nn.Module):
    def __init__(self, e: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.c_attn = QuantLinear(e, 3 * e)
        self.c_proj = nn.Linear(e, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = (z.view(b, t, self.h, -1).transpose(1, 2) for z in self.c_attn(x).split(e, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, e))


def test_quantized_projection_and_mha_option_are_listed() -> None:
    model = nn.ModuleDict({"attn": QuantAttention(), "mha": nn.MultiheadAttention(32, 4, add_zero_attn=True)})
    model.forward = lambda x: model["attn"](x)  # type: ignore[method-assign]
    with attnchecker.protect(model) as guard:
        gaps = guard.coverage.gaps()
    assert "layer 0 q,k,v: quantized weight (QuantLinear, torch.int8) (attn)" in gaps
    unmatched = "output projection not matched: it is found by the q/k/v width, and q/k/v were not"
    assert f"layer 0 out: {unmatched} (attn)" in gaps
    assert "mha q,k,v,scores,context,out: nn.MultiheadAttention with add_zero_attn=True" in gaps


def test_run_time_fallback_is_counted_and_strict_raises(caplog) -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(16, 48)
            self.c_proj = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.c_attn(x).split(16, dim=-1)  # (B, T, E): no head dim
            return self.c_proj(F.scaled_dot_product_attention(q, k, v))

    model, x = Flat(), torch.randn(2, 5, 16)
    with caplog.at_level(logging.WARNING, logger="attnchecker"), attnchecker.protect(model) as guard:
        assert guard.coverage.complete
        model(x)
        model(x)
        cov = guard.coverage
        rep = guard.report().as_dict()["coverage"]
    assert not cov.complete
    reason = "SDPA call with a 3-D query (not (B, H, T, D))"
    assert cov.fallbacks == {(0, "scores,context", reason): 2}
    assert rep["fallbacks"] == [{"layer": 0, "ops": "scores,context", "reason": reason, "calls": 2}]
    assert sum("runs unprotected" in r.getMessage() for r in caplog.records) == 1
    with attnchecker.protect(model, strict=True), pytest.raises(attnchecker.UnprotectedAttentionError, match="3-D"):
        model(x)


def test_wire_form_stays_compact_for_deep_models() -> None:
    entries = [OpCoverage(layer=i, name=f"m.layers.{i}.attn", op=op, path="hook" if i % 2 else "peft-lora")
               for i in range(200) for op in ("q", "k", "v", "out")]
    entries += [OpCoverage(layer=i, name=f"m.layers.{i}.attn", op="scores", reason=f"reason {i % 40} " + "x" * 300)
                for i in range(200)]
    wire = Coverage(entries=tuple(entries)).to_wire()
    assert wire["protected"] == 800
    assert wire["unprotected"] == 200
    assert len(wire["layers"]) == 2
    assert wire["layers"][0].startswith("0,2,4")
    assert len(wire["gaps"]) == 8
    assert wire["gaps"][-1] == "… and 33 more"
    assert all(len(line) <= 160 for line in wire["layers"] + wire["gaps"])


def test_softcapped_attention_falls_back_to_eager_counted_and_exact(caplog) -> None:
    """Gemma-2 softcaps its logits: the protected kernel does not implement it (and transformers' SDPA function
    refuses it), so those calls run the model's own eager attention, counted; the projections stay checked."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                          sliding_window=4, attn_implementation="eager")
    model = tf.Gemma2ForCausalLM(cfg)
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    keep = torch.ones_like(ids)
    keep[1, :2] = 0
    want = model(input_ids=ids, attention_mask=keep, labels=ids).loss
    with caplog.at_level(logging.WARNING, logger="attnchecker"), attnchecker.protect(model) as guard:
        got = model(input_ids=ids, attention_mask=keep, labels=ids).loss
        cov, rep = guard.coverage, guard.report()
    reason = "attention with softcap runs the model's eager attention"
    assert cov.fallbacks == {(0, "scores,context", reason): 1, (1, "scores,context", reason): 1}
    assert rep.checks["q"] == 2
    assert rep.checks["scores"] == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert sum("runs unprotected" in r.getMessage() for r in caplog.records) == 1
    with attnchecker.protect(model, strict=True), pytest.raises(attnchecker.UnprotectedAttentionError, match="softcap"):
        model(input_ids=ids, labels=ids)
