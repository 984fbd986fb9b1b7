"""What every integration needs from the guard: a LayerContext per attention layer, projection hooks, and an undo
list that ``Guard.close()`` runs in reverse, so each integration's changes are taken back exactly."""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from .. import compiled
from ..checks.context import CheckConfig, LayerContext, OpStats, Runtime
from ..compiled import registry
from ..coverage import Coverage, Miss, OpCoverage, unchecked_claims
from ..errors import UnprotectedAttentionError
from .projection_hook import ContextRef, Outputs, Splits, check_projection

__all__ = ["Binder", "ContextRef", "Site", "checked_attention", "engine_call", "forward_source_mentions",
           "projection_gap", "rotates_qk", "source_readable"]

log = logging.getLogger("attnchecker")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Site:
    """One protected attention layer, as ``Guard.sites`` and docs/architectures.md describe it."""

    layer: int
    name: str
    """Qualified module name in the protected model ('' for the root)."""
    integration: str
    """transformers | gpt_neo | sdpa | flex | varlen | torchtitan | torch_mha"""
    ops: tuple[str, ...]
    """The ops verified in this layer (a subset of context.OPS)."""
    paths: tuple[tuple[str, str], ...] = ()
    """(op, path) for each verified op (coverage.PATHS)."""
    gaps: tuple[tuple[str, str], ...] = ()
    """(op, reason) for each op of this layer left unprotected."""


