"""``attnchecker::attention``: the protected attention call (``attention.pipeline.protected_sdpa``) as one opaque op
in a compiled graph, and ``attnchecker::attention_backward``, its backward (the engine's checked backward, replayed by
``opaque.backward``). The op's body decides at run time what the step checks (tier 1, full, nothing), as the eager call
does: the graph is the same on every step of the schedule.

Legend: B batch, H query heads, Hk key/value heads, T query tokens, S key tokens, D head dim."""
from __future__ import annotations

from typing import Any

import torch

from ..attention.pipeline import protected_sdpa
from ..checks.context import LayerContext
from . import opaque, registry

__all__ = ["attention"]


@torch.library.custom_op("attnchecker::attention", mutates_args=())
def _attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, attn_mask: torch.Tensor | None,
               ctx_key: int, is_causal: bool, scale: float | None, dropout_p: float, enable_gqa: bool,
               use_passed: bool, grads: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = registry.context(ctx_key)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = protected_sdpa(q, k, v, ctx=ctx, attn_mask=mask, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, use_passed=use_passed)
        assert isinstance(out, torch.Tensor)  # no return_probs
        return out

    device_type = q_BHTD.device.type
    with torch.autocast(device_type, enabled=False):
        (out_BHTD,), handle = opaque.record(run, (q_BHTD, k_BHSD, v_BHSD, attn_mask), grads, owner=id(ctx.runtime))
    return out_BHTD, handle


@_attention.register_fake
def _(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, attn_mask: torch.Tensor | None,
      ctx_key: int, is_causal: bool, scale: float | None, dropout_p: float, enable_gqa: bool, use_passed: bool,
      grads: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    out_BHTD = q_BHTD.new_empty((*q_BHTD.shape[:-1], v_BHSD.shape[-1]))
    return out_BHTD, opaque.fake_handle()


@torch.library.custom_op("attnchecker::attention_backward", mutates_args=())
def _attention_backward(handle: torch.Tensor, grad_BHTD: torch.Tensor, q_BHTD: torch.Tensor, k_BHSD: torch.Tensor,
                        v_BHSD: torch.Tensor, attn_mask: torch.Tensor | None, grads: list[bool]
                        ) -> list[torch.Tensor]:
    return opaque.backward(handle, [grad_BHTD])


@_attention_backward.register_fake
def _(handle: torch.Tensor, grad_BHTD: torch.Tensor, q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
      attn_mask: torch.Tensor | None, grads: list[bool]) -> list[torch.Tensor]:
    return opaque.fake_grads((q_BHTD, k_BHSD, v_BHSD, attn_mask), grads)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, mask = inputs[:4]
    ctx.grads = inputs[-1]
    # q/k/v (and the mask) only for their shapes in the fake backward: the kept graph holds the same storage.
    ctx.save_for_backward(output[1], q, k, v, mask)


def _backward(ctx: Any, grad_BHTD: torch.Tensor, _grad_handle: Any) -> tuple[torch.Tensor | None, ...]:
    handle, q, k, v, mask = ctx.saved_tensors
    got = iter(_attention_backward(handle, grad_BHTD, q, k, v, mask, ctx.grads))
    tensors = (q, k, v, mask)
    inputs = [next(got) if t is not None and g and t.is_floating_point() else None
              for t, g in zip(tensors, ctx.grads, strict=True)]
    return (*inputs, None, None, None, None, None, None, None)


_attention.register_autograd(_backward, setup_context=_setup)


def attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *, ctx: LayerContext,
              attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
              dropout_p: float = 0.0, enable_gqa: bool = False, use_passed: bool = True) -> torch.Tensor:
    """``protected_sdpa`` (no ``return_probs``) as ``attnchecker::attention``; autocast applied as ``engine_call``
    applies it (operands cast to its dtype here, in the graph). q (B, H, T, D), k/v (B, Hk, S, D) -> (B, H, T, Dv)."""
    tensors: tuple[torch.Tensor | None, ...] = (q_BHTD, k_BHSD, v_BHSD, attn_mask)
    device_type = q_BHTD.device.type
    if torch.is_autocast_enabled(device_type):
        # Float masks too, as autocast casts SDPA's (engine_call).
        dtype = torch.get_autocast_dtype(device_type)
        tensors = tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)
    grad_on = torch.is_grad_enabled()
    grads = [grad_on and t is not None and t.requires_grad for t in tensors]
    q, k, v, mask = tensors
    assert q is not None and k is not None and v is not None
    out_BHTD, _ = _attention(q, k, v, mask, ctx.op_key, is_causal, scale, float(dropout_p), enable_gqa, use_passed,
                             grads)
    return out_BHTD
