"""The coverage map: per attention layer and op, what is protected and by which path, and what is not and why.

Built by the integrations while ``protect()`` attaches (static: a projection that is not a plain Linear/Conv1D or a
supported LoRA wrapper, an nn.MultiheadAttention option the engine does not implement, a model that cannot switch its
attention implementation), plus the calls that fell back at run time (a transformers layer called with a learned
``position_bias``, softcapping or sinks; an SDPA call with a query that is not 4-D). ``Guard.coverage``,
``Guard.report().coverage``, the registration ``config`` (compact) and the dashboard (protected / unprotected op
counts) all show it. Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .checks.context import OPS

if TYPE_CHECKING:
    from .checks.context import CheckConfig, OpStats

__all__ = ["PATHS", "Coverage", "Miss", "OpCoverage", "unchecked_claims"]

PATHS: Mapping[str, str] = {
    "hook": "forward hook on the nn.Linear / HF Conv1D projection: its output is verified and repaired in place",
    "peft-lora": "PEFT LoRA projection: verified against the effective product (base + scaled low-rank update)",
    "torch_mha": "nn.MultiheadAttention's forward replaced: protected_linear / protected_sdpa",
    "transformers": "transformers AttentionInterface function 'attnchecker' (protected_sdpa)",
    "gpt_neo": "GPT-Neo _attn replaced per instance (protected_sdpa)",
    "sdpa": "TorchFunctionMode routing F.scaled_dot_product_attention to protected_sdpa",
    "flex": "flex_attention calls of the module routed to protected_flex_attention (checked tiles, score_mod and "
            "BlockMask per tile)",
    "varlen": "varlen attention calls of the module (torch's varlen_attn, flash_attn_varlen_func) checked per "
              "sequence",
    "torchtitan": "torchtitan's inner attention (FlexAttention, VarlenAttention, ScaledDotProductAttention) "
                  "replaced by the checked one",
    "linear": "protect(scope=\"all\"): an nn.Linear / HF Conv1D module's GEMMs (forward, dX, dW) checked",
    "experts": "protect(scope=\"all\"): a transformers mixture-of-experts bank's GEMMs, expert by expert, checked as "
               "a Linear's",
}
"""Every protection path, with what it means (docs/architectures.md, coverage)."""

class _Claims(Protocol):
    """A protected layer as the integrations record it (integrations._common.Site)."""

    @property
    def layer(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def paths(self) -> tuple[tuple[str, str], ...]: ...


@dataclass(slots=True)
class Miss:
    """An op a site claims that a step left unchecked: from the first such step on it is reported unprotected."""

    path: str
    first_step: int
    steps: int = 1

    def reason(self) -> str:
        return (f"claimed ({self.path}) but not checked in {self.steps} step{'s' if self.steps != 1 else ''} it was "
                f"due (first: step {self.first_step}): its computation did not reach the check protect() attached "
                "(docs/architectures.md, 'Claims are checked')")


def unchecked_claims(sites: Iterable[_Claims], stats: OpStats, config: CheckConfig) -> list[tuple[int, str, str, str]]:
    """(layer, name, op, path) of every op a site claims that was due on the step ``stats`` counts (a full check or
    tier 1) and that no check or tripwire saw, if the model finished a forward in that step (none for a step with no
    forward: a layer that did not run was not left unchecked)."""
    if stats.forwards == 0:
        return []
    return [(site.layer, site.name, op, path) for site in sites for op, path in site.paths
            if (config.checks(op) or config.trips(op)) and (site.layer, op) not in stats.seen]


# The registration config is bounded by the collector: 2 x 8 lines of 160 characters at most, ~2.6 kB.
_WIRE_MAX_LINES = 8
_WIRE_MAX_CHARS = 160


@dataclass(frozen=True, slots=True)
class OpCoverage:
    """One op of one attention layer. ``path`` is set when protected (a key of PATHS), ``reason`` when not."""

    layer: int | None
    """The layer index of detections; None for an attention module that got no layer (left out whole)."""
    name: str
    op: str
    path: str | None = None
    reason: str | None = None

    @property
    def protected(self) -> bool:
        return self.path is not None


@dataclass(frozen=True, slots=True)
class Coverage:
    entries: tuple[OpCoverage, ...]
    fallbacks: Mapping[tuple[int, str, str], int] = field(default_factory=dict)
    """Calls that ran unprotected at run time, by (layer, ops "scores,context", reason)."""
    backends: Mapping[tuple[int, str], int] = field(default_factory=dict)
    """Checked attention calls by (layer, backend that ran them) (attention/backends)."""
    declined: Mapping[tuple[int, str], tuple[str, ...]] = field(default_factory=dict)
    """(layer, backend) -> why that backend, ahead in the order, did not take the layer's last call it declined."""

    @property
    def protected(self) -> tuple[OpCoverage, ...]:
        return tuple(e for e in self.entries if e.protected)

    @property
    def unprotected(self) -> tuple[OpCoverage, ...]:
        return tuple(e for e in self.entries if not e.protected)

    @property
    def complete(self) -> bool:
        return not self.unprotected and not self.fallbacks

    def gaps(self) -> list[str]:
        """One line per (ops, reason) left unprotected, layers grouped ("layers 0-31 q,v,out: peft LoRA variant Dora
        (model.layers.0.self_attn, …)"); then one per run-time fallback."""
        by_name: dict[tuple[int | None, str, str], list[str]] = {}
        for e in self.unprotected:
            by_name.setdefault((e.layer, e.name or "<root>", e.reason or "unknown"), []).append(e.op)
        grouped: dict[tuple[str, str], list[tuple[int | None, str]]] = {}
        for (layer, name, reason), ops in by_name.items():
            grouped.setdefault((",".join(_ordered(ops)), reason), []).append((layer, name))
        lines: list[str] = []
        for (op_list, reason), where in grouped.items():
            indices = [layer for layer, _ in where if layer is not None]
            names = [name for _, name in where]
            head = f"layer{'s' if len(indices) > 1 else ''} {_ranges(indices)}" if indices else names[0]
            tail = f" ({names[0]}{', …' if len(names) > 1 else ''})" if indices else ""
            if not indices and len(names) > 1:
                head += f" and {len(names) - 1} more"
            lines.append(f"{head} {op_list}: {reason}{tail}")
        names_of = {e.layer: e.name for e in self.entries}
        lines += [
            f"layer {layer} ({names_of.get(layer) or '?'}) {ops}: {reason} ({n} call{'s' if n != 1 else ''} "
            "ran unprotected)"
            for (layer, ops, reason), n in sorted(self.fallbacks.items())
        ]
        return lines

    def backend_lines(self) -> list[str]:
        """One line per group of layers that ran on the same backends for the same reasons, calls summed over the
        group: "layers 0-11: native (96 calls); declined: triton (tensors on cpu, not cuda)"."""
        ran: dict[int, dict[str, int]] = {}
        for (layer, name), n in self.backends.items():
            ran.setdefault(layer, {})[name] = n
        why: dict[int, list[str]] = {}
        for (layer, name), reasons in sorted(self.declined.items()):
            if (layer, name) not in self.backends:
                why.setdefault(layer, []).append(f"{name} ({'; '.join(reasons)})")
        groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[int]] = {}
        for layer in sorted(set(ran) | set(why)):
            groups.setdefault((tuple(sorted(ran.get(layer, {}))), tuple(why.get(layer, []))), []).append(layer)
        lines = []
        for (names, declined), layers in groups.items():
            calls = [f"{name} ({sum(ran[layer].get(name, 0) for layer in layers)} calls)" for name in names]
            tail = f"; declined: {', '.join(declined)}" if declined else ""
            lines.append(f"layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}: {', '.join(calls) or 'no call'}"
                         f"{tail}")
        return lines

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, every entry (``Report.as_dict()``)."""
        return {
            "protected": len(self.protected),
            "unprotected": len(self.unprotected),
            "entries": [
                {"layer": e.layer, "name": e.name, "op": e.op, "path": e.path, "reason": e.reason}
                for e in self.entries
            ],
            "fallbacks": [
                {"layer": layer, "ops": ops, "reason": reason, "calls": n}
                for (layer, ops, reason), n in sorted(self.fallbacks.items())
            ],
            "backends": [
                {"layer": layer, "backend": name, "calls": n} for (layer, name), n in sorted(self.backends.items())
            ],
            "declined": [
                {"layer": layer, "backend": name, "reasons": list(reasons)}
                for (layer, name), reasons in sorted(self.declined.items())
            ],
        }

    def to_wire(self) -> dict[str, Any]:
        """The compact form for the registration ``config``: counts, one line per group of layers that share the
        same paths ("0-11 q,k,v:peft-lora scores,context:transformers out:hook"), one per gap. Flat and bounded
        (at most 8 lines of 160 characters each per list), whatever the model's depth."""
        by_layer: dict[int | None, list[OpCoverage]] = {}
        for e in self.protected:
            by_layer.setdefault(e.layer, []).append(e)
        signatures: dict[str, list[int]] = {}
        for layer, entries in sorted(by_layer.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            signatures.setdefault(_signature(entries), []).append(-1 if layer is None else layer)
        layers = [f"{_ranges(idx)} {sig}" for sig, idx in signatures.items()]
        gaps = self.gaps()
        return {
            "protected": len(self.protected),
            "unprotected": len(self.unprotected),
            "layers": _bounded(layers),
            "gaps": _bounded(gaps),
        }


def _ordered(ops: Iterable[str]) -> list[str]:
    return sorted(set(ops), key=lambda op: OPS.index(op) if op in OPS else len(OPS))


def _signature(entries: list[OpCoverage]) -> str:
    by_path: dict[str, list[str]] = {}
    for e in entries:
        by_path.setdefault(e.path or "", []).append(e.op)
    return " ".join(f"{','.join(_ordered(ops))}:{path}" for path, ops in by_path.items())


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if start is None:
            start = prev = i
        elif i == prev + 1:  # type: ignore[operator]
            prev = i
        else:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def _bounded(lines: list[str]) -> list[str]:
    clipped = [line if len(line) <= _WIRE_MAX_CHARS else line[: _WIRE_MAX_CHARS - 1] + "…" for line in lines]
    if len(clipped) > _WIRE_MAX_LINES:
        rest = len(clipped) - (_WIRE_MAX_LINES - 1)
        clipped = [*clipped[: _WIRE_MAX_LINES - 1], f"… and {rest} more"]
    return clipped
