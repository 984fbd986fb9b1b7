"""``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``).

Each instance gets a protected ``forward`` as an instance attribute (removed on close, so the class method shows
through again): in-projection (fused or separate q/k/v weights) through ``protected_linear``, attention through
``protected_sdpa``, out_proj through ``protected_linear``. Same contract as the original: batch_first either way,
unbatched inputs, ``key_padding_mask``, ``attn_mask`` (bool or additive), ``need_weights``/``average_attn_weights``.

The encoder layers' inference fast path (``torch._transformer_encoder_layer_fwd``) bypasses ``self_attn.forward``;
it is switched off (``torch.backends.mha``) only while the protected model runs.
"""


from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from ..checks.context import LayerContext
from ._common import Binder, engine_call

__all__ = ["attach"]

log = logging.getLogger("attnchecker")


def _additive(mask: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """MHA masks: bool True = not allowed (the opposite of SDPA's bool), float = added to the scores."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(mask, float("-inf"))
    if not torch.is_floating_point(mask):
        raise AssertionError(f"only bool and floating types of {name} are supported")
    return mask


def _merged_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    n: int,
    h: int,
    s: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """attn_mask (L, S) or (N*H, L, S), key_padding_mask (N, S) -> one additive mask broadcastable to (N, H, L, S)."""
    am = _additive(attn_mask, "attn_mask")
    kpm = _additive(key_padding_mask, "key_padding_mask")
    out: torch.Tensor | None = None
    if am is not None:
        out = am.view(n, h, *am.shape[-2:]) if am.dim() == 3 else am.view(1, 1, *am.shape)
    if kpm is not None:
        kpm_N11S = kpm.view(n, 1, 1, s)
        out = kpm_N11S if out is None else out + kpm_N11S
    return None if out is None else out.to(dtype)


def _mha_forward(
    mha: nn.MultiheadAttention,
    ctx: LayerContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    from ..attention.pipeline import protected_linear, protected_sdpa

    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module method "
            "`generate_square_subsequent_mask` to create this mask."
        )
    is_batched = query.dim() == 3
    self_attention = query is key and key is value
    if not is_batched:
        q_in, k_in, v_in = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif mha.batch_first:
        q_in, k_in, v_in = query, key, value
    else:
        q_in, k_in, v_in = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    # (N, L, E) from here on.
    n, L, e = q_in.shape
    s = k_in.shape[1]
    h = mha.num_heads
    d = e // h

    bias = mha.in_proj_bias
    b_q, b_k, b_v = bias.chunk(3) if bias is not None else (None, None, None)
    if mha._qkv_same_embed_dim and self_attention:
        splits = (("q", e), ("k", e), ("v", e))
        qkv = engine_call(protected_linear, q_in, mha.in_proj_weight, bias, ctx=ctx, splits=splits)
        q, k, v = torch.split(qkv, e, dim=-1)
    else:
        if mha._qkv_same_embed_dim:
            w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        q = engine_call(protected_linear, q_in, w_q, b_q, ctx=ctx, op="q")
        k = engine_call(protected_linear, k_in, w_k, b_k, ctx=ctx, op="k")
        v = engine_call(protected_linear, v_in, w_v, b_v, ctx=ctx, op="v")
    q_NHLD = q.reshape(n, L, h, d).transpose(1, 2)
    k_NHSD = k.reshape(n, s, h, d).transpose(1, 2)
    v_NHSD = v.reshape(n, s, h, d).transpose(1, 2)

    mask = _merged_mask(attn_mask, key_padding_mask, n, h, s, q_NHLD.dtype)
    dropout_p = mha.dropout if mha.training else 0.0
    probs: torch.Tensor | None = None
    if need_weights:
        out_NHLD, probs = engine_call(
            protected_sdpa, q_NHLD, k_NHSD, v_NHSD, ctx=ctx, attn_mask=mask, dropout_p=dropout_p, return_probs=True
        )
    else:
        out_NHLD = engine_call(protected_sdpa, q_NHLD, k_NHSD, v_NHSD, ctx=ctx, attn_mask=mask, dropout_p=dropout_p)
    out_NLE = out_NHLD.transpose(1, 2).reshape(n, L, e)
    out_NLE = engine_call(protected_linear, out_NLE, mha.out_proj.weight, mha.out_proj.bias, ctx=ctx, op="out")

    if not is_batched:
        out = out_NLE.squeeze(0)
    elif mha.batch_first:
        out = out_NLE
    else:
        out = out_NLE.transpose(0, 1)
    weights: torch.Tensor | None = None
    if probs is not None:
        weights = probs.mean(dim=1) if average_attn_weights else probs
        if not is_batched:
            weights = weights.squeeze(0)
    return out, weights


def _why_unsupported(mha: nn.MultiheadAttention) -> str | None:
    if mha.bias_k is not None or mha.bias_v is not None:
        return "add_bias_kv=True"
    if mha.add_zero_attn:
        return "add_zero_attn=True"
    if mha.embed_dim % mha.num_heads:
        return "embed_dim not divisible by num_heads"
    return None


class _FastPathOff:
    """Switch off the MHA/encoder fast path while the protected model runs (depth-counted for nested calls)."""

    def __init__(self) -> None:
        self._depth = 0
        self._saved = True

    def pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._saved = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        self._depth += 1

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.backends.mha.set_fastpath_enabled(self._saved)


def attach(binder: Binder, model: nn.Module) -> None:
    protected = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.MultiheadAttention):
            continue
        why = _why_unsupported(module)
        if why is not None:
            log.debug("attnchecker: %s (nn.MultiheadAttention with %s) is left unprotected", name, why)
            binder.add_unprotected(name, ("q", "k", "v", "scores", "context", "out"),
                                   f"nn.MultiheadAttention with {why}")
            continue
        ctx = binder.context_for(module)
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        # Instance attribute: shadows MultiheadAttention.forward for this module only; state_dict is untouched.
        module.forward = functools.partial(_mha_forward, module, ctx)  # type: ignore[method-assign]
        binder.on_close(functools.partial(_restore_forward, module, had_own, previous))
        binder.add_site(ctx, name, "torch_mha", ("q", "k", "v", "scores", "context", "out"))
        protected += 1
    if protected:
        fast = _FastPathOff()
        pre = model.register_forward_pre_hook(fast.pre)
        post = model.register_forward_hook(fast.post, always_call=True)
        binder.on_close(pre.remove)
        binder.on_close(post.remove)


def _restore_forward(module: nn.Module, had_own: bool, previous: Any) -> None:
    if had_own:
        module.forward = previous
    else:
        del module.forward