class Binder:
    """Creates the guard's layer contexts and records how to undo every change an integration makes."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.contexts: dict[nn.Module, LayerContext] = {}
        self.sites: list[Site] = []
        self._undo: list[Callable[[], None]] = []
        self._next_layer = 0
        # (layer, op) -> (storage, numel) of the projection output last checked: tells whether the q/k/v an
        # attention call gets are still those outputs (views: reshape, transpose, split) or new tensors.
        self._outputs: Outputs = {}
        # Attention modules left out whole (no layer), and calls that fell back to an unprotected kernel at run time.
        self.unprotected: list[OpCoverage] = []
        self.fallbacks: dict[tuple[int, str, str], int] = {}
        # (layer, op) a site claims that went unchecked in steps it was due: reported unprotected (coverage.Miss).
        self.misses: dict[tuple[int, str], Miss] = {}
        self.strict = False

    def new_context(self) -> LayerContext:
        ctx = LayerContext(layer=self._next_layer, runtime=self.runtime)
        ctx.op_key = registry.add(ctx)
        self.on_close(functools.partial(registry.remove, ctx.op_key))
        self._next_layer += 1
        return ctx

    def context_for(self, module: nn.Module) -> LayerContext:
        ctx = self.contexts.get(module)
        if ctx is None:
            ctx = self.contexts[module] = self.new_context()
        return ctx

    def add_site(
        self,
        ctx: LayerContext,
        name: str,
        integration: str,
        ops: tuple[str, ...],
        *,
        paths: dict[str, str] | None = None,
        gaps: dict[str, str] | None = None,
    ) -> None:
        """paths: op -> path for the projections (default: the integration's own path); gaps: op -> why not."""
        paths = paths or {}
        self.sites.append(Site(
            layer=ctx.layer, name=name, integration=integration, ops=ops,
            paths=tuple((op, paths.get(op, integration)) for op in ops),
            gaps=tuple((op, why) for op, why in (gaps or {}).items() if op not in ops),
        ))

    def add_unprotected(self, name: str, ops: tuple[str, ...], reason: str) -> None:
        """An attention module left unprotected whole (it gets no layer)."""
        self.unprotected += [OpCoverage(layer=None, name=name, op=op, reason=reason) for op in ops]

    def fallback(self, ctx: LayerContext, reason: str, ops: str = "scores,context") -> None:
        """A call of a protected layer that runs unprotected (a variant the engine does not implement): counted in
        the coverage map, warned about once per reason, an error under ``protect(strict=True)``."""
        key = (ctx.layer, ops, reason)
        first = not any(r == reason for _, _, r in self.fallbacks)
        self.fallbacks[key] = self.fallbacks.get(key, 0) + 1
        if self.strict:
            raise UnprotectedAttentionError(
                f"layer {ctx.layer} {ops}: {reason}; protect(strict=True) allows no fallback")
        if first:
            log.warning("attnchecker: layer %d %s runs unprotected: %s (Guard.coverage counts every such call)",
                        ctx.layer, ops, reason)

    def note_step(self, stats: OpStats, config: CheckConfig, step: int) -> None:
        """At a step boundary: an op a site claims, due on that step (full check or tier 1) in a step the model ran,
        that no check or tripwire saw, is from now on reported unprotected with the reason, and warned about once
        (an error under strict=True). What the coverage map says is then what the steps did, not what attaching
        intended."""
        for layer, name, op, path in unchecked_claims(self.sites, stats, config):
            miss = self.misses.get((layer, op))
            if miss is not None:
                miss.steps += 1
                continue
            miss = self.misses[(layer, op)] = Miss(path=path, first_step=step)
            if self.strict:
                raise UnprotectedAttentionError(f"layer {layer} ({name}) {op}: {miss.reason()}; "
                                                "protect(strict=True) allows no unchecked op")
            if not any(m.path == path for key, m in self.misses.items() if key != (layer, op)):
                log.warning("attnchecker: layer %d (%s) %s: %s (Guard.coverage reports it, and every such op, "
                            "unprotected)", layer, name, op, miss.reason())

    def coverage(self, current: tuple[OpStats, CheckConfig] | None = None) -> Coverage:
        """The map: every site's ops (unprotected where a step left them unchecked, ``note_step``; with ``current``
        the step in progress too, when the model has finished a forward in it), the modules left out and the
        run-time fallbacks."""
        misses = dict(self.misses)
        if current is not None:
            for layer, _, op, path in unchecked_claims(self.sites, *current):
                misses.setdefault((layer, op), Miss(path=path, first_step=self.runtime.step))
        entries = [
            OpCoverage(layer=site.layer, name=site.name, op=op, path=path) if (site.layer, op) not in misses else
            OpCoverage(layer=site.layer, name=site.name, op=op, reason=misses[(site.layer, op)].reason())
            for site in self.sites for op, path in site.paths
        ] + [
            OpCoverage(layer=site.layer, name=site.name, op=op, reason=why) for site in self.sites
            for op, why in site.gaps
        ] + self.unprotected
        calls = self.runtime.calls
        return Coverage(entries=tuple(entries), fallbacks=dict(self.fallbacks), backends=dict(calls.ran_by),
                        declined=dict(calls.declined))

    def on_close(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def hook_projection(
        self,
        proj: nn.Module,
        ctx: ContextRef,
        *,
        op: str | None = None,
        splits: Splits | None = None,
        weight_layout: str = "out_in",
    ) -> str:
        """Verify (and correct in place) the output of an unmodified projection module after it runs. A PEFT LoRA
        wrapper (integrations/peft.py) is verified against its effective product. Returns the coverage path."""
        from . import peft

        names = tuple(name for name, _ in splits) if splits is not None else (op or "",)
        if peft.is_lora(proj):
            peft.hook_lora(self, proj, ctx, op=op, splits=splits, names=names)
            return "peft-lora"
        hook = functools.partial(_projection_hook, self._outputs, ctx, op, splits, names, weight_layout)
        handle = proj.register_forward_hook(hook, with_kwargs=True)
        self.on_close(handle.remove)
        return "hook"

    def passed_matches(self, ctx: LayerContext, *, rotates: bool, **qkv: torch.Tensor) -> bool:
        """Whether the checksums the layer's projections passed on still describe these q/k/v (``use_passed`` of
        protected_sdpa). True for a view of the checked projection output, and for a same-size copy (transformers'
        KV cache concatenates onto an empty cache in training) unless the module rotates Q/K (``rotates``, RoPE:
        new values of the same size). False when the size changed (a filled cache). No device work."""
        for op, t in qkv.items():
            seen = self._outputs.get((ctx.layer, op))
            if seen is None or seen[0] == t.untyped_storage().data_ptr():
                continue
            if rotates or seen[1] != t.numel():
                return False
        return True

    def undo_all(self) -> None:
        """Run every undo action, newest first. One failing does not stop the others; the first error is raised."""
        first: BaseException | None = None
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception as e:
                log.error("attnchecker: undo step %r failed: %s", fn, e)
                first = first or e
        self.contexts.clear()
        self._outputs.clear()
        if first is not None:
            raise first


def projection_gap(module: nn.Module | None, role: str = "projection") -> str:
    """Why a projection is not protected, for the coverage map."""
    from . import peft

    if module is None:
        return f"no {role} recognised (by name and shape: docs/architectures.md)"
    why = peft.why_unsupported(module)
    if why is not None:
        return why
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
        return f"quantized weight ({type(module).__name__}, {weight.dtype})"
    return f"{type(module).__name__} is not an nn.Linear / HF Conv1D (or a PEFT LoRA around one)"


def checked_attention(
    binder: Binder,
    ctx: LayerContext,
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    *,
    rotates: bool | None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``protected_sdpa`` for an integration: eagerly through ``engine_call``, with ``use_passed`` from
    ``Binder.passed_matches``; while Dynamo traces, as the ``attnchecker::attention`` op, with ``use_passed`` decided
    from the module alone (``rotates``: no storage to compare in a traced graph). rotates=None: Q/K change between
    projection and attention in a way no passed checksum follows (torchtitan's RoPE), use_passed False either way.
    q (B, H, T, D), k/v (B, Hk, S, D) -> (B, H, T, Dv)."""
    if torch.compiler.is_compiling():
        return compiled.attention(q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal,
                                  scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa,
                                  use_passed=rotates is False)
    from ..attention.pipeline import protected_sdpa

    use_passed = rotates is not None and binder.passed_matches(ctx, rotates=rotates, q=q_BHTD, k=k_BHSD, v=v_BHSD)
    out = engine_call(protected_sdpa, q_BHTD, k_BHSD, v_BHSD, ctx=ctx, attn_mask=attn_mask, is_causal=is_causal,
                      scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa, use_passed=use_passed)
    assert isinstance(out, torch.Tensor)  # no return_probs: a tensor, not (out, probs)
    return out


@torch.compiler.disable
def engine_call(fn: Callable[..., T], *tensors: torch.Tensor | None, **kwargs: Any) -> T:
    """Call an engine function the way autocast would have run the op it replaces, with autocast off inside.

    Floating inputs (float masks too) are cast to the autocast dtype here, as autocast casts the original op's
    operands; the engine then sees exactly the dtypes the op ran in, and none of its own fp32 checksum products can
    be lowered by autocast. Without autocast this is a plain call.
    """
    device_type = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device_type):
        return fn(*tensors, **kwargs)
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    # Float masks too, as autocast does for SDPA (a wider mask would promote the scores past V's dtype).
    with torch.autocast(device_type, enabled=False):
        return fn(*map(cast, tensors), **{k: cast(v) for k, v in kwargs.items()})


def _projection_hook(
    outputs: dict[tuple[int, str], tuple[int, int]],
    ctx_ref: ContextRef,
    op: str | None,
    splits: Splits | None,
    names: tuple[str, ...],
    weight_layout: str,
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: torch.Tensor,
) -> torch.Tensor:
    # nn.Linear names its input `input`, HF Conv1D names it `x`; positional is the common case.
    x = args[0] if args else next(iter(kwargs.values()))
    weight: torch.Tensor = module.weight  # type: ignore[assignment]  # nn.Linear / HF Conv1D parameters
    bias: torch.Tensor | None = module.bias  # type: ignore[assignment]
    ctx = ctx_ref if isinstance(ctx_ref, LayerContext) else ctx_ref()
    if torch.compiler.is_compiling():
        # Traced: the check is one op in the graph, and its repaired copy is the module's output from here on.
        return compiled.projection_check(ctx, x, output, weight, bias, op=op, splits=splits,
                                         weight_layout=weight_layout)
    return _check_projection_eagerly(outputs, ctx, x, output, weight, bias, op=op, splits=splits, names=names,
                                     weight_layout=weight_layout)


@torch.compiler.disable
def _check_projection_eagerly(outputs: dict[tuple[int, str], tuple[int, int]], ctx: LayerContext, x: torch.Tensor,
                              output: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, **kwargs: Any
                              ) -> torch.Tensor:
    return check_projection(outputs, ctx, x, output, weight, bias, **kwargs)


# Read once per class: inspect.getsource re-reads the file.
_SOURCE_CACHE: dict[tuple[type, str], bool] = {}


def _source_search(cls: type, key: str, test: Callable[[type], bool]) -> bool:
    found = _SOURCE_CACHE.get((cls, key))
    if found is None:
        try:
            found = test(cls)
        except (OSError, TypeError):
            found = False
        _SOURCE_CACHE[(cls, key)] = found
    return found


def forward_source_mentions(module: nn.Module, needle: str) -> bool:
    """Whether the source of the module's class ``forward`` contains ``needle`` (False when there is no source).

    A heuristic, like transformers' own ``_can_set_attn_implementation``: it finds who calls what without running
    the model.
    """
    return _source_search(type(module), f"forward:{needle}", _forward_source_has(needle))


def source_readable(module: nn.Module) -> bool:
    """Whether the source of the module's class ``forward`` can be read (not a class made in a notebook or by exec)."""
    return _source_search(type(module), "readable",
                          lambda cls: bool(inspect.getsource(cls.forward)))  # type: ignore[attr-defined]


def _forward_source_has(needle: str) -> Callable[[type], bool]:
    def test(cls: type) -> bool:
        return needle in inspect.getsource(cls.forward)  # type: ignore[attr-defined]  # an nn.Module subclass

    return test


# Words that give away a rotary position embedding in an attention class (its forward or its helpers).
_ROTARY = re.compile(r"rotary|\brope\b|freqs_cis|rotate_half|apply_rope|position_embeddings")


def rotates_qk(module: nn.Module) -> bool:
    """Whether the attention class rotates Q/K between projection and attention (RoPE), read from its source."""
    return _source_search(type(module), "rotary", lambda cls: _ROTARY.search(inspect.getsource(cls)) is not None)
