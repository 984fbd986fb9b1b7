"""Hugging Face transformers (v5): protect a model without touching its modeling code.

Models whose attention dispatches through ``ALL_ATTENTION_FUNCTIONS`` (GPT-2, BERT, RoBERTa, Llama, ...) are switched
to the ``"attnchecker"`` implementation registered here; the attention ``module`` argument is mapped to its
LayerContext through a dict (nothing is stored on the module, so ``state_dict`` is untouched). Their projections get
forward hooks. GPT-Neo calls ``GPTNeoSelfAttention._attn`` directly, so each instance gets a protected ``_attn``.
"""


from __future__ import annotations

import functools
import logging
import sys
import weakref
from typing import Any

import torch
from torch import nn

from ..checks.context import LayerContext
from ._common import Binder, checked_attention, forward_source_mentions, projection_gap, rotates_qk
from .peft import base_linear

__all__ = ["ATTN_IMPLEMENTATION", "attach", "attnchecker_attention", "transformers_roots"]

log = logging.getLogger("attnchecker")

ATTN_IMPLEMENTATION = "attnchecker"

# Attention module -> (its LayerContext, the guard's Binder, whether it rotates Q/K), for every live guard. The
# registered function is global (transformers keeps one registry per process), so it finds its layer here; a module
# without an entry runs plain SDPA.
_CONTEXTS: weakref.WeakKeyDictionary[nn.Module, tuple[LayerContext, Binder, bool]] = weakref.WeakKeyDictionary()

_SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"))
_OUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense", "o")


def transformers_roots(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost transformers models in ``model``'s tree (itself included), with their qualified names."""
    tf = sys.modules.get("transformers")
    if tf is None:
        return []
    roots: list[tuple[str, nn.Module]] = []
    inside: set[nn.Module] = set()
    for name, module in model.named_modules():  # pre-order: an outer model comes before its parts
        if module not in inside and isinstance(module, tf.PreTrainedModel):
            roots.append((name, module))
            inside.update(module.modules())
    return roots


def attnchecker_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``sdpa_attention_forward``'s semantics, through ``protected_sdpa``.

    query (B, H, T, D), key/value (B, Hkv, S, D) -> (B, T, H, D), None.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    entry = _CONTEXTS.get(module)
    position_bias = kwargs.pop("position_bias", None)
    unsupported = any(kwargs.get(k) is not None for k in ("softcap", "s_aux"))
    if unsupported:
        # A variant the protected kernel does not implement (and SDPA neither: transformers' sdpa function refuses
        # softcap): the model's own eager attention, and, when the layer is ours, a counted fallback.
        what = ", ".join(k for k in ("softcap", "s_aux") if kwargs.get(k) is not None)
        if entry is not None:
            entry[1].fallback(entry[0], f"attention with {what} runs the model's eager attention")
        eager = _eager_fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
        if eager is not None:
            return eager
    if entry is None or unsupported:
        # Not ours (closed guard, another model) or a variant the protected kernel does not implement: stay correct.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            position_bias=position_bias, **kwargs
        )
    ctx, binder, rotates = entry
    n_rep = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As sdpa_attention_forward: the flag is only a shortcut for "no mask given, causal layer, more than one query".
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        position_bias = position_bias[..., :q_len] if position_bias is not None else None
    if position_bias is not None:
        # T5-style learned relative bias (B|1, H, T, S): folded into one additive mask as sdpa_attention_forward
        # does; it keeps its gradient (protected_sdpa differentiates a mask that requires it).
        attention_mask = _position_bias_mask(position_bias, attention_mask, causal, query.shape[2], key)
        causal = False
    # RoPE (Llama) or a KV cache rebuild Q/K after their projections: then the scores need checksums of these.
    out_BHTD = checked_attention(binder, ctx, query, key, value, rotates=rotates, attn_mask=attention_mask,
                                 is_causal=causal, scale=scaling, dropout_p=dropout, enable_gqa=n_rep > 1)
    return out_BHTD.transpose(1, 2).contiguous(), None


