"""The coverage map never claims what is not checked (issue 33): an op a site says it protects that a step leaves
unchecked is reported unprotected with the reason, warned about once, and refused under strict=True; the width-based
fallback runs only when no class of the model has readable source and never takes an MLP for attention. One test per
false claim found: a flex_attention call routed by no name, paper mode's q/k/v whose passed checksums a flex call
never reads, and the 3x-wide MLP up projection."""
from __future__ import annotations

import logging
import textwrap

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnchecker
from attnchecker import Policy, UnprotectedAttentionError

E, H, T = 32, 4, 24
CAUSAL = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device="cpu")


def heads(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], H, -1).transpose(1, 2)


class FlexByName(nn.Module):
    """Calls flex_attention by the name its module imported: routed (integrations/flex_varlen.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(E, E) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        return self.o_proj(flex_attention(q, k, v, block_mask=CAUSAL).transpose(1, 2).flatten(2))


class FlexByAttribute(FlexByName):
    """Calls flex_attention through a module attribute path: no name of its module is bound to it, nothing routes
    it, and the attention computed is not checked."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = flex_module.flex_attention(q, k, v, block_mask=CAUSAL)
        return self.o_proj(out.transpose(1, 2).flatten(2))


def train_step(model: nn.Module, guard: attnchecker.Guard | None = None) -> None:
    x = torch.randn(2, T, E)
    with torch.no_grad():  # flex_attention itself has no CPU backward (the unrouted call runs it)
        model(x)
    if guard is not None:
        guard.step()


def test_a_claimed_op_that_a_step_leaves_unchecked_is_reported_with_the_reason(caplog) -> None:
    model = nn.Sequential(FlexByAttribute(), FlexByAttribute())
    with attnchecker.protect(model, policy=Policy.full()) as guard, caplog.at_level(logging.WARNING, "attnchecker"):
        assert guard.coverage.complete  # what attaching intends, before any step
        x = torch.randn(2, T, E)
        with torch.no_grad():
            model(x)
        # The step in progress already shows it, once the model has finished a forward.
        in_progress = {(e.layer, e.op) for e in guard.coverage.unprotected}
        guard.step()
        train_step(model, guard)
        cov = guard.coverage
    assert in_progress == {(layer, op) for layer in (0, 1) for op in ("scores", "context")}
    assert {(e.layer, e.op) for e in cov.unprotected} == in_progress
    assert {(e.layer, e.op) for e in cov.protected} == {(layer, op) for layer in (0, 1)
                                                         for op in ("q", "k", "v", "out")}
    reason = cov.unprotected[0].reason
    assert reason.startswith("claimed (flex) but not checked in 2 steps it was due (first: step 0)"), reason
    assert guard.report().coverage.to_wire()["unprotected"] == 4
    warned = [r for r in caplog.records if "not checked" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_the_routed_flex_call_is_checked_and_its_claims_hold() -> None:
    """The same model calling flex_attention by its imported name: every claim holds after the steps, and the
    unprotected model, which cannot train on CPU, trains protected."""
    model = nn.Sequential(FlexByName(), FlexByName())
    x = torch.randn(2, T, E)
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        model(x).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attnchecker.protect(model, optimizer=opt) as guard:
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        assert guard.coverage.complete, guard.coverage.gaps()
        assert guard.report().checks["scores"] == 4
    assert flex_attention is flex_module.flex_attention  # unprotect restored the module's name


def test_strict_refuses_a_step_that_left_a_claimed_op_unchecked() -> None:
    model = FlexByAttribute()
    with attnchecker.protect(model, policy=Policy.full(), strict=True) as guard:
        with pytest.raises(UnprotectedAttentionError, match=r"layer 0 \(\) scores: claimed \(flex\)"):
            train_step(model, guard)


def test_paper_mode_qkv_are_unchecked_when_the_attention_takes_no_passed_checksums() -> None:
    """Paper mode verifies q/k/v only through the scores and context checks' passed checksums; a flex call (the tile
    loop takes none) leaves them unverified, and the map says so. SDPA calls, which take them, keep them."""
    model = FlexByName()
    with attnchecker.protect(model, policy=Policy.paper()) as guard:
        train_step(model, guard)
        flex_gaps = {e.op for e in guard.coverage.unprotected}

    class SdpaByName(FlexByName):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
            return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))

    sdpa = SdpaByName()
    with attnchecker.protect(sdpa, policy=Policy.paper()) as guard:
        train_step(sdpa, guard)
        assert guard.coverage.complete, guard.coverage.gaps()
    assert flex_gaps == {"q", "k", "v"}


def _exec_classes(source: str) -> dict[str, type]:
    """Classes built by exec, as a notebook or a code generator makes them: inspect cannot read their source."""
    namespace: dict[str, object] = {"nn": nn, "F": F, "torch": torch}
    exec(textwrap.dedent(source), namespace)
    return {k: v for k, v in namespace.items() if isinstance(v, type)}


SOURCE = """
class Attn(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.qkv, self.proj = nn.Linear(e, 3 * e), nn.Linear(e, e)
    def forward(self, x):
        b, t, e = x.shape
        q, k, v = (y.view(b, t, 4, -1).transpose(1, 2) for y in self.qkv(x).split(e, -1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, e))

class Mlp(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.w1, self.w2 = nn.Linear(e, 3 * e), nn.Linear(3 * e, e)
    def forward(self, x):
        return self.w2(F.silu(self.w1(x)))

class Block(nn.Module):
    def __init__(self, e):
        super().__init__()
        self.attn, self.mlp = Attn(e), Mlp(e)
    def forward(self, x):
        return x + self.mlp(x + self.attn(x))
"""


def test_the_width_fallback_takes_fused_attention_and_never_an_mlp() -> None:
    """No readable source: attention is found by its shape (a fused q/k/v named as one, 3x wide, beside an output
    projection). The MLP's up projection is 3x wide too (torchtitan's debug FFN: w1 256 -> 768) and is not taken."""
    block = _exec_classes(SOURCE)["Block"](E)
    with attnchecker.protect(block, policy=Policy.full()) as guard:
        assert [s.name for s in guard.sites] == ["attn"]
        block(torch.randn(2, T, E)).sum().backward()
        guard.step()
        assert guard.coverage.complete, guard.coverage.gaps()


def test_no_width_guess_when_the_models_source_is_readable() -> None:
    """With readable source the model's own classes say which call attention; a module holding a 3x-wide Linear that
    calls none (an MLP) is never guessed to be one."""

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Linear(E, 3 * E), nn.Linear(3 * E, E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w2(F.silu(self.w1(x)))

    class Qkv(nn.Module):
        """torchtitan's FusedQKVLinear shape: a wqkv 3x wide, no attention call."""

        def __init__(self) -> None:
            super().__init__()
            self.wqkv = nn.Linear(E, 3 * E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.wqkv(x)

    with pytest.raises(attnchecker.NoProtectableAttentionError):
        attnchecker.protect(nn.Sequential(Qkv(), Mlp()))
