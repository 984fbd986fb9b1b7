"""Tier 1: the extreme-value tripwire every op gets on the steps its full ABFT check is not due (docs/abft.md).

Pure tensor tests, no state: the engine (attention.py) decides what to do on a trip (recover through the full check).

- An op output X trips when Σ X, accumulated in fp32, is not finite or exceeds ``NEAR_INF`` in magnitude. One read of
  X, and the cheapest reduction there is (a plain sum vectorises better than max |x|, which on CPU costs 4x). INF and
  NaN always propagate into the sum; one near-INF element e dominates it: |Σ X| ≥ |e| - |Σ clean|, and the clean
  sum of real activations is many orders below 1e10.
- Where the host decides at once (every eager CPU call: a CPU tensor's value needs no device sync), ``tripped`` and
  ``extreme_each`` read each sum as a Python float and compare it there. The tensor form's stack, abs, compare, all
  and not are five more dispatches per output: one thread, about 30 µs a call against 1.5 µs for the sum of a small
  output, which over the ~117 outputs of a GPT-2 step under protect(scope="all") was a quarter of tier 1's time.
  The decision is the same: the same fp32 sum against the same bound (1e10 is exact in fp32).
- The fused attention kernel never writes AS; its row log-sum-exp does leave it. For every row, with scale > 0,
  lse_t = log Σ_s exp(scale·q_t·k_s + m_ts) ≤ scale·‖q_t‖·max_s‖k_s‖ + max(m) + log S (Cauchy-Schwarz), so a score
  that is near-INF (or INF, NaN) pushes lse_t past that bound, while INF/NaN from the softmax or PV show in the output
  itself. Rows with every key masked have lse 0 in the CPU kernel and stay under the bound. A corrupted lse (NaN, +INF,
  -INF, a huge value) trips the same test.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["NEAR_INF", "extreme", "extreme_each", "extreme_value", "lse_over_bound", "tripped"]

NEAR_INF = 1e10
"""The paper's near-INF class: |x| > 1e10."""


def _sum32(x: torch.Tensor) -> torch.Tensor:
    # fp16 sums of clean activations can overflow fp16's 65504; bf16 and fp32 share fp32's range.
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum().float()


def extreme(*xs: torch.Tensor) -> torch.Tensor:
    """() bool on the device: some x holds an INF, NaN or near-INF value (as far as its sum shows; see module doc).
    No sync."""
    sums = torch.stack([_sum32(x.detach()) for x in xs])
    return ~(sums.abs() <= NEAR_INF).all()  # NaN compares False: it trips


def _host(xs: Sequence[torch.Tensor]) -> bool:
    return all(x.device.type == "cpu" for x in xs)


def _trips_now(x: torch.Tensor) -> bool:
    """extreme(x) read on the host; CPU tensors only (no sync)."""
    return not abs(float(_sum32(x.detach()))) <= NEAR_INF  # NaN compares False: it trips


def extreme_each(xs: Sequence[torch.Tensor]) -> list[bool]:
    """extreme(x) for each x, as host bools: on CPU a sum and a scalar read each; on a device one sync for all."""
    if _host(xs):
        return [_trips_now(x) for x in xs]
    return torch.stack([extreme(x) for x in xs]).tolist()  # sync: one for all


def tripped(flags: Sequence[torch.Tensor], *outputs: torch.Tensor) -> bool:
    """The host's decision after a tier-1 test: some () bool flag is set (e.g. lse_over_bound) or some output trips
    (extreme). CPU outputs without flags are read one by one; otherwise one stack and one read: one sync on a device,
    and with flags on CPU still one scalar read per call (the lse bound's own ops cost more than a host reading
    would save)."""
    if not flags and _host(outputs):
        return any(_trips_now(x) for x in outputs)
    return bool(torch.stack([*flags, *(extreme(x) for x in outputs)]).any())  # sync: one for all


def lse_over_bound(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    lse_BHT: torch.Tensor,
    *,
    scale: float,
    mask_max: float = 0.0,
) -> torch.Tensor:
    """() bool: some row's log-sum-exp exceeds what q and k allow (a huge score inside a fused kernel), or is NaN.
    mask_max: the largest additive mask value (0 for none, boolean or causal masks). Reads q and k once. No sync."""
    acc = torch.float32
    q_norm_BHT = torch.linalg.vector_norm(q_BHTD.detach().to(acc), dim=-1)
    k_max_BH1 = torch.linalg.vector_norm(k_BHSD.detach().to(acc), dim=-1).amax(-1, keepdim=True)
    n_keys = k_BHSD.shape[-2]
    # 1 % and +1 cover the kernel's own rounding of q·k and of the exp-sum; a near-INF score is >= 1e10·scale.
    bound_BHT = abs(scale) * q_norm_BHT * k_max_BH1 * 1.01 + max(mask_max, 0.0) + math.log(max(n_keys, 1)) + 1.0
    lse = lse_BHT.detach().float()
    # -INF trips too: the CPU kernel returns 0 for a row with every key masked, never -INF.
    return ~((lse <= bound_BHT) & (lse > -math.inf)).all()


def extreme_value(x: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Slow path (after a trip): the most extreme element of x and its index, NaN first, then the largest |x|."""
    flat = x.detach().reshape(-1).float()
    nan = torch.isnan(flat)
    pos = int(nan.nonzero()[0, 0]) if bool(nan.any()) else int(flat.abs().argmax())  # sync: slow path only
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), x.shape))
    return float(flat[pos]), idx
