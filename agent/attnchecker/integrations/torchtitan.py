"""torchtitan's language models (0.3: Llama 3, Qwen 3, ... built on ``GQAttention``): found by class, not by widths.

A ``GQAttention`` holds its q/k/v projection in ``qkv_linear`` (``FusedQKVLinear.wqkv``, or ``QKVLinear.wq/wk/wv``),
its output projection ``wo`` and an inner attention module (``FlexAttention``, ``VarlenAttention`` or
``ScaledDotProductAttention``) that it calls with (B, L, N, H) tensors and the model's ``attention_masks``. The
projections get forward hooks (``Binder.hook_projection``); the inner attention is replaced by a module that runs the
checked engine with the same arguments (attention/flex.py, attention/varlen.py, attention/pipeline.py), restored by
unprotect. ``wqkv``'s output is interleaved per KV group, [q heads of group 0 | k0 | v0 | q heads of group 1 | ...]
(``FusedQKVLinear.forward``), so it is checked slice by slice with those labels, not in thirds.

torchtitan is imported by the model's own code; nothing here imports it unless the model did.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..checks.context import LayerContext
from ._common import Binder, checked_attention, engine_call, projection_gap

__all__ = ["attach"]

_MODULE = "torchtitan.models.common.attention"


def attach(binder: Binder, model: nn.Module) -> set[nn.Module]:
    """Protect every torchtitan ``GQAttention`` in ``model``; returns the modules handled here (the other integrations
    leave them alone)."""
    tt = sys.modules.get(_MODULE)
    if tt is None:
        return set()
    handled: set[nn.Module] = set()
    for name, module in model.named_modules():
        if isinstance(module, tt.GQAttention):
            _attach_layer(binder, tt, name, module)
            handled.update(module.modules())
        elif isinstance(module, tt.BaseAttention) and not handled.intersection(module.modules()):
            binder.add_unprotected(name, ("q", "k", "v", "scores", "context", "out"),
                                   f"torchtitan {type(module).__name__} is not a GQAttention (the one supported)")
            handled.update(module.modules())
    return handled


def _attach_layer(binder: Binder, tt: Any, name: str, attn: Any) -> None:
    """attn: a GQAttention (Any: its children are torchtitan's classes, read by attribute)."""
    ctx = binder.context_for(attn)
    paths: dict[str, str] = {}
    gaps: dict[str, str] = {}
    qkv = attn.qkv_linear
    if isinstance(qkv, tt.FusedQKVLinear):
        hd, hpk = qkv.head_dim, qkv.heads_per_kv
        groups = qkv.wqkv.out_features // ((hpk + 2) * hd)
        # [q (hpk heads) | k | v] per KV group: the labels follow the interleave.
        splits = (("q", hpk * hd), ("k", hd), ("v", hd)) * groups
        paths.update(dict.fromkeys(("q", "k", "v"), binder.hook_projection(qkv.wqkv, ctx, splits=splits)))
    elif isinstance(qkv, tt.QKVLinear):
        for op in ("q", "k", "v"):
            paths[op] = binder.hook_projection(getattr(qkv, f"w{op}"), ctx, op=op)
    else:
        gaps.update(dict.fromkeys(("q", "k", "v"), projection_gap(qkv, "q/k/v projection")))
    if isinstance(attn.wo, nn.Linear):
        paths["out"] = binder.hook_projection(attn.wo, ctx, op="out")
    else:
        gaps["out"] = projection_gap(attn.wo, "output projection")
    inner = attn.inner_attention
    kind = next((k for k in ("FlexAttention", "VarlenAttention", "ScaledDotProductAttention")
                 if isinstance(inner, getattr(tt, k))), None)
    if kind is None:
        gaps.update(dict.fromkeys(("scores", "context"),
                                  f"torchtitan inner attention {type(inner).__name__} is not one attnchecker checks "
                                  "(FlexAttention, VarlenAttention, ScaledDotProductAttention)"))
    else:
        checked = CheckedInnerAttention(inner, kind, ctx, binder)
        attn.inner_attention = checked

        def restore(attn: Any = attn, checked: nn.Module = checked, inner: nn.Module = inner) -> None:
            if attn.inner_attention is checked:
                attn.inner_attention = inner

        binder.on_close(restore)
    ops = tuple(op for op in ("q", "k", "v", "scores", "context", "out") if op not in gaps)
    binder.add_site(ctx, name, "torchtitan", ops, paths=paths, gaps=gaps)


class CheckedInnerAttention(nn.Module):
    """Stands in for a torchtitan inner attention: same call, (B, L, N, H) in and out, computed by the checked engine.
    The module it replaces is kept (not as a submodule: the model's module names and state_dict stay as they were)
    for its settings and for the steps where nothing is due (its own kernel, tier 1 on it)."""

    inner: Any
    """The torchtitan module replaced (FlexAttention, VarlenAttention or ScaledDotProductAttention)."""
    ctx: LayerContext
    binder: Binder

    def __init__(self, inner: nn.Module, kind: str, ctx: LayerContext, binder: Binder) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)
        self.kind = kind
        object.__setattr__(self, "ctx", ctx)
        object.__setattr__(self, "binder", binder)

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks: Any = None, scale: float | None = None, enable_gqa: bool = False,
                out_transform: Any = None, **kwargs: Any) -> torch.Tensor:
        if self.kind == "FlexAttention":
            return self._flex(q_BLNH, k_BLNH, v_BLNH, attention_masks, kwargs.get("score_mod"), scale, enable_gqa,
                              out_transform)
        if self.kind == "VarlenAttention":
            return self._varlen(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale, enable_gqa, out_transform)
        return self._sdpa(q_BLNH, k_BLNH, v_BLNH, attention_masks, scale, enable_gqa,
                          bool(kwargs.get("is_causal", True)))

    def _flex(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, block_mask: Any,
              score_mod: Any, scale: float | None, enable_gqa: bool, out_transform: Any) -> torch.Tensor:
        from torch.nn.attention.flex_attention import AuxRequest

        from ..attention.flex import protected_flex_attention

        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        inner = self.inner

        def fused() -> tuple[torch.Tensor, torch.Tensor]:
            # torchtitan's own compiled flex_attention, as its FlexAttention.forward calls it.
            out, aux = inner.compiled_flex_attn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                                enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True),
                                                kernel_options=inner.kernel_options)
            return out, aux.lse

        out, lse = engine_call(protected_flex_attention, q, k, v, ctx=self.ctx, score_mod=score_mod,
                               block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True,
                               fused=fused)
        out_BLNH = out.transpose(1, 2)
        return out_BLNH if out_transform is None else out_transform(out_BLNH, lse.transpose(1, 2))

    def _varlen(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, meta: Any,
                scale: float | None, enable_gqa: bool, out_transform: Any) -> torch.Tensor:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        from ..attention.varlen import protected_varlen_attention

        b, t = q_BLNH.shape[:2]
        # As torchtitan's VarlenAttention: packed (B·L, N, H), in bf16 (its kernel takes bf16/fp16 only).
        q, k, v = (x.reshape(b * t, -1, x.shape[-1]).to(torch.bfloat16) for x in (q_BLNH, k_BLNH, v_BLNH))
        window = tuple(self.inner.window_size)

        def fused() -> tuple[torch.Tensor, torch.Tensor]:
            out, lse = varlen_attn(q, k, v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, scale=scale,
                                   window_size=window, enable_gqa=enable_gqa, return_aux=AuxRequest(lse=True))
            return out, lse

        out, lse = engine_call(protected_varlen_attention, q, k, v, meta.cu_seq_q, meta.cu_seq_k, ctx=self.ctx,
                               scale=scale, window_size=window, enable_gqa=enable_gqa, return_lse=True, fused=fused)
        out_BLNH = out.view(b, t, -1, v_BLNH.shape[-1]).to(q_BLNH.dtype)
        if out_transform is None:
            return out_BLNH
        return out_transform(out_BLNH, lse.transpose(0, 1).reshape(b, t, -1))

    def _sdpa(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, masks: Any,
              scale: float | None, enable_gqa: bool, is_causal: bool) -> torch.Tensor:
        if masks is not None:
            raise ValueError("ScaledDotProductAttention does not support attention_masks; it only supports "
                             "causal/non-causal attention via is_causal (torchtitan's own message)")
        q, k, v = (x.transpose(1, 2) for x in (q_BLNH, k_BLNH, v_BLNH))
        # RoPE ran between the projections and here: the scores take no checksums passed from the projections.
        out = checked_attention(self.binder, self.ctx, q, k, v, rotates=None, is_causal=is_causal, scale=scale,
                                enable_gqa=enable_gqa)
        return out.transpose(1, 2)
