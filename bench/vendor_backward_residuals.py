"""How far a vendor's fused attention backward is from the identities a check over its gradients would test
(abft/given_backward.py), measured in fp64: whether their bounds hold and what they catch at the shapes models use,
before such a check is built (issue 32).

Per configuration (dtype × T × D × causal × inputs, the forward's vendor_residuals.py inputs: Gaussian, scores four
times larger, values with a mean of 1; dO Gaussian) the vendor runs the forward and the backward through its aten
ops, and per sampled key (identities V and K) and query (Q) of two heads:

- ``{v,k,q}_ratio``: each clean row's residual over its bound (the larger of c = e and c = w), which must stay under
  1 on every vendor;
- ``{v,k,q}_catches_rms``: the c = e bound in units of the row's gradient RMS: the smallest single wrong element it
  flags (over the rows whose gradient is not 0);
- ``{v,k,q}_ratio_one_rounding`` (the CPU flash kernel, which rounds its running sums once per block of queries or
  keys): the same ratios under a bound that assumes one rounding, as FlashAttention's does.

    python bench/vendor_backward_residuals.py [--dry-run] [--seqs 2048,8192] [--inputs randn,peaky,v_mean]
                                              [--out docs/perf/vendor_backward_residuals.json]

On a machine without a GPU it measures the CPU's flash kernel (a few minutes at T = 2048 and 8192); on a GPU,
FlashAttention and memory-efficient attention where this build has them. ``--dry-run``: T = 96, head dims 16 and 32.
Deterministic for a device and build; nothing here is a time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()
import torch
from vendor_residuals import INPUTS, _pcts, sweep

from attnchecker.abft import Tolerance
from attnchecker.abft.given_backward import (
    CPU_FLASH,
    FP32_ACCUMULATION,
    GradientAccumulation,
    backward_identity_residuals,
    given_backward_rule,
)


def vendor_backward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, *,
                    is_causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """(out, lse, dq, dk, dv) of one vendor kernel's forward and backward through its aten ops."""
    aten = torch.ops.aten
    t = q.shape[-2]
    if backend == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, is_causal,
                                                                                scale=scale)
    elif backend == "flash":
        got = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset = got[:8]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(do, q, k, v, out, lse, cum_q, cum_k, max_q,
                                                                       max_k, 0.0, is_causal, seed, offset,
                                                                       scale=scale)
    elif backend == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                              scale=scale)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(do, q, k, v, None, out, lse, seed,
                                                                              offset, 0.0, [True, True, True, False],
                                                                              is_causal, scale=scale)
        lse = lse[..., :t]
    else:
        raise ValueError(f"unknown backend {backend!r}: cpu_flash, flash or efficient")
    return out, lse.float(), dq, dk, dv


def accumulation_for(backend: str, t: int) -> GradientAccumulation:
    """How the vendor rounds its gradient sums (abft/given_backward.py): the CPU flash kernel per block of queries or
    keys; FlashAttention and memory-efficient attention in fp32 to the end, which their rows here test."""
    return CPU_FLASH(t) if backend == "cpu_flash" else FP32_ACCUMULATION


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, got: tuple[torch.Tensor, ...], *,
            is_causal: bool, scale: float, rows: torch.Tensor, heads: tuple[int, ...],
            accumulation: GradientAccumulation) -> dict[str, Any]:
    """Percentiles over the sampled rows (as queries for Q, as keys for V and K) of ``heads`` of batch 0; where the
    vendor rounds its sums more than once, also ``{v,k,q}_ratio_one_rounding``: the ratios under a bound that
    assumes it rounds once (what the block roundings cost)."""
    out, lse, dq, dk, dv = got
    hs = list(heads)

    def pick(x: torch.Tensor) -> torch.Tensor:
        return x[:1, hs]

    def residuals(acc: GradientAccumulation) -> dict[str, torch.Tensor]:
        return backward_identity_residuals(pick(q), pick(k), pick(v), pick(out), pick(lse), pick(do), pick(dq),
                                           pick(dk), pick(dv), scale=scale, is_causal=is_causal,
                                           rule=given_backward_rule(q.dtype, Tolerance()), accumulation=acc,
                                           rows=rows, keys=rows)

    r = residuals(accumulation)
    found: dict[str, Any] = {}
    for name, grad in (("v", dv), ("k", dk), ("q", dq)):
        ratio = (r[f"d_{name}"].abs() / r[f"b_{name}"]).amax(-1)
        rms = pick(grad)[:, :, rows].double().square().mean(-1).sqrt()
        found[f"{name}_ratio"] = _pcts(ratio)
        # A row whose gradient is 0 (a causal first query's dQ: its one probability is 1, so dS = 0) has no RMS.
        found[f"{name}_catches_rms"] = _pcts((r[f"b_{name}"][..., 0] / rms)[rms > 0])
        found[f"{name}_flagged"] = int(r[f"flag_{name}"].sum())
    if accumulation != FP32_ACCUMULATION:
        once = residuals(FP32_ACCUMULATION)
        for name in "vkq":
            found[f"{name}_ratio_one_rounding"] = _pcts((once[f"d_{name}"].abs() / once[f"b_{name}"]).amax(-1))
    return found


