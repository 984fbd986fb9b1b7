"""Plain PyTorch models that call ``F.scaled_dot_product_attention`` inline (nanoGPT style).

A ``TorchFunctionMode`` is active only while an identified attention module runs (forward pre/post hooks on it), and
routes each SDPA call to ``protected_sdpa`` with that module's LayerContext (the k-th call of one forward gets the
module's k-th context, for modules that loop over several attentions). A mode catches every call site, including
``from torch.nn.functional import scaled_dot_product_attention``, which a monkey-patch would miss; it does not see
calls nested inside other overridden functions (pytorch#131947).

Attention modules are found without running the model: the class ``forward`` mentions scaled_dot_product_attention
(or, when the source is unavailable, the module owns a fused q/k/v Linear with out = 3 * in). Their projections are
hooked when the structure is recognisable: a fused q/k/v Linear or separate q/k/v Linears, and an output Linear.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checks.context import LayerContext
from ._common import Binder, ContextRef, engine_call, forward_source_mentions, projection_gap, rotates_qk
from .peft import base_linear

__all__ = ["attach"]

log = logging.getLogger("attnchecker")

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FUSED_NAMES = ("c_attn", "qkv", "Wqkv", "qkv_proj", "in_proj", "to_qkv", "wqkv")
_SEPARATE_NAMES = (("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"), ("query", "key", "value"), ("q", "k", "v"))
_OUT_NAMES = ("c_proj", "o_proj", "out_proj", "wo", "proj", "out", "to_out", "dense")


@dataclass(slots=True)
class _Owner:
    """One attention module (the one owning the projections): a layer per SDPA call of one forward, numbered when
    first seen, and which call of this forward the SDPA and each projection are at."""

    name: str
    binder: Binder
    ops: tuple[str, ...]
    rotates: bool = False
    """The module rotates Q/K (RoPE) between its projections and SDPA."""
    paths: dict[str, str] = field(default_factory=dict)
    gaps: dict[str, str] = field(default_factory=dict)
    contexts: list[LayerContext] = field(default_factory=list)
    calls: int = 0
    proj_calls: dict[int, int] = field(default_factory=dict)

    def context(self, k: int) -> LayerContext:
        while len(self.contexts) <= k:
            # A module that runs several attentions per forward (a shared block applied twice): one layer each.
            ctx = self.binder.new_context()
            name = self.name if not self.contexts else f"{self.name}#{len(self.contexts)}"
            self.contexts.append(ctx)
            self.binder.add_site(ctx, name, "sdpa", self.ops, paths=self.paths, gaps=self.gaps)
        return self.contexts[k]

    def reset(self) -> None:
        self.calls = 0
        self.proj_calls.clear()

    def next_sdpa_context(self) -> LayerContext:
        self.calls += 1
        return self.context(self.calls - 1)

    def projection_context(self, proj_id: int) -> LayerContext:
        k = self.proj_calls.get(proj_id, 0)
        self.proj_calls[proj_id] = k + 1
        return self.context(k)


class _SDPAMode(TorchFunctionMode):
    def __init__(self, router: _Router) -> None:
        super().__init__()
        self._router = router

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            owner = self._router.current()
            if owner is not None:
                bound = dict(zip(_SDPA_ARGS, args, strict=False))
                bound.update(kwargs)
                if bound["query"].dim() == 4:
                    return _call_protected(owner, owner.next_sdpa_context(), bound)
                # Counted against the module's first layer: it takes no layer of its own.
                owner.binder.fallback(owner.context(0),
                                      f"SDPA call with a {bound['query'].dim()}-D query (not (B, H, T, D))")
        return func(*args, **kwargs)


def _call_protected(owner: _Owner, ctx: LayerContext, a: dict[str, Any]) -> torch.Tensor:
    from ..attention.pipeline import protected_sdpa

    # Q/K rotated (RoPE) or otherwise rebuilt after the projections: the scores need checksums of these tensors.
    use_passed = owner.binder.passed_matches(ctx, rotates=owner.rotates, q=a["query"], k=a["key"], v=a["value"])
    out = engine_call(
        protected_sdpa,
        a["query"],
        a["key"],
        a["value"],
        ctx=ctx,
        attn_mask=a.get("attn_mask"),
        is_causal=bool(a.get("is_causal", False)),
        scale=a.get("scale"),
        dropout_p=float(a.get("dropout_p", 0.0)),
        enable_gqa=bool(a.get("enable_gqa", False)),
        use_passed=use_passed,
    )
    assert isinstance(out, torch.Tensor)  # no return_probs: a tensor, not (out, probs)
    return out


class _Router:
    """Which attention module is running, and so which LayerContext the next SDPA call belongs to."""

    def __init__(self) -> None:
        self._mode = _SDPAMode(self)
        self._stack: list[_Owner] = []
        self._depth = 0

    def enter(self, owner: _Owner) -> None:
        self._stack.append(owner)
        self._depth += 1
        if self._depth == 1:
            self._mode.__enter__()  # type: ignore[no-untyped-call]

    def exit(self, owner: _Owner) -> None:
        if self._stack and self._stack[-1] is owner:
            self._stack.pop()
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    def current(self) -> _Owner | None:
        return self._stack[-1] if self._stack else None


def _linear(m: nn.Module | None) -> nn.Linear | None:
    """The nn.Linear a child is, or stands for (a PEFT LoRA wrapper around one: hooked as the wrapper)."""
    base = base_linear(m) if m is not None else None
    return base if isinstance(base, nn.Linear) else None


def _fused(children: dict[str, nn.Module]) -> tuple[str, nn.Module] | None:
    for n in (*_FUSED_NAMES, *children):
        lin = _linear(children.get(n))
        if lin is not None and lin.out_features == 3 * lin.in_features:
            return n, children[n]
    return None


def _separate(children: dict[str, nn.Module]) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    for names in _SEPARATE_NAMES:
        mods = [children.get(n) for n in names]
        if all(_linear(m) is not None for m in mods):
            return mods[0], mods[1], mods[2]  # type: ignore[return-value]
    return None


def _out(children: dict[str, nn.Module], width: int, taken: set[str]) -> nn.Module | None:
    for n in _OUT_NAMES:
        m = children.get(n)
        lin = _linear(m)
        if n not in taken and lin is not None and lin.in_features == width:
            return m
    return None


def _has_projections(module: nn.Module) -> bool:
    children = dict(module.named_children())
    return _fused(children) is not None or _separate(children) is not None


def _hook_projections(binder: Binder, owner_module: nn.Module, owner: _Owner) -> list[str]:
    """Hook the recognised projections; fills owner.paths (op -> coverage path) and owner.gaps (op -> why not)."""
    children = dict(owner_module.named_children())

    def ctx(proj: nn.Module) -> ContextRef:
        return functools.partial(owner.projection_context, id(proj))

    ops: list[str] = []
    fused = _fused(children)
    width = 0
    taken: set[str] = set()
    if fused is not None:
        name, lin = fused
        third = _linear(lin).out_features // 3  # type: ignore[union-attr]
        path = binder.hook_projection(lin, ctx(lin), splits=(("q", third), ("k", third), ("v", third)))
        owner.paths.update(dict.fromkeys(("q", "k", "v"), path))
        ops += ["q", "k", "v"]
        width, taken = third, {name}
    else:
        sep = _separate(children)
        if sep is not None:
            for op, lin in zip(("q", "k", "v"), sep, strict=True):
                owner.paths[op] = binder.hook_projection(lin, ctx(lin), op=op)
            ops += ["q", "k", "v"]
            width = _linear(sep[0]).out_features  # type: ignore[union-attr]
            taken = {n for names in _SEPARATE_NAMES for n in names}
        else:
            owner.gaps.update(dict.fromkeys(("q", "k", "v"), _qkv_gap(children)))
    out = _out(children, width, taken) if width else None
    if out is not None:
        owner.paths["out"] = binder.hook_projection(out, ctx(out), op="out")
        ops.append("out")
    elif not width:
        owner.gaps["out"] = "output projection not matched: it is found by the q/k/v width, and q/k/v were not"
    else:
        named = next((children[n] for n in _OUT_NAMES if n in children and n not in taken), None)
        owner.gaps["out"] = projection_gap(named, "output projection")
    return ops


def _qkv_gap(children: dict[str, nn.Module]) -> str:
    """Why no q/k/v projection was recognised: a named child that is wrapped or quantized, or none at all."""
    for n in (*_FUSED_NAMES, *(name for names in _SEPARATE_NAMES for name in names)):
        if n in children:
            return projection_gap(children[n])
    return projection_gap(None, "fused or q/k/v projection")


def _candidates(model: nn.Module, exclude: set[nn.Module]) -> list[tuple[str, nn.Module]]:
    modules = [
        (n, m) for n, m in model.named_modules() if m not in exclude and not isinstance(m, nn.MultiheadAttention)
    ]
    found = [(n, m) for n, m in modules if forward_source_mentions(m, "scaled_dot_product_attention")]
    if found:
        return found
    # No readable source (a model built in a notebook or by exec): fall back on the shape of a fused attention.
    return [(n, m) for n, m in modules if _fused(dict(m.named_children())) is not None]


def attach(binder: Binder, model: nn.Module, *, exclude: set[nn.Module] | frozenset[nn.Module] = frozenset()) -> None:
    """Protect the SDPA attention modules of ``model``, except those in ``exclude`` (attached another way)."""
    candidates = _candidates(model, set(exclude))
    if not candidates:
        return
    parents: dict[nn.Module, tuple[str, nn.Module]] = {}
    for pname, parent in model.named_modules():
        for child in parent.children():
            parents.setdefault(child, (pname, parent))
    router = _Router()
    owners: dict[nn.Module, _Owner] = {}
    for name, module in candidates:
        # TorchTitan style: a thin SDPA wrapper module whose parent owns the projections; share the parent's layer.
        owner_name, owner_module = name, module
        if not _has_projections(module) and module in parents and _has_projections(parents[module][1]):
            owner_name, owner_module = parents[module]
        owner = owners.get(owner_module)
        if owner is None:
            rotates = rotates_qk(owner_module) or rotates_qk(module)
            owner = owners[owner_module] = _Owner(name=owner_name, binder=binder, ops=(), rotates=rotates)
            ops = _hook_projections(binder, owner_module, owner)
            qkv = tuple(op for op in ops if op in ("q", "k", "v"))
            owner.ops = (*qkv, "scores", "context", *(op for op in ops if op == "out"))
            binder.contexts[owner_module] = owner.context(0)
            if owner_module is not module:
                # The projections run in the owner's forward, before the wrapper: count calls from there.
                reset = owner_module.register_forward_pre_hook(functools.partial(_reset, owner))
                binder.on_close(reset.remove)
        # A wrapper is one attention per call; a module that owns its projections counts calls per forward.
        pre = module.register_forward_pre_hook(functools.partial(_pre, router, owner, owner_module is not module))
        post = module.register_forward_hook(functools.partial(_post, router, owner), always_call=True)
        binder.on_close(pre.remove)
        binder.on_close(post.remove)


def _reset(owner: _Owner, module: nn.Module, args: Any) -> None:  # noqa: ARG001
    owner.reset()


def _pre(router: _Router, owner: _Owner, wrapper: bool, module: nn.Module, args: Any) -> None:  # noqa: ARG001
    if wrapper:
        owner.calls = 0  # the owner's own pre-hook counts its projections
    else:
        owner.reset()
    router.enter(owner)


def _post(router: _Router, owner: _Owner, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG001
    router.exit(owner)
