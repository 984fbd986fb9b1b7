"""How far a vendor's fused attention forward is from the identities a full check over its output would test,
measured in fp64: the data a calibrated bound for such a check needs (issue 32).

A full check that took the vendor's output O and row log-sum-exp (as tier 1 does now) instead of running our own
checked kernel would recompute P = exp(scale·QKᵀ − lse) tile by tile and test per query row i

    A: Σ_j P_ij = 1                       B: O_i·c = Σ_j P_ij (v_j·c)      for c = ones and c = (1..D)/D.

Its bound must hold for every clean row of every vendor kernel, and it decides what the check can catch. The sources
of a clean residual in B: the kernel rounds P to the inputs' dtype before P·V (relative unit roundoff u each), its
output is rounded to that dtype, its scores and sums are fp32. Per sampled row this tool computes, exactly in fp64
from the kernel's own inputs, O and lse:

- ``rA`` = |Σ_j P_ij − 1|, against fp32's roundings as a random walk, 2⁻²⁴·(√S + √D·σ), and in the worst case,
  2⁻²⁴·(S + D·σ): the exp-sum over the S keys a row sees, and its scores' dot products over D, σ = scale·‖q_i‖·
  max_j ‖k_j‖ being the largest score they allow; and against u·σ, scores rounded once to the inputs' dtype (a
  kernel that scales q in that dtype before QKᵀ);
- ``rB`` = |O_i·c − Σ_j P_ij (v_j·c)| against the P rounding's coefficients: ``w1`` = Σ_j P_ij |v_j·c| (the rounding
  errors all of one sign: the rigorous form), ``w2`` = √(Σ_j P_ij² (v_j·c)²) (independent roundings: a random walk,
  one standard deviation), and the output's rounding ``w3`` = Σ_d |O_id c_d| (all of one sign) or
  ``w3_walk`` = √(Σ_d O_id² c_d²) (a walk over D too: form "walks");
- what each form could catch: its bound in units of the row's output RMS, the smallest single output element error
  (c = ones) it flags.

``given_a_ratio`` and ``given_b_ratio``: each clean row's residual over its bound in the check as built
(abft/given_forward.py, with B normalised), which must stay under 1 on every vendor, and ``given_catches_rms`` what
its B catches. ``rB / (u·(w2 + w3))`` and ``rB / (u·(w2 + w3_walk))`` over every clean row are the constants a
random-walk bound needs; the sensitivity columns say what that buys over the rigorous form, whose reach falls as a
row sees more keys (docs/performance.md §11). Inputs: Gaussian q, k, v ("randn"), scores four times larger
("peaky"), values with a mean of 1 (``v_mean``: the P roundings then add up along the values' common sign). On a GPU:
FlashAttention, memory-efficient attention and cuDNN, where this PyTorch build has them; on the CPU its flash kernel.

    python bench/vendor_residuals.py [--dry-run] [--out docs/perf/vendor_residuals.json]

On a machine without a GPU it measures the CPU's flash kernel at the same shapes (a minute or two); ``--dry-run``
takes T = 96 and head dims 16 and 32 (seconds).

Deterministic for a device and build; nothing here is a time. gpu_suite.py runs it as its ``vendor_residuals``
section.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()
import torch

from attnchecker.abft import Tolerance
from attnchecker.abft.given_forward import given_rule, identity_residuals

UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}
"""Unit roundoff of round-to-nearest in each dtype (half an ulp of 1)."""
U32 = 2.0 ** -24
INPUTS = ("randn", "peaky", "v_mean")
PERCENTILES = (50, 99, 100)


def inputs(kind: str, b: int, h: int, t: int, d: int, dtype: torch.dtype, device: str, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, T, D) in ``dtype``: Gaussian; ``peaky``: q and k doubled (scores x 4); ``v_mean``: v + 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    if kind == "peaky":
        q, k = 2 * q, 2 * k
    elif kind == "v_mean":
        v = v + 1.0
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))  # type: ignore[return-value]


def vendor_forward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, T, D), lse (B, H, T) fp32) of one vendor kernel through its aten op."""
    aten = torch.ops.aten
    t = q.shape[-2]
    if backend == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    elif backend == "flash":
        got = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        out, lse = got[0], got[1]
    elif backend == "efficient":
        got = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
        out, lse = got[0], got[1][..., :t]  # padded along T to the kernel's alignment
    elif backend == "cudnn":
        got = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        out, lse = got[0], got[1].reshape(q.shape[:-1])
    else:
        raise ValueError(f"unknown backend {backend!r}: cpu_flash, flash, efficient or cudnn")
    return out, lse.float()


