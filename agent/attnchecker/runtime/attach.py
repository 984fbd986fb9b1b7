"""What protect() attaches to, and the checks made while attaching: the integrations that find a model's attention
(``integrations/``), the parameters' dtype and device, the coverage warning (or strict error), the optimizer under
its wrappers, the fault plan. Everything here runs once, at ``protect()``; nothing at training time."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..coverage import Coverage
from ..errors import UnprotectedAttentionError, UnsupportedDeviceError, UnsupportedDtypeError
from ..integrations._common import Binder

__all__ = [
    "SUPPORTED_DEVICES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_MODELS",
    "attach_integrations",
    "check_coverage",
    "make_injector",
    "require_supported_params",
    "unwrap_optimizer",
]

log = logging.getLogger("attnchecker")

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUPPORTED_DEVICES = ("cpu", "cuda")
SUPPORTED_MODELS = (
    "Hugging Face transformers models whose attention goes through the AttentionInterface "
    "(tested: GPT-2, BERT, RoBERTa, Llama), and GPT-Neo; "
    "torchtitan language models (GQAttention with FlexAttention, varlen or SDPA inner attention); "
    "plain PyTorch modules that call torch.nn.functional.scaled_dot_product_attention (nanoGPT style), "
    "flex_attention or varlen attention; "
    "torch.nn.MultiheadAttention and the nn.Transformer*Layer modules built on it "
    "(see docs/architectures.md)"
)


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    # Wrappers (accelerate's AcceleratedOptimizer, Lightning's) subclass Optimizer without its hook state and forward
    # step() to the optimizer they hold: hook that one.
    while "_optimizer_step_pre_hooks" not in vars(optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    inner: torch.optim.Optimizer = optimizer
    return inner


def make_injector(faults: Any) -> Any:
    if faults is None:
        return None
    from ..inject import FaultPlan, Injector

    if isinstance(faults, Injector):
        return faults
    if not isinstance(faults, FaultPlan):
        raise TypeError(f"faults must be an attnchecker.FaultPlan (or Injector), got {type(faults).__name__}")
    return Injector(faults)


def attach_integrations(binder: Binder, model: nn.Module) -> None:
    from ..integrations import sdpa, torch_mha, torchtitan
    from ..integrations import transformers as hf

    # transformers models anywhere in the tree (the model itself, or inside DDP, a LightningModule, a wrapper).
    attached: set[nn.Module] = set()
    for prefix, root in hf.transformers_roots(model):
        hf.attach(binder, root, prefix=prefix)
        attached.update(root.modules())
    # torchtitan's attention modules, by class.
    attached |= torchtitan.attach(binder, model)
    sdpa.attach(binder, model, exclude=attached)
    torch_mha.attach(binder, model)


def check_coverage(coverage: Coverage, *, strict: bool) -> None:
    """Never silent: one warning listing every op left unprotected (or, strict, an error instead)."""
    gaps = coverage.gaps()
    if not gaps:
        return
    listing = "; ".join(gaps)
    if strict:
        raise UnprotectedAttentionError(
            f"{len(coverage.unprotected)} attention op(s) would run unprotected: {listing}. "
            "Leave out strict=True to train with them unprotected (Guard.coverage lists them)."
        )
    log.warning("attnchecker: %d attention op(s) left unprotected (Guard.coverage): %s",
                len(coverage.unprotected), listing)


def _iter_site_params(binder: Binder) -> Iterator[tuple[str, torch.Tensor]]:
    names = {site.layer: site.name for site in binder.sites}
    for module, ctx in binder.contexts.items():
        for pname, p in module.named_parameters():
            yield f"{names.get(ctx.layer, '?')}.{pname}".lstrip("."), p


def require_supported_params(model: nn.Module, binder: Binder) -> None:
    params = list(_iter_site_params(binder)) or [(n, p) for n, p in model.named_parameters()]
    for name, p in params:
        if p.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedDtypeError(
                f"attnchecker supports float32, bfloat16 and float16 attention; parameter {name!r} is {p.dtype}. "
                "Cast the model (e.g. model.float()) before protect(), or use autocast for mixed precision."
            )
        if p.device.type not in SUPPORTED_DEVICES:
            raise UnsupportedDeviceError(
                f"attnchecker runs on {', '.join(SUPPORTED_DEVICES)}; parameter {name!r} is on {p.device}. "
                "Move the model to a supported device before protect()."
            )
