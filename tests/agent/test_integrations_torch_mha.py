"""nn.MultiheadAttention under protection computes what the original computes, for every calling convention."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker import Policy

E, H, L, S, N = 32, 4, 6, 7, 3


def _inputs(batch_first: bool, batched: bool, same: bool, kdim: int = E, vdim: int = E) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)

    def t(length: int, dim: int) -> torch.Tensor:
        shape = (N, length, dim) if batch_first else (length, N, dim)
        x = torch.randn(shape, generator=g)
        return x if batched else (x[0] if batch_first else x[:, 0])

    q = t(L, E)
    if same:
        return q, q, q
    return q, t(S, kdim), t(S, vdim)


CASES = [
    # (batch_first, batched, self-attention, kdim/vdim differ, kwargs)
    pytest.param(True, True, True, False, {}, id="self-batch_first-need_weights"),
    pytest.param(False, True, True, False, {"need_weights": False}, id="self-seq_first"),
    pytest.param(True, True, False, False, {"need_weights": True, "average_attn_weights": False}, id="cross-per_head"),
    pytest.param(True, False, False, False, {}, id="unbatched-cross"),
    pytest.param(False, True, False, True, {"need_weights": False}, id="kdim_vdim-separate_weights"),
    pytest.param(True, True, False, False, {"key_padding_mask": "bool"}, id="key_padding_bool"),
    pytest.param(True, True, False, False, {"key_padding_mask": "float"}, id="key_padding_float"),
    pytest.param(True, True, False, False, {"attn_mask": "bool2d", "key_padding_mask": "bool"}, id="attn_mask+kpm"),
    pytest.param(True, True, False, False, {"attn_mask": "float3d", "need_weights": False}, id="attn_mask_per_head"),
    pytest.param(
        True, True, True, False, {"attn_mask": "causal", "is_causal": True, "need_weights": False}, id="is_causal_hint"
    ),
]


def _masks(kwargs: dict[str, object]) -> dict[str, object]:
    out = dict(kwargs)
    g = torch.Generator().manual_seed(1)
    kpm = out.get("key_padding_mask")
    if kpm is not None:
        pad = torch.zeros(N, S, dtype=torch.bool)
        pad[1, -2:] = True
        out["key_padding_mask"] = pad if kpm == "bool" else torch.zeros(N, S).masked_fill(pad, -1e4)
    am = out.get("attn_mask")
    if am == "bool2d":
        out["attn_mask"] = torch.rand(L, S, generator=g) > 0.8
    elif am == "float3d":
        out["attn_mask"] = torch.randn(N * H, L, S, generator=g)
    elif am == "causal":
        out["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L)
    return out


@pytest.mark.parametrize(("batch_first", "batched", "same", "kv_dims", "kwargs"), CASES)
def test_protected_mha_matches_original(
    batch_first: bool, batched: bool, same: bool, kv_dims: bool, kwargs: dict[str, object]
) -> None:
    torch.manual_seed(0)
    kdim = vdim = E + 8 if kv_dims else E
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim).train()
    ref = copy.deepcopy(mha)
    q, k, v = _inputs(batch_first, batched, same, kdim, vdim)
    call = _masks(kwargs)
    want_out, want_w = ref(q, k, v, **call)
    with attnchecker.protect(mha, policy=Policy.full()) as guard:
        got_out, got_w = mha(q, k, v, **call)
        assert guard.sites[0].ops == ("q", "k", "v", "scores", "context", "out")
        assert guard.report().checks["scores"] >= 1
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    if want_w is None:
        assert got_w is None
    else:
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)
    # Gradients flow to the same parameters with the same values.
    got_out.sum().backward()
    want_out.sum().backward()
    for (name, p), (_, p_ref) in zip(mha.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_encoder_fast_path_is_off_while_protected_and_restored_after() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(N, L, E)
    with torch.no_grad():
        want = layer(x)
    assert torch.backends.mha.get_fastpath_enabled()
    with attnchecker.protect(layer, policy=Policy.full()) as guard, torch.no_grad():
        got = layer(x)
        # The inference fast path would have bypassed self_attn: the checks prove the protected path ran.
        assert guard.report().checks["scores"] == 1
        assert torch.backends.mha.get_fastpath_enabled()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mha_with_bias_kv_is_left_unprotected() -> None:
    mha = nn.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(attnchecker.NoProtectableAttentionError):
        attnchecker.protect(mha)
    assert "forward" not in mha.__dict__


def test_transformer_decoder_layer_self_and_cross_attention_are_protected() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(E, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(layer)
    tgt, memory = torch.randn(N, L, E), torch.randn(N, S, E)
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    want = ref(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
    plan = attnchecker.FaultPlan([attnchecker.Fault(op="k", layer=1, step=0, kind="nan")])  # cross-attention's K
    with attnchecker.protect(layer, policy=Policy.full(), faults=plan) as guard:
        got = layer(tgt, memory, tgt_mask=mask, tgt_is_causal=True)
        assert [s.name for s in guard.sites] == ["self_attn", "multihead_attn"]
        assert guard.report().corrected == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
