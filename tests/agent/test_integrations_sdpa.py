"""Plain PyTorch SDPA models: every call style is routed to its layer, and nothing outside the model is touched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention

import attnchecker
from attnchecker import Fault, FaultPlan, Policy

E, H, T = 32, 4, 10


def _heads(x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    return x.view(b, t, H, E // H).transpose(1, 2)


def _merge(y: torch.Tensor) -> torch.Tensor:
    b, _, t, _ = y.shape
    return y.transpose(1, 2).reshape(b, t, E)


class SDPAWrapper(nn.Module):
    """TorchTitan style: the SDPA call sits in a thin module of its own."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (
            nn.Linear(E, E, bias=False),
            nn.Linear(E, E, bias=False),
            nn.Linear(E, E, bias=False),
        )
        self.wo = nn.Linear(E, E, bias=False)
        self.sdpa = SDPAWrapper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(_merge(self.sdpa(_heads(self.wq(x)), _heads(self.wk(x)), _heads(self.wv(x)))))


class ImportedNameAttention(nn.Module):
    """Calls the function through a name imported at module level: a monkey-patch of F would miss it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(E, 3 * E)
        self.proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_heads(t) for t in self.qkv(x).split(E, dim=-1))
        return self.proj(_merge(scaled_dot_product_attention(q, k, v)))


class TwoCallsAttention(nn.Module):
    """One module, two attentions per forward (a shared block applied twice): two layers, by call order."""

    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(E, 3 * E)
        self.c_proj = nn.Linear(E, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            q, k, v = (_heads(t) for t in self.c_attn(x).split(E, dim=-1))
            x = x + self.c_proj(_merge(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        return x


class RopeAttention(nn.Module):
    """Rotates q/k between projection and SDPA (Llama style, plain PyTorch)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.o_proj = nn.Linear(E, E)
        d = E // H
        angles = torch.arange(T)[:, None] * (1e-2 ** (torch.arange(d // 2) / (d // 2)))[None]
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs_cis).flatten(-2).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self._rotate(_heads(self.q_proj(x))), self._rotate(_heads(self.k_proj(x)))
        return self.o_proj(_merge(F.scaled_dot_product_attention(q, k, _heads(self.v_proj(x)), is_causal=True)))


MODELS = {
    "torchtitan_wrapper": (TitanAttention, 1, "sdpa"),
    "imported_name": (ImportedNameAttention, 1, ""),
    "two_calls": (TwoCallsAttention, 2, ""),
    "rope": (RopeAttention, 1, ""),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_sdpa_styles_match_unprotected_and_correct_faults(name: str) -> None:
    cls, layers, _ = MODELS[name]
    torch.manual_seed(0)
    model = nn.Sequential(cls(), nn.LayerNorm(E), cls())
    ref = copy.deepcopy(model)
    x = torch.randn(2, T, E)
    want = ref(x)
    want.square().mean().backward()
    # One fault in every op; protected, the output and gradients are the fault-free ones. The scores fault goes to
    # another layer: repairing scores rebuilds the context, which would wipe a context fault of the same call.
    plan = FaultPlan(
        [Fault(op=op, layer=0, step=0, kind="nan", seed=i) for i, op in enumerate(("q", "k", "v", "context", "out"))]
        + [Fault(op="scores", layer=1, step=0, kind="nan")]
    )
    with attnchecker.protect(model, policy=Policy.full(), faults=plan) as guard:
        got = model(x)
        got.square().mean().backward()
        sites = guard.sites
        report = guard.report()
    assert len(sites) == 2 * layers
    assert all(s.ops == ("q", "k", "v", "scores", "context", "out") for s in sites), sites
    assert report.detected == report.corrected == 6, report.as_dict()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (n, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_rope_model_in_paper_mode_still_corrects_scores() -> None:
    """RoPE changes Q/K after the projection: the scores must not be checked against the projection's checksums."""
    torch.manual_seed(0)
    model = RopeAttention()
    x = torch.randn(2, T, E)
    want = copy.deepcopy(model)(x)
    plan = FaultPlan([Fault(op="scores", layer=0, step=0, kind="inf")])
    with attnchecker.protect(model, policy=Policy.paper(), faults=plan) as guard:
        got = model(x)
        assert guard.report().corrected == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_calls_outside_attention_modules_are_not_routed() -> None:
    torch.manual_seed(0)
    model = ImportedNameAttention()
    q = torch.randn(1, H, T, E // H)
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        direct = F.scaled_dot_product_attention(q, q, q)  # not inside the model's forward
        assert sum(guard.report().checks.values()) == 0
        model(torch.randn(1, T, E))
        assert guard.report().checks["scores"] == 1
    torch.testing.assert_close(direct, torch.softmax(q @ q.mT / (E // H) ** 0.5, -1) @ q)


def test_three_dim_sdpa_call_runs_unprotected() -> None:
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn = nn.Linear(E, 3 * E)
            self.c_proj = nn.Linear(E, E)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.c_attn(x).split(E, dim=-1)  # (B, T, E): one head, no head dim
            return self.c_proj(F.scaled_dot_product_attention(q, k, v))

    torch.manual_seed(0)
    model = Flat()
    x = torch.randn(2, T, E)
    want = copy.deepcopy(model)(x)
    with attnchecker.protect(model, policy=Policy.full()) as guard:
        got = model(x)
        assert guard.report().checks["scores"] == 0
        assert guard.report().checks["out"] == 1
    torch.testing.assert_close(got, want)
