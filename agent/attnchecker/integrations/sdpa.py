"""Plain PyTorch models that call ``F.scaled_dot_product_attention`` inline (nanoGPT style), FlexAttention's
``flex_attention``, or packed varlen attention (torch's ``varlen_attn``, flash-attn's ``flash_attn_varlen_func``).

A ``TorchFunctionMode`` is active only while an identified attention module runs (forward pre/post hooks on it), and
routes each SDPA call to ``protected_sdpa`` with that module's LayerContext (the k-th call of one forward gets the
module's k-th context, for modules that loop over several attentions), and each varlen op to the checked varlen
engine. A mode catches every call site, including ``from torch.nn.functional import scaled_dot_product_attention``,
which a monkey-patch would miss; it does not see calls nested inside other overridden functions (pytorch#131947).
flex_attention and flash_attn_varlen_func are Python functions no mode sees: the names the attention class's module
binds them to are routed instead (integrations/flex_varlen.py).

Attention modules are found without running the model: the class ``forward`` mentions one of those calls
(or, only when no class of the model has readable source, the module owns a fused q/k/v Linear named as one, with
out = 3 * in, beside an output projection). Their projections are
hooked when the structure is recognisable: a fused q/k/v Linear or separate q/k/v Linears, and an output Linear.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checks.context import LayerContext
from ._common import (
    Binder,
    ContextRef,
    checked_attention,
    forward_source_mentions,
    projection_gap,
    rotates_qk,
    source_readable,
)
from .flex_varlen import (
    FLASH_VARLEN,
    FLEX,
    PASS,
    call_names,
    flash_varlen_call,
    flex_call,
    is_varlen_op,
    patch_names,
    varlen_op_call,
)
from .peft import base_linear

__all__ = ["attach"]

log = logging.getLogger("attnchecker")

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# What an attention class's forward calls, and the coverage path (coverage.PATHS) its scores and context then take.
_CALLS = {"scaled_dot_product_attention": "sdpa", FLEX: "flex", "varlen_attn": "varlen", FLASH_VARLEN: "varlen"}
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
    path: str = "sdpa"
    """How its attention calls are routed: sdpa, flex or varlen (coverage.PATHS)."""
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
            self.binder.add_site(ctx, name, self.path, self.ops, paths=self.paths, gaps=self.gaps)
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
        if is_varlen_op(func):
            owner = self._router.current()
            if owner is not None:
                return varlen_op_call(owner.next_sdpa_context(), owner.binder, func, args, kwargs)
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
    # Q/K rotated (RoPE) or otherwise rebuilt after the projections: the scores need checksums of these tensors.
    return checked_attention(owner.binder, ctx, a["query"], a["key"], a["value"], rotates=owner.rotates,
                             attn_mask=a.get("attn_mask"), is_causal=bool(a.get("is_causal", False)),
                             scale=a.get("scale"), dropout_p=float(a.get("dropout_p", 0.0)),
                             enable_gqa=bool(a.get("enable_gqa", False)))


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

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """The mode off while the engine runs a call that reached it by name (flex_attention): every op of the engine
        would pass through it, and the caller's compiled flex_attention would trace it. Left on when another mode was
        pushed above it (popping that one is not ours to do)."""
        top = torch._C._len_torch_function_stack() > 0 and torch._C._get_function_stack_at(
            torch._C._len_torch_function_stack() - 1) is self._mode
        if self._depth == 0 or not top:
            yield
            return
        self._mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        try:
            yield
        finally:
            self._mode.__enter__()  # type: ignore[no-untyped-call]

    def route(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that reached a routed name (flex_varlen.patch_names): checked when a protected module runs."""
        owner = self.current()
        if owner is None:
            return PASS
        ctx = owner.next_sdpa_context()
        call = flash_varlen_call if _is(original, call_names().get(FLASH_VARLEN)) else flex_call
        with self.outside():
            return call(ctx, owner.binder, original, args, kwargs)


def _is(value: Any, fn: Any) -> bool:
    return fn is not None and (value is fn or getattr(value, "_torchdynamo_orig_callable", None) is fn)


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
    found = [(n, m) for n, m in modules if _path_of(m) is not None]
    if found or any(source_readable(m) for _, m in modules if not type(m).__module__.startswith("torch.")):
        # The model's own classes can be read, and those that call SDPA are the attention: nothing is guessed.
        return found
    # No readable source at all (a model built in a notebook or by exec): fall back on the shape of a fused
    # attention, a q/k/v projection by its name with out = 3 * in next to an output projection of the q width. An MLP's
    # up projection can have out = 3 * in too (torchtitan's debug model: w1 is 256 -> 768), never with those names.
    return [(n, m) for n, m in modules if _fused_attention_shape(dict(m.named_children()))]


def _path_of(module: nn.Module) -> str | None:
    """The coverage path of a module whose forward makes one of the routed attention calls, else None."""
    return next((path for call, path in _CALLS.items() if forward_source_mentions(module, call)), None)


def _fused_attention_shape(children: dict[str, nn.Module]) -> bool:
    for name in _FUSED_NAMES:
        lin = _linear(children.get(name))
        if lin is not None and lin.out_features == 3 * lin.in_features:
            return _out(children, lin.in_features, {name}) is not None
    return False


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
            owner = owners[owner_module] = _Owner(name=owner_name, binder=binder, ops=(), rotates=rotates,
                                                  path=_path_of(module) or "sdpa")
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
    # flex_attention and flash_attn_varlen_func by the names the attention classes' code resolves them through.
    patch_names(binder, {type(m).forward for _, m in candidates}, router.route)


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
