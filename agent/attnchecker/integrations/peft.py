"""PEFT LoRA on the attention projections (``peft.tuners.lora.layer.Linear`` around an ``nn.Linear`` or HF ``Conv1D``).

A LoRA layer computes y = base(x) + Σₐ sₐ · B_a(A_a(dropout_a(x))). Its output is verified against the effective
product, read as one GEMM over concatenated inputs:

    y = [x | s₁z₁ | s₂z₂ …] · [W | B₁ | B₂ …]ᵀ + (b + Σ sₐ b_Bₐ),    z_a = A_a(dropout_a(x)) as computed (N, T, r)

so the checksum algebra of check_linear applies unchanged (x: (N, T, I), W: (O, I), B_a: (O, r)), with or without
dropout (z is what A saw and produced), and a merged layer (no adapter runs) is checked against its merged weight.
z itself is verified, and repaired in place, by a hook on A that runs before B reads it: a fault in A's GEMM would
otherwise be consistent with the concatenated product and go through. Nothing is stored on the modules; the peft
classes are found through ``sys.modules`` (no import of peft here).

Not covered (left unhooked, named in the coverage map): LoRA variants (DoRA and the others in ``lora_variant``),
quantized or other non-Linear base layers, and mixed-adapter batches (``adapter_names=``), whose adapters see
sub-batches.
"""


from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checks.context import LayerContext
from .projection_hook import check_projection

if TYPE_CHECKING:
    from .projection_hook import ContextRef, HookOwner, Splits

__all__ = ["base_linear", "hook_lora", "is_lora", "why_unsupported"]

log = logging.getLogger("attnchecker")


def _lora_linear_cls() -> type | None:
    mod = sys.modules.get("peft.tuners.lora.layer")
    return getattr(mod, "Linear", None) if mod is not None else None


def _is_peft_layer(module: nn.Module) -> bool:
    mod = sys.modules.get("peft.tuners.tuners_utils")
    cls = getattr(mod, "BaseTunerLayer", None) if mod is not None else None
    return cls is not None and isinstance(module, cls)


def _plain_base(base: nn.Module) -> str | None:
    """'out_in' (nn.Linear), 'in_out' (HF Conv1D) or None for anything else (quantized, another wrapper)."""
    if type(base) is nn.Linear:
        return "out_in"
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    if conv1d is not None and type(base) is conv1d:
        return "in_out"
    return None


def why_unsupported(module: nn.Module) -> str | None:
    """Why a PEFT-wrapped projection is not protected (None when it is supported or not a PEFT layer)."""
    if not _is_peft_layer(module):
        return None
    cls = _lora_linear_cls()
    if cls is None or type(module) is not cls:
        return f"peft {type(module).__name__} wrapper (only LoRA Linear is supported)"
    variants = getattr(module, "lora_variant", {}) or {}
    if variants:
        kinds = sorted({type(v).__name__.removesuffix("LinearVariant") for v in variants.values()})
        return f"peft LoRA variant {', '.join(kinds)}"
    if any((getattr(module, "use_dora", {}) or {}).values()):  # peft before the lora_variant registry
        return "peft LoRA variant Dora"
    base: nn.Module = module.get_base_layer()  # type: ignore[operator]  # a peft BaseTunerLayer method
    if _plain_base(base) is None:
        weight = getattr(base, "weight", None)
        quantized = isinstance(weight, torch.Tensor) and not weight.is_floating_point()
        what = "quantized weight" if quantized else "base layer"
        return f"peft LoRA over {what} {type(base).__name__}"
    return None


def is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA Linear this module protects: plain LoRA (no variant) over an nn.Linear or HF Conv1D."""
    return _is_peft_layer(module) and why_unsupported(module) is None


def base_linear(module: nn.Module) -> nn.Module:
    """The projection whose shape and layout a supported LoRA wrapper stands for (its base layer); else ``module``."""
    return module.get_base_layer() if is_lora(module) else module  # type: ignore[no-any-return, operator]


@dataclass(slots=True)
class _Call:
    """One forward of a LoRA layer: its layer context (resolved once per call) and what each adapter's A produced."""

    ctx: LayerContext | None = None
    skip: bool = False
    z: dict[str, torch.Tensor] = field(default_factory=dict)


def hook_lora(
    binder: HookOwner,
    layer: nn.Module,
    ctx: ContextRef,
    *,
    op: str | None,
    splits: Splits | None,
    names: tuple[str, ...],
) -> None:
    """Verify a LoRA layer's output against its effective product, and each adapter's A output before B reads it.
    The base layer's layout (Linear or Conv1D) is read from it at each call."""
    call = _Call()
    handles = [
        layer.register_forward_pre_hook(functools.partial(_pre, binder, call, ctx, names), with_kwargs=True),
        layer.register_forward_hook(functools.partial(_post, binder, call, op, splits, names), with_kwargs=True),
    ]
    # Checked under the projection's first op: A's output (N, T, r) has no q/k/v split of its own.
    a_op = names[0]
    for adapter, lora_a in layer.lora_A.items():  # type: ignore[union-attr, operator]
        handles.append(lora_a.register_forward_hook(functools.partial(_a_hook, call, adapter, a_op)))
    for h in handles:
        binder.on_close(h.remove)