def _pcts(x: torch.Tensor) -> dict[str, float]:
    x = x.double().flatten()
    return {f"p{p}": float(torch.quantile(x, p / 100.0)) if p < 100 else float(x.max()) for p in PERCENTILES}


def measure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
            is_causal: bool, scale: float, rows: torch.Tensor, heads: tuple[int, ...]) -> dict[str, Any]:
    """The residuals and bound terms of ``rows`` (query indices) in ``heads`` of batch 0, in fp64 on the inputs'
    device: percentiles over the rows, per identity and form (module doc). u: the unit roundoff of v's dtype."""
    u = UNIT[v.dtype]
    d = q.shape[-1]
    ramp = torch.arange(1, d + 1, dtype=torch.float64, device=q.device) / d
    cols = {"ones": torch.ones(d, dtype=torch.float64, device=q.device), "ramp": ramp}
    got: dict[str, list[torch.Tensor]] = {}

    def add(name: str, x: torch.Tensor) -> None:
        got.setdefault(name, []).append(x)

    for h in heads:
        q_RD = q[0, h, rows].double()
        k_SD, v_SD = k[0, h].double(), v[0, h].double()
        s_RS = scale * (q_RD @ k_SD.T)
        if is_causal:
            keys = torch.arange(k_SD.shape[0], device=q.device)
            s_RS = s_RS.masked_fill(keys[None, :] > rows[:, None], -math.inf)
        p_RS = torch.exp(s_RS - lse[0, h, rows].double()[:, None])
        seen_R = torch.isfinite(s_RS).sum(-1).double()
        # sigma: the largest |score| a row's keys allow, scale·‖q_i‖·max_j ‖k_j‖: a score's own rounding scales with it.
        sigma_R = scale * q_RD.norm(dim=-1) * torch.where(torch.isfinite(s_RS), 1.0, 0.0).mul(
            k_SD.norm(dim=-1)[None, :]).amax(-1)
        r_a = (p_RS.sum(-1) - 1.0).abs()
        add("rA", r_a)
        add("rA_over_walk", r_a / (U32 * (seen_R.sqrt() + math.sqrt(d) * sigma_R)))
        add("rA_over_worst", r_a / (U32 * (seen_R + d * sigma_R)))
        add("rA_over_input_scores", r_a / (u * sigma_R))
        o_RD = out[0, h, rows].double()
        rms_R = o_RD.pow(2).mean(-1).sqrt()
        for name, c in cols.items():
            vc_S = v_SD @ c
            r_b = (o_RD @ c - p_RS @ vc_S).abs()
            w1 = p_RS @ vc_S.abs()
            w2 = (p_RS.pow(2) @ vc_S.pow(2)).sqrt()
            w3 = o_RD.abs() @ c.abs()
            w3_walk = (o_RD.pow(2) @ c.pow(2)).sqrt()
            add(f"rB_{name}_over_worst", r_b / (u * (w1 + w3)))
            add(f"rB_{name}_over_walk", r_b / (u * (w2 + w3)))
            add(f"rB_{name}_over_walks", r_b / (u * (w2 + w3_walk)))
            add(f"rB_{name}_over_output", r_b / (u * w3))
            if name == "ones":
                # The smallest error in one output element that moves O_i·1 past each form's bound, in RMS units.
                add("catches_worst_rms", u * (w1 + w3) / rms_R)
                add("catches_walk_rms", u * (w2 + w3) / rms_R)
                add("catches_walks_rms", u * (w2 + w3_walk) / rms_R)
    # The check as built (abft/given_forward.py, the constants a protected step runs): each clean row's residual over
    # its bound, A and B (the worse of c = e, w), and what B catches in one output element, in RMS units.
    hs = list(heads)
    built = identity_residuals(q[:1, hs], k[:1, hs], v[:1, hs], out[:1, hs], lse[:1, hs], scale=scale,
                               is_causal=is_causal, rule=given_rule(v.dtype, Tolerance()), rows=rows)
    add("given_a_ratio", (built["r_a"] / built["b_a"]).flatten())
    add("given_b_ratio", (built["d_c"].abs() / built["b_c"]).amax(-1).flatten())
    rms_HR = out[0, hs][:, rows].double().pow(2).mean(-1).sqrt()
    add("given_catches_rms", (built["b_c"][0, :, :, 0] / built["a"][0] / rms_HR).flatten())
    return {name: _pcts(torch.cat(xs)) for name, xs in got.items()}


def sample_rows(t: int, n: int, seed: int, device: str) -> torch.Tensor:
    """n query rows: the first and last 8 (a causal row sees 1 to T keys) and the rest drawn at random."""
    ends = torch.cat([torch.arange(min(8, t)), torch.arange(max(t - 8, 0), t)])
    drawn = torch.randperm(t, generator=torch.Generator().manual_seed(seed))[: max(n - len(ends), 0)]
    return torch.unique(torch.cat([ends, drawn])).to(device)