def _eager_fallback(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    kwargs: dict[str, Any],
) -> Any:
    """``eager_attention_forward`` of the module's own modeling file, given the additive mask it expects (the masks
    built for "attnchecker" are SDPA's: boolean, or None where SDPA's is_causal would do). None without one."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        return None
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        # transformers leaves the mask out only where SDPA's top-left is_causal is exact: the first q_len keys.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        attention_mask = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _position_bias_mask(
    bias_BHTS: torch.Tensor, mask: torch.Tensor | None, causal: bool, q_len: int, key: torch.Tensor
) -> torch.Tensor:
    """transformers' create_position_bias_mask (not in every 5.x): the bias where attention is allowed, finfo.min
    where the bool mask or causality forbids, or bias + mask for an additive mask."""
    min_value = torch.finfo(key.dtype).min
    if mask is None:
        if not causal:
            return bias_BHTS.contiguous()
        s = key.shape[2]
        allowed_TS = torch.arange(q_len, device=key.device)[:, None] >= torch.arange(s, device=key.device)[None, :]
        return torch.where(allowed_TS, bias_BHTS, min_value).contiguous()
    if mask.dtype == torch.bool:
        return torch.where(mask, bias_BHTS, min_value).contiguous()
    return (bias_BHTS + mask).contiguous()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Both, always: without the mask entry transformers builds no mask for an unknown implementation, which silently
    # drops causal masking. Left registered after close: a model still set to it (by the user) runs plain SDPA.
    AttentionInterface.register(ATTN_IMPLEMENTATION, attnchecker_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def _layout(proj: nn.Module) -> str | None:
    from transformers.pytorch_utils import Conv1D

    proj = base_linear(proj)  # a PEFT LoRA wrapper has its base layer's layout (integrations/peft.py)
    if isinstance(proj, Conv1D):
        return "in_out"
    if isinstance(proj, nn.Linear):
        return "out_in"
    return None  # quantized / other adapter-wrapped projections: leave them alone rather than guess their math


def _out_features(proj: Any) -> int:
    weight: torch.Tensor = base_linear(proj).weight  # type: ignore[assignment]  # Linear / Conv1D
    return int(weight.shape[1] if _layout(proj) == "in_out" else weight.shape[0])


def _hook_projections(
    binder: Binder, module: nn.Module, parent: nn.Module | None, ctx: LayerContext
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Hook the q/k/v/out projections of one attention module; returns the ops hooked, their coverage paths, and
    why each op that was not hooked was not."""
    ops: list[str] = []
    paths: dict[str, str] = {}
    gaps: dict[str, str] = {}
    children = dict(module.named_children())
    c_attn = children.get("c_attn")
    c_layout = _layout(c_attn) if c_attn is not None else None
    if c_attn is not None and c_layout is not None:
        n = _out_features(c_attn)
        q_attn = children.get("q_attn")
        q_layout = _layout(q_attn) if q_attn is not None else None
        if getattr(module, "is_cross_attention", False) and q_attn is not None and q_layout is not None:
            # GPT-2 cross-attention: q from q_attn, k and v fused in c_attn over the encoder states.
            paths["q"] = binder.hook_projection(q_attn, ctx, op="q", weight_layout=q_layout)
            paths["k"] = paths["v"] = binder.hook_projection(c_attn, ctx, splits=(("k", n // 2), ("v", n // 2)),
                                                             weight_layout=c_layout)
            ops += ["q", "k", "v"]
        elif n % 3 == 0:
            third = n // 3
            splits = (("q", third), ("k", third), ("v", third))
            paths["q"] = paths["k"] = paths["v"] = binder.hook_projection(c_attn, ctx, splits=splits,
                                                                          weight_layout=c_layout)
            ops += ["q", "k", "v"]
        else:
            gaps.update(dict.fromkeys(("q", "k", "v"), f"c_attn width {n} is not 3 x the head width"))
    elif c_attn is not None:
        gaps.update(dict.fromkeys(("q", "k", "v"), projection_gap(c_attn)))
    else:
        for names in _SEPARATE_QKV:
            if all(n in children for n in names):
                for op, child in zip(("q", "k", "v"), names, strict=True):
                    layout = _layout(children[child])
                    if layout is not None:
                        paths[op] = binder.hook_projection(children[child], ctx, op=op, weight_layout=layout)
                        ops.append(op)
                    else:
                        gaps[op] = projection_gap(children[child])
                break
        else:
            gaps.update(dict.fromkeys(("q", "k", "v"), projection_gap(None, "q/k/v projection")))
    out = next((children[n] for n in _OUT_NAMES if n in children), None)
    if out is None and parent is not None:
        # BERT/RoBERTa: the output projection is `output.dense`, a sibling of the attention module.
        sibling = getattr(parent, "output", None)
        out = getattr(sibling, "dense", None) if isinstance(sibling, nn.Module) else None
    out_layout = _layout(out) if out is not None else None
    if out is not None and out_layout is not None:
        paths["out"] = binder.hook_projection(out, ctx, op="out", weight_layout=out_layout)
        ops.append("out")
    else:
        gaps["out"] = projection_gap(out, "output projection")
    return ops, paths, gaps


def _is_gpt_neo_attention(module: nn.Module) -> bool:
    mod = sys.modules.get("transformers.models.gpt_neo.modeling_gpt_neo")
    if mod is None:
        return False
    cls = mod.GPTNeoSelfAttention
    # Subclasses with their own forward (the flash-attention variant) do not call _attn.
    return isinstance(module, cls) and type(module).forward is cls.forward and type(module)._attn is cls._attn


def _neo_attn(
    module: Any,
    ctx: LayerContext,
    binder: Binder,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """``GPTNeoSelfAttention._attn`` through ``protected_sdpa``: no 1/sqrt(d) scaling (scale=1.0), the layer's own
    causal or sliding-window ``bias`` plus the additive mask it is given, scores in fp32 as the original keeps them.

    query/key/value (B, H, T, D) -> (B, H, T, D), None.
    """
    q = query.to(torch.float32)
    k = key.to(torch.float32)
    q_len, k_len = q.size(-2), k.size(-2)
    allowed_11TS = module.bias[:, :, k_len - q_len : k_len, :k_len]
    # The original writes finfo.min where the window forbids, then adds the model's mask; the same as one additive
    # mask (a masked position is ~-3e38 either way, and exp() of it is 0).
    mask = torch.zeros(allowed_11TS.shape, dtype=torch.float32, device=q.device)
    mask = mask.masked_fill(~allowed_11TS, torch.finfo(torch.float32).min)
    if attention_mask is not None:
        mask = mask + attention_mask
    dropout = module.attn_dropout.p if module.training else 0.0
    v = value.to(torch.float32)
    out = checked_attention(binder, ctx, q, k, v, rotates=False, attn_mask=mask, scale=1.0, dropout_p=dropout)
    return out.to(value.dtype), None


def attach(binder: Binder, model: Any, *, prefix: str = "") -> None:
    """``model`` is a ``transformers.PreTrainedModel`` (typed Any: transformers ships no annotations we can use),
    named ``prefix`` in the protected tree."""
    parents: dict[nn.Module, nn.Module] = {}
    for parent in model.modules():
        for child in parent.children():
            parents.setdefault(child, parent)
    interface_modules: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules(prefix=prefix):
        if _is_gpt_neo_attention(module):
            _attach_gpt_neo(binder, name, module)
        elif forward_source_mentions(module, "ALL_ATTENTION_FUNCTIONS"):
            interface_modules.append((name, module))
    if not interface_modules:
        return
    if not type(model)._can_set_attn_implementation():
        log.warning(
            "attnchecker: %s has AttentionInterface layers but cannot switch implementation at run time; "
            "they stay unprotected",
            type(model).__name__,
        )
        for name, _module in interface_modules:
            binder.add_unprotected(name, ("q", "k", "v", "scores", "context", "out"),
                                   f"{type(model).__name__} cannot switch its attention implementation at run time")
        return
    _register()
    for name, module in interface_modules:
        ctx = binder.context_for(module)
        ops, paths, gaps = _hook_projections(binder, module, parents.get(module), ctx)
        _CONTEXTS[module] = (ctx, binder, rotates_qk(module))
        binder.on_close(functools.partial(_forget, module))
        qkv = [op for op in ops if op != "out"]
        binder.add_site(ctx, name, "transformers", (*qkv, "scores", "context", *(["out"] if "out" in ops else [])),
                        paths=paths, gaps=gaps)
    original = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    binder.on_close(functools.partial(_restore_implementation, model, original))


def _forget(module: nn.Module) -> None:
    _CONTEXTS.pop(module, None)


def _restore_implementation(model: Any, original: str) -> None:
    if model.config._attn_implementation != original:
        model.set_attn_implementation(original)


def _attach_gpt_neo(binder: Binder, name: str, module: Any) -> None:
    ctx = binder.context_for(module)
    children = dict(module.named_children())
    ops: list[str] = []
    paths: dict[str, str] = {}
    gaps: dict[str, str] = {}
    for op, n in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "out_proj")):
        if op == "out":
            ops += ["scores", "context"]
        if n in children and isinstance(base_linear(children[n]), nn.Linear):
            paths[op] = binder.hook_projection(children[n], ctx, op=op)
            ops.append(op)
        else:
            gaps[op] = projection_gap(children.get(n))
    had_own = "_attn" in module.__dict__
    previous = module.__dict__.get("_attn")
    # An instance attribute shadows the class method for this module only; deleting it restores the class method.
    module._attn = functools.partial(_neo_attn, module, ctx, binder)

    def restore() -> None:
        if had_own:
            module._attn = previous
        else:
            del module._attn

    binder.on_close(restore)
    binder.add_site(ctx, name, "gpt_neo", tuple(ops), paths=paths, gaps=gaps)
