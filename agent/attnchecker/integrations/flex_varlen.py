"""FlexAttention and varlen calls made by a protected module, bound to the checked engine (attention/flex.py,
attention/varlen.py) with the caller's own call conventions: ``flex_attention`` (torch.nn.attention.flex_attention),
torch's varlen op (``varlen_attn`` calls ``torch.ops.torch_attn._varlen_attn``, which a TorchFunctionMode sees), and
flash-attn's ``flash_attn_varlen_func`` where that package is imported.

flex_attention and flash_attn_varlen_func are Python functions: no mode sees them (flex_attention also compiles its
own call). The module names that a protected attention class's code resolves them by are bound, while protected, to a
router (``patch_names``) that sends calls made inside a protected module to the engine and every other call to the
function itself; unprotect restores the names. A call through another name (an attribute path, a reference kept
elsewhere) is not routed: the coverage map reports its ops unchecked after the step (coverage.unchecked_claims).
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checks.context import LayerContext
from ._common import Binder, engine_call

__all__ = ["FLASH_VARLEN", "FLEX", "PASS", "call_names", "flash_varlen_call", "flex_call", "is_varlen_op",
           "patch_names", "varlen_op_call"]

FLEX = "flex_attention"
FLASH_VARLEN = "flash_attn_varlen_func"
_FLEX_ARGS = ("query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "return_lse",
              "kernel_options")
_VARLEN_ARGS = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale",
                "window_size", "enable_gqa", "seqused_k", "block_table", "num_splits")
_FLASH_ARGS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
               "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
               "return_attn_probs", "block_table")


def _bind(names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def call_names() -> dict[str, Callable[..., Any]]:
    """The functions routed by name, as imported now: flex_attention always, flash-attn's when it is imported."""
    from torch.nn.attention.flex_attention import flex_attention

    found: dict[str, Callable[..., Any]] = {FLEX: flex_attention}
    flash = sys.modules.get("flash_attn")
    fn = getattr(flash, FLASH_VARLEN, None)
    if fn is not None:
        found[FLASH_VARLEN] = fn
    return found