def backends_for(device: str) -> list[str]:
    return ["cpu_flash"] if device == "cpu" else ["flash", "efficient", "cudnn"]


def sweep(device: str, dry_run: bool, one: Callable[..., dict[str, Any]], *, n_rows: int,
          deadline: float | None = None, seqs: tuple[int, ...] | None = None,
          kinds: tuple[str, ...] = INPUTS) -> list[dict[str, Any]]:
    """One row per configuration, backend x dtype x T x D x causal x inputs (at --dry-run's sizes, or the models'):
    ``one(backend, q, k, v, is_causal=, scale=, rows=, heads=)`` measures it on Gaussian-seeded inputs. A backend
    that cannot take a configuration (not in this build, this GPU, this dtype) records its error and the next runs.
    seqs: the sequence lengths in place of the default ones."""
    import time

    if dry_run:
        lengths, dims, dtypes, n_rows, heads = (96,), (16, 32), (torch.bfloat16,), 24, (0, 1)
    else:
        lengths, dims, dtypes, heads = (2048, 8192), (64, 128), (torch.bfloat16, torch.float16), (0, 3)
    rows_out = []
    # Each backend innermost: a run cut by its deadline still has every backend's rows of the shapes it reached.
    for dtype, t, d, causal, kind, backend in itertools.product(dtypes, seqs or lengths, dims, (True, False), kinds,
                                                                backends_for(device)):
        if deadline is not None and time.monotonic() > deadline:
            rows_out.append({"skipped": "over the time budget"})
            break
        row: dict[str, Any] = {"backend": backend, "dtype": str(dtype).removeprefix("torch."), "t": t, "d": d,
                               "causal": causal, "inputs": kind}
        q, k, v = inputs(kind, 1, 4, t, d, dtype, device, seed=t + d)
        try:
            with torch.no_grad():
                row.update(one(backend, q, k, v, is_causal=causal, scale=d ** -0.5,
                               rows=sample_rows(t, n_rows, t, device), heads=heads))
        except Exception as e:  # a kernel this build or GPU lacks: say so, go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row["traceback"] = traceback.format_exc()[-1500:]
        rows_out.append(row)
    return rows_out


def run(*, device: str, dry_run: bool, deadline: float | None = None) -> dict[str, Any]:
    """Every configuration (``sweep``), 256 rows sampled of each."""

    def one(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: float,
            **at: Any) -> dict[str, Any]:
        out, lse = vendor_forward(backend, q, k, v, is_causal=is_causal, scale=scale)
        return measure(q, k, v, out, lse, is_causal=is_causal, scale=scale, **at)

    return {"unit_roundoff": {str(k).removeprefix("torch."): v for k, v in UNIT.items()},
            "rows": sweep(device, dry_run, one, n_rows=256, deadline=deadline)}


def worst(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key]["p100"] for r in rows if key in r]
    return max(vals) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="the CPU's flash kernel at tiny sizes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    got = run(device=device, dry_run=args.dry_run)
    ok = [r for r in got["rows"] if "rA" in r]
    lines = [[r["backend"], r["dtype"], r["t"], r["d"], r["causal"], r["inputs"], r["rB_ones_over_worst"]["p100"],
              r["rB_ones_over_walk"]["p100"], r["rB_ones_over_walks"]["p100"], r["rB_ramp_over_walks"]["p100"],
              r["rA_over_walk"]["p100"], r["catches_worst_rms"]["p50"], r["catches_walk_rms"]["p50"],
              r["catches_walks_rms"]["p50"], r["given_a_ratio"]["p100"], r["given_b_ratio"]["p100"],
              r["given_catches_rms"]["p50"]] for r in ok]
    print(_common.table(lines, ["backend", "dtype", "T", "D", "causal", "inputs", "B/worst max", "B/walk max",
                                "B/walks max", "B ramp/walks max", "A/walk max", "catches (RMS), worst p50",
                                "walk p50", "walks p50", "built: A max", "built: B max", "built: catches p50"]))
    for r in got["rows"]:
        if "error" in r:
            print(f"{r['backend']} {r['dtype']} T={r['t']} D={r['d']}: {r['error']}")
    got["worst"] = {key: worst(ok, key) for key in ("rB_ones_over_worst", "rB_ones_over_walk", "rB_ramp_over_walk",
                                                    "rB_ones_over_walks", "rB_ramp_over_walks", "rA_over_walk",
                                                    "rA_over_worst", "rA_over_input_scores", "given_a_ratio",
                                                    "given_b_ratio")}
    path = _common.write_result("vendor_residuals", got, args.out)
    print(f"\nworst over every row: {got['worst']}\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