def _pre(
    binder: HookOwner,
    call: _Call,
    ctx_ref: ContextRef,
    names: tuple[str, ...],
    module: nn.Module,  # noqa: ARG001
    args: Any,  # noqa: ARG001
    kwargs: dict[str, Any],
) -> None:
    call.ctx = ctx_ref if isinstance(ctx_ref, LayerContext) else ctx_ref()
    call.z.clear()
    call.skip = kwargs.get("adapter_names") is not None
    if call.skip:
        # Each adapter sees a sub-batch of x: no concatenated product describes the output.
        binder.fallback(call.ctx, "peft LoRA call with adapter_names= (mixed-adapter batch) runs unchecked",
                        ops=",".join(names))


def _due(ctx: LayerContext, names: tuple[str, ...]) -> bool:
    """Whether check_linear would do anything for these ops on this step (check, pass checksums, or inject): if not,
    the concatenated operands are not built."""
    cfg = ctx.config
    if ctx.runtime.injector is not None:
        return True
    if cfg.mode == "off":
        return False
    return any(cfg.checks(n) or (n in ("q", "k", "v") and not cfg.source_repair) for n in names)


def _a_hook(call: _Call, adapter: str, op: str, module: nn.Module, args: tuple[Any, ...], z: torch.Tensor) -> Any:
    if call.ctx is None or call.skip:
        return None
    x_d = args[0]
    weight: torch.Tensor = module.weight  # type: ignore[assignment]  # A is an nn.Linear
    bias: torch.Tensor | None = module.bias  # type: ignore[assignment]
    z = check_projection({}, call.ctx, x_d, z, weight, bias, op=op, splits=None, names=(op,), weight_layout="out_in")
    call.z[adapter] = z
    return z


def _post(
    binder: HookOwner,
    call: _Call,
    op: str | None,
    splits: Splits | None,
    names: tuple[str, ...],
    module: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    y: torch.Tensor,
) -> Any:
    ctx, z, call.ctx = call.ctx, dict(call.z), None
    call.z.clear()
    if ctx is None or call.skip or not _due(ctx, names):
        return None
    x: torch.Tensor = args[0] if args else kwargs.get("x", kwargs.get("input"))  # type: ignore[assignment]
    base = module.get_base_layer()
    layout = _plain_base(base)
    assert layout is not None  # is_lora() held when hooked; a variant added later is refused below
    if getattr(module, "lora_variant", None):
        return None
    weight_OI = base.weight if layout == "out_in" else base.weight.T
    if not z:
        # Merged, disabled, or no active adapter: the base layer alone ran (with the merged weight when merged).
        return check_projection(binder._outputs, ctx, x, y, weight_OI, base.bias, op=op, splits=splits, names=names,
                                weight_layout="out_in")
    # y is base + Σ s·B(z), each term rounded to y's dtype before the sums (peft adds them out of place): for a
    # half-precision y that is up to three roundings of size u·|term| where one GEMM has one. The operands go in
    # wider than y, so the bound carries the operand-rounding term 2u·‖x‖‖w‖ that covers them.
    acc = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
    with torch.no_grad():
        xs, ws = [x.to(acc)], [weight_OI.to(acc)]
        bias = base.bias.to(acc) if base.bias is not None else None
        for adapter, z_a in z.items():
            lora_b = module.lora_B[adapter]
            s = module.scaling[adapter]
            # s folded into z (N, T, r): z·(s Bᵀ) and (z Bᵀ)·s differ only in the last rounding.
            xs.append(z_a.to(acc) * s)
            ws.append(lora_b.weight.to(acc))
            if lora_b.bias is not None:
                # B's bias as one more input column (s against b_B) rather than folded into b: B's output rounds
                # it (and s·(…) rounds again) on its own, and the bound must see |s·b_B|, not |b + s·b_B|.
                xs.append(torch.full((*x.shape[:-1], 1), float(s), dtype=acc, device=x.device))
                ws.append(lora_b.bias.to(acc)[:, None])
        x_cat_NTK = torch.cat(xs, dim=-1)
        w_cat_OK = torch.cat(ws, dim=-1)
    return check_projection(binder._outputs, ctx, x_cat_NTK, y, w_cat_OK, bias, op=op, splits=splits, names=names,
                            weight_layout="out_in", cast_operands=False)