def backends_for(device: str) -> list[str]:
    return ["cpu_flash"] if device == "cpu" else ["flash", "efficient"]


def run(*, device: str, dry_run: bool, deadline: float | None = None, seqs: tuple[int, ...] | None = None,
        kinds: tuple[str, ...] = INPUTS) -> dict[str, Any]:
    """Every configuration (vendor_residuals.sweep), 128 keys and queries sampled of each, dO Gaussian; seqs: the
    sequence lengths in place of the default ones."""

    def one(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
            **at: Any) -> dict[str, Any]:
        t, d = q.shape[-2:]
        do = torch.randn(q.shape, generator=torch.Generator().manual_seed(t + d + 1)).to(device=q.device,
                                                                                        dtype=q.dtype)
        got = vendor_backward(backend, q, k, v, do, is_causal=is_causal, scale=scale)
        return measure(q, k, v, do, got, is_causal=is_causal, scale=scale,
                       accumulation=accumulation_for(backend, q.shape[-2]), **at)

    return {"rows": sweep(device, dry_run, one, n_rows=128, deadline=deadline, seqs=seqs, kinds=kinds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the CPU's flash kernel at tiny sizes")
    ap.add_argument("--seqs", default=None, help="comma-separated sequence lengths (default 2048,8192)")
    ap.add_argument("--inputs", default=",".join(INPUTS), help=f"comma-separated subset of {','.join(INPUTS)}")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kinds = tuple(args.inputs.split(","))
    if not set(kinds) <= set(INPUTS):
        ap.error(f"--inputs {args.inputs!r}: choose among {', '.join(INPUTS)}")
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    got = run(device=device, dry_run=args.dry_run, seqs=tuple(int(x) for x in args.seqs.split(",")) if args.seqs
              else None, kinds=kinds)
    ok = [r for r in got["rows"] if "v_ratio" in r]
    lines = [[r["backend"], r["dtype"], r["t"], r["d"], r["causal"], r["inputs"],
              *(r[f"{n}_ratio"]["p100"] for n in "vkq"), *(r[f"{n}_catches_rms"]["p50"] for n in "vkq"),
              sum(r[f"{n}_flagged"] for n in "vkq"),
              max((r[f"{n}_ratio_one_rounding"]["p100"] for n in "vkq" if f"{n}_ratio_one_rounding" in r),
                  default="-")] for r in ok]
    print(_common.table(lines, ["backend", "dtype", "T", "D", "causal", "inputs", "V max", "K max", "Q max",
                                "V catches p50", "K catches p50", "Q catches p50", "clean rows flagged",
                                "max if rounded once"]))
    for r in got["rows"]:
        if "error" in r:
            print(f"{r['backend']} {r['dtype']} T={r['t']} D={r['d']}: {r['error']}")
    got["worst"] = {f"{n}_ratio": max((r[f"{n}_ratio"]["p100"] for r in ok), default=None) for n in "vkq"}
    path = _common.write_result("vendor_backward_residuals", got, args.out)
    print(f"\nworst over every row: {got['worst']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
