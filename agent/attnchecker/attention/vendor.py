"""The fused attention an unprotected model runs (FlashAttention, memory-efficient attention, the CPU flash kernel),
called through its aten ops: the forward for what ``F.scaled_dot_product_attention`` drops, the row log-sum-exp, and
the backward at the forward's own saved results, as autograd would call it.

Tier 1 on the Triton path (backends/triton.py) reads that output and log-sum-exp once in a Triton pass
(kernels/triton_attention.forward(given=...)) and recomputes only a tripped block in its own kernel, in place. Tier 1
has no checksums to fold into the products, so it need not run them in our kernel, which is slower than the vendor's
(docs/performance.md §8). Its test reads only the output and the log-sum-exp, in either form, so a step catches the
same faults: NaN, INF and values past 1e10 in the output, a score past the log-sum-exp's bound.

The backward (``Forward.backward``) is the vendor's backward op at q, k, v and the forward's output and log-sum-exp,
as repaired: what the op's own derivative runs, without the forward SDPA recomputes when it differentiates again
(attention/backward/fused._sdpa_backward). A repaired block was written into those very tensors, so the backward
sees the repaired values.

Which op, per device and dtype:
- CUDA, fp16/bf16, where PyTorch's FlashAttention takes the inputs: ``aten._scaled_dot_product_flash_attention`` and
  its backward (given the forward's other results: sequence offsets, lengths, the philox state);
- CUDA otherwise (fp32), where memory-efficient attention does: ``aten._scaled_dot_product_efficient_attention``,
  whose log-sum-exp is padded along T; its backward is left to SDPA (``Forward.backward`` None);
- CPU (Triton's interpreter, tests): ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward.

Only calls without a mask, dropout or window, and causal ones only with as many keys as queries (the vendors' causal
masks align differently when T != S). Grouped key/value heads (GQA) go in as they are where the op takes them (the
CPU kernel; FlashAttention where PyTorch's check with ``enable_gqa`` says so), and the backward returns dK and dV on
those heads; memory-efficient attention gets them expanded (a copy of K and V). If an op fails at run time for a
reason other than memory (a build without it), this process stops calling it and says so once: the Triton kernel's
own tier 1 takes every later call.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..abft.given_backward import CPU_FLASH, FP32_ACCUMULATION, GradientAccumulation
from .backward.fused import _expand_heads, sum_groups

__all__ = ["Forward", "forward", "not_supported_reasons"]

log = logging.getLogger("attnchecker")

_broken: list[str] = []
"""Set once an op failed at run time: why (the vendor path is off for the process)."""

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Forward:
    out_BHTD: torch.Tensor
    """In the op's own layout (FlashAttention's is (B, T, H, D) in memory)."""
    lse_BHT: torch.Tensor
    """fp32, contiguous (the CPU kernel's and memory-efficient attention's made so: a copy)."""
    backward: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Grads] | None
    """backward(grad_out, q, k, v) -> (dq, dk, dv), k, v and their gradients on k's own heads: the vendor's backward
    at this forward's out_BHTD and lse_BHT. None where only SDPA's recompute differentiates it."""
    accumulation: GradientAccumulation | None = None
    """How that backward rounds its gradient sums (abft/given_backward.py), for the full check over its gradients:
    the CPU kernel per block of queries and keys; FlashAttention in fp32 to the end."""


def not_supported_reasons(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *,
                          attn_mask: torch.Tensor | None, is_causal: bool, dropout_p: float) -> list[str]:
    """Why ``forward`` cannot run this call ([] if it can). No sync."""
    reasons = list(_broken)
    if attn_mask is not None:
        reasons.append("a mask (the vendor's ops with a log-sum-exp take none here)")
    if dropout_p > 0.0:
        reasons.append("attention dropout (the vendor draws its own keep mask, which our recompute cannot)")
    if is_causal and q_BHTD.shape[-2] != k_BHSD.shape[-2]:
        reasons.append("is_causal with T != S (SDPA aligns the mask top-left; the vendors' kernels differ)")
    if q_BHTD.device.type not in ("cuda", "cpu"):
        reasons.append(f"tensors on {q_BHTD.device.type}")
    elif q_BHTD.device.type == "cuda" and not reasons and _cuda_op(q_BHTD, k_BHSD, v_BHSD, is_causal) is None:
        reasons.append("neither FlashAttention nor memory-efficient attention takes these inputs on this device")
    return reasons


def forward(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *, is_causal: bool, scale: float
            ) -> Forward | None:
    """softmax(scale·QKᵀ)·V and its row log-sum-exp by the vendor's op, or None where the op failed (then never
    again: module doc). Call under no_grad; ``not_supported_reasons`` first. No sync."""
    k, v = k_BHSD, v_BHSD
    try:
        if q_BHTD.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q_BHTD, k, v, 0.0, is_causal, scale=scale)
            lse = lse.contiguous()
            return Forward(out, lse, _cpu_backward(out, lse, is_causal=is_causal, scale=scale),
                           CPU_FLASH(q_BHTD.shape[-2]))
        op = _cuda_op(q_BHTD, k, v, is_causal)
        if op == "flash_expanded" or op == "efficient":
            k, v = _expand_heads(k, q_BHTD.shape[1]), _expand_heads(v, q_BHTD.shape[1])
        if op in ("flash", "flash_expanded"):
            got = torch.ops.aten._scaled_dot_product_flash_attention(q_BHTD, k, v, 0.0, is_causal, False,
                                                                     scale=scale)
            out, lse = got[0], got[1].contiguous()
            return Forward(out, lse, _flash_backward(out, lse, tuple(got[2:8]), is_causal=is_causal, scale=scale,
                                                     expand=op == "flash_expanded"), FP32_ACCUMULATION)
        got = torch.ops.aten._scaled_dot_product_efficient_attention(q_BHTD, k, v, None, True, 0.0, is_causal,
                                                                     scale=scale)
        # Padded along T to the kernel's alignment: the first T are the rows'.
        return Forward(got[0], got[1][..., : q_BHTD.shape[-2]].contiguous(), None)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        _broken.append(f"the vendor's attention op failed here once ({exc.__class__.__name__}: {str(exc)[:200]})")
        log.warning("attnchecker: tier 1 calls the fused attention op for its log-sum-exp and it failed (%s); "
                    "the Triton kernel's own tier 1 runs from now on", exc)
        return None


def _cpu_backward(out: torch.Tensor, lse: torch.Tensor, *, is_causal: bool, scale: float
                  ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Grads]:
    def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Grads:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q, k, v, out, lse, 0.0, is_causal, scale=scale)
        return dq, dk, dv

    return backward


def _flash_backward(out: torch.Tensor, lse: torch.Tensor, rest: tuple[object, ...], *, is_causal: bool,
                    scale: float, expand: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                                                            Grads]:
    """rest: the forward's (cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset), what the op's derivative
    hands its backward (None offsets for a dense batch; a seed and offset unused without dropout). expand: the
    forward took grouped heads expanded; so does the backward, whose dK and dV are then summed back."""
    cum_q, cum_k, max_q, max_k, seed, offset = rest

    def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Grads:
        heads, kv_heads = q.shape[1], k.shape[1]
        dout = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
        if expand:
            k, v = _expand_heads(k, heads), _expand_heads(v, heads)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=scale)
        return dq, sum_groups(dk, kv_heads), sum_groups(dv, kv_heads)

    return backward


def _cuda_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    """"flash" (grouped heads as they are), "flash_expanded" (grouped heads, which this build's FlashAttention takes
    only expanded), "efficient" (heads expanded) or None: what PyTorch's own checks say takes these inputs
    (SDPAParams' fields moved between releases: where the constructor does not take ours, the dtype decides, with
    grouped heads expanded, and a failure at run time turns the path off, ``forward``). Remembered per kind of call
    (what those checks read but the lengths), since a launch-bound step pays every microsecond of host time per
    call."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], is_causal, q.shape[-2] == k.shape[-2],
           tuple(x.stride(-1) == 1 for x in (q, k, v)), any(x.requires_grad for x in (q, k, v)))
    if key not in _ops:
        _ops[key] = _cuda_op_uncached(q, k, v, is_causal)
    return _ops[key]


_ops: dict[tuple[object, ...], str | None] = {}


def _cuda_op_uncached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> str | None:
    from torch.backends import cuda as sdpa

    grouped = k.shape[1] != q.shape[1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    try:
        params = sdpa.SDPAParams(q, k, v, None, 0.0, is_causal, grouped)
        if grouped:
            heads = q.shape[1]
            expanded = sdpa.SDPAParams(q, _expand_heads(k, heads), _expand_heads(v, heads), None, 0.0, is_causal,
                                       False)
    except TypeError:
        return ("flash_expanded" if grouped else "flash") if half else "efficient"
    if half and sdpa.can_use_flash_attention(params, False):
        return "flash"
    if half and grouped and sdpa.can_use_flash_attention(expanded, False):
        return "flash_expanded"
    if sdpa.can_use_efficient_attention(expanded if grouped else params, False):
        return "efficient"
    return None