def flex_call(ctx: LayerContext, binder: Binder, original: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
    """A flex_attention call of a protected layer, checked, returned as flex_attention returns it (out; (out, lse)
    with the deprecated return_lse; (out, AuxOutput) with return_aux). A request for max_scores runs flex_attention
    itself, counted as a fallback."""
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

    from ..attention.flex import protected_flex_attention

    a = _bind(_FLEX_ARGS, args, kwargs)
    aux = a.get("return_aux")
    if aux is not None and aux.max_scores:
        binder.fallback(ctx, "flex_attention with return_aux max_scores (not computed by the checked path)")
        return original(*args, **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    score_mod, block_mask = a.get("score_mod"), a.get("block_mask")
    scale, gqa, options = a.get("scale"), bool(a.get("enable_gqa", False)), a.get("kernel_options")

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        out, got = original(q, k, v, score_mod, block_mask, scale, gqa, kernel_options=options,
                            return_aux=AuxRequest(lse=True))
        return out, got.lse

    out, lse = engine_call(protected_flex_attention, q, k, v, ctx=ctx, score_mod=score_mod, block_mask=block_mask,
                           scale=scale, enable_gqa=gqa, return_lse=True, fused=fused)
    if aux is not None:
        return out, AuxOutput(lse=lse if aux.lse else None)
    return (out, lse) if a.get("return_lse") else out


def is_varlen_op(func: Any) -> bool:
    """torch's varlen op (what ``varlen_attn`` calls), as a TorchFunctionMode receives it."""
    ops = getattr(torch.ops, "torch_attn", None)
    op = getattr(ops, "_varlen_attn", None) if ops is not None else None
    return op is not None and (func is op or func is getattr(op, "default", None))


def varlen_op_call(ctx: LayerContext, binder: Binder, func: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """torch's varlen op of a protected layer, checked: (out, lse (H, T), rng_state) as the op returns them. A paged
    KV cache (seqused_k, block_table: inference only) runs the op itself, counted as a fallback."""
    from ..attention.varlen import protected_varlen_attention, window_of

    a = _bind(_VARLEN_ARGS, args, kwargs)
    if a.get("seqused_k") is not None or a.get("block_table") is not None:
        binder.fallback(ctx, "varlen attention over a paged KV cache (seqused_k / block_table)")
        return func(*args, **kwargs)
    q, k, v = a["query"], a["key"], a["value"]

    def fused() -> tuple[torch.Tensor, torch.Tensor]:
        out, lse, _ = func(*args, **kwargs)
        return out, lse

    out, lse = engine_call(protected_varlen_attention, q, k, v, a["cu_seq_q"], a.get("cu_seq_k"), ctx=ctx,
                           scale=a.get("scale"),
                           window_size=window_of(a.get("window_size"), causal=bool(a.get("is_causal", False))),
                           enable_gqa=bool(a.get("enable_gqa", False)), return_lse=True, fused=fused)
    return out, lse, torch.zeros(2, dtype=torch.uint64, device=q.device)


def flash_varlen_call(ctx: LayerContext, binder: Binder, original: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """flash-attn's ``flash_attn_varlen_func`` of a protected layer, checked (its output; with return_attn_probs,
    dropout, softcap or ALiBi slopes the function itself runs, counted as a fallback)."""
    from ..attention.varlen import protected_varlen_attention, window_of

    a = _bind(_FLASH_ARGS, args, kwargs)
    unsupported = [name for name, off in (("dropout_p", 0.0), ("softcap", 0.0), ("alibi_slopes", None),
                                          ("return_attn_probs", False), ("block_table", None))
                   if a.get(name, off) not in (off, None)]
    if unsupported:
        binder.fallback(ctx, f"flash_attn_varlen_func with {', '.join(unsupported)}")
        return original(*args, **kwargs)
    q, k, v = a["q"], a["k"], a["v"]
    out = engine_call(protected_varlen_attention, q, k, v, a["cu_seqlens_q"], a.get("cu_seqlens_k"), ctx=ctx,
                      scale=a.get("softmax_scale"),
                      window_size=window_of(a.get("window_size"), causal=bool(a.get("causal", False))),
                      enable_gqa=k.shape[1] != q.shape[1])
    return out


@dataclass(slots=True)
class _Name:
    """One module-level name bound to a router: what it was, and the routes (one per live guard) that may take it."""

    original: Callable[..., Any]
    routes: list[Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]] = field(default_factory=list)


# (id of the module's globals, name) -> its routing. A name patched by two guards is patched once; each guard's route
# asks whether the call is its own (its protected module is running) and passes otherwise.
_PATCHED: dict[tuple[int, str], _Name] = {}
PASS = object()
"""What a route returns for a call that is not its own."""


def patch_names(binder: Binder, functions: Iterable[Callable[..., Any]],
                route: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> list[str]:
    """Bind, in the globals of every function in ``functions`` (an attention class's forward: its module), the names
    that resolve to a routed attention function (``call_names``) to a router; ``route(original, args, kwargs)`` gets
    each call and returns ``PASS`` for one that is not its own. Returns the routed names; undone on close."""
    targets = call_names()
    routed: list[str] = []
    for fn in functions:
        g = getattr(fn, "__globals__", None)
        if g is None:
            continue
        for name, value in list(g.items()):
            key = (id(g), name)
            entry = _PATCHED.get(key)
            original = entry.original if entry is not None else _routed_original(value, targets)
            if original is None:
                continue
            if entry is None:
                entry = _PATCHED[key] = _Name(original=value)
                g[name] = _router(entry)
            if route not in entry.routes:
                entry.routes.append(route)
                binder.on_close(_unroute(g, name, key, route))
                routed.append(name)
    return routed


def _routed_original(value: Any, targets: dict[str, Callable[..., Any]]) -> Callable[..., Any] | None:
    """value when it is one of the routed functions, or torch.compile of one (what many models keep: a compiled
    flex_attention), else None."""
    inner = getattr(value, "_torchdynamo_orig_callable", None)
    for fn in targets.values():
        if value is fn or inner is fn:
            return value
    return None


def _router(entry: _Name) -> Callable[..., Any]:
    def routed(*args: Any, **kwargs: Any) -> Any:
        for route in list(entry.routes):
            got = route(entry.original, args, kwargs)
            if got is not PASS:
                return got
        return entry.original(*args, **kwargs)

    routed.__wrapped__ = entry.original  # type: ignore[attr-defined]  # what it stands for, for readers and tools
    return routed


def _unroute(g: dict[str, Any], name: str, key: tuple[int, str],
             route: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> Callable[[], None]:
    def undo() -> None:
        entry = _PATCHED.get(key)
        if entry is None:
            return
        if route in entry.routes:
            entry.routes.remove(route)
        if not entry.routes:
            del _PATCHED[key]
            if getattr(g.get(name), "__wrapped__", None) is entry.original:
                g[name] = entry.original

    return undo
