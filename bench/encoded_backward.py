"""The encoded attention backward (attnchecker/encoded_backward.py): its time against the plain fused kernel and the
checked products, and how large a single finite error in its outputs must be to be flagged.

Time: one layer's backward at the overhead benchmark's GPT-2 size (B 4, H 8, T 256, D 64, causal, q/k/v split from
one projection output), the variants interleaved over rounds (bench/_common.py), one torch thread: the plain kernel,
the encoded backward (operands padded to a multiple of 8 head dims) and the same unpadded (D + 5), the checked
products.

Sensitivity:
For each shape and dtype: one causal attention (q/k/v split from one projection output, as in a model), its fused
forward, and dO. An injector below autograd (a TorchDispatchMode on the fused CPU backward) adds m × the output's
RMS to one element of dQ, dK or dV (row T/2, head dim 3) for m = 0.25, 0.5, 1, 2, ... 4096; the table gives the
smallest m flagged (mode "detect", so nothing is recomputed). INF, NaN and near-INF values are flagged at every size
(tests/agent/test_encoded_backward.py): this measures the finite errors.

    python bench/encoded_backward.py [--tiny] [--rounds 10] [--out PATH]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnchecker.attention.backward.encoded import ENCODED_OPS, encoded_backward
from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime

aten = torch.ops.aten
FUSED_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# (batch, heads, T, head dim): the zoo's size, GPT-2-small's heads at T = 1024, a 7B-like head at T = 2048.
SHAPES = {"small": (2, 4, 48, 32), "gpt2": (1, 12, 1024, 64), "7b": (1, 4, 2048, 128)}
TINY = {"small": (2, 4, 48, 32)}
MULTIPLES = tuple(2.0**e for e in range(-2, 13))


class _AddToOutput(TorchDispatchMode):
    def __init__(self, which: int, multiple: float, head_dim: int) -> None:
        super().__init__()
        self.which, self.multiple, self.head_dim = which, multiple, head_dim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is FUSED_BACKWARD:
            grad = out[self.which][..., :self.head_dim]
            rms = float(grad.float().square().mean().sqrt())
            grad[0, 0, grad.shape[-2] // 2, 3] += self.multiple * rms
        return out


def _case(dtype: torch.dtype, b: int, h: int, t: int, d: int, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(b, t, 3 * h * d, generator=g).to(dtype)
    q, k, v = (base[..., i * h * d:(i + 1) * h * d].view(b, t, h, d).transpose(1, 2) for i in range(3))
    scale = 1.0 / math.sqrt(d)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]
    do = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    return {"q": q, "k": k, "v": v, "out": out, "lse": lse, "do": do, "scale": scale}


def _run(case: dict[str, Any], mode: TorchDispatchMode | None) -> tuple[list[Any], OpStats]:
    seen: list[Any] = []
    stats = OpStats()
    ctx = LayerContext(layer=0, runtime=Runtime(step=0, config=CheckConfig(mode="detect"), injector=None,
                                                on_detection=seen.append, stats=stats))
    args = (case["do"], case["q"], case["k"], case["v"], case["out"], case["lse"], None)
    if mode is None:
        encoded_backward(ctx, *args, scale=case["scale"], is_causal=True)
    else:
        with mode:
            encoded_backward(ctx, *args, scale=case["scale"], is_causal=True)
    return seen, stats


def measure(shapes: dict[str, tuple[int, int, int, int]]) -> list[dict[str, Any]]:
    rows = []
    for name, (b, h, t, d) in shapes.items():
        for dtype in (torch.float32, torch.bfloat16):
            case = _case(dtype, b, h, t, d)
            seen, stats = _run(case, None)
            row: dict[str, Any] = {"shape": name, "B": b, "H": h, "T": t, "D": d, "dtype": str(dtype).split(".")[1],
                                   "clean_flags": len(seen),
                                   "worst_clean_ratio": max(float(r) for r in stats.residual_max.values())}
            for which, op in enumerate(ENCODED_OPS[:3]):
                found = None
                for m in MULTIPLES:
                    if _run(case, _AddToOutput(which, m, d))[0]:
                        found = m
                        break
                row[f"{op}_min_rms"] = found
            rows.append(row)
            print(f"  {name} {row['dtype']}: done", file=sys.stderr)
    return rows


def _unpadded(encoded: Any, call: Any) -> Any:
    """call with the encoded operands D + 5 wide, not padded to a multiple of encoded.WIDTH_MULTIPLE: what the
    padding saves, side by side."""
    multiple = encoded.WIDTH_MULTIPLE
    encoded.WIDTH_MULTIPLE = 1
    try:
        return call()
    finally:
        encoded.WIDTH_MULTIPLE = multiple


def timing(rounds: int, tiny: bool) -> dict[str, Any]:
    """ms per layer backward: plain kernel, encoded (with its checks; and unpadded, D + 5 wide), checked products;
    median of the rounds."""
    from attnchecker.attention.backward import encoded
    from attnchecker.attention.backward.checked import checked_backward

    b, h, t, d = SHAPES["small"] if tiny else (4, 8, 256, 64)
    case = _case(torch.float32, b, h, t, d)
    ctx = LayerContext(layer=0, runtime=Runtime(step=0, config=CheckConfig(), injector=None, on_detection=None,
                                                stats=OpStats()))
    args = (case["do"], case["q"], case["k"], case["v"], case["out"], case["lse"])
    calls = {
        "fused": lambda: FUSED_BACKWARD(*args, 0.0, True, attn_mask=None, scale=case["scale"]),
        "encoded": lambda: encoded_backward(ctx, *args, None, scale=case["scale"], is_causal=True),
        "encoded_unpadded": lambda: _unpadded(encoded, lambda: encoded_backward(ctx, *args, None, scale=case["scale"],
                                                                                is_causal=True)),
        "products": lambda: checked_backward(ctx, *args, None, scale=case["scale"], is_causal=True),
    }
    per_round = 5

    def timed(fn: Any) -> Any:
        def run() -> None:
            for _ in range(per_round):
                fn()
        return run

    wall = _common.interleaved({n: timed(f) for n, f in calls.items()}, rounds=rounds, warmup=1, seed=0)
    ms = {n: 1e3 * statistics.median(v) / per_round for n, v in wall.items()}
    ratios = {n: statistics.median(a / f for a, f in zip(wall[n], wall["fused"], strict=True)) for n in calls}
    return {"shape": [b, h, t, d], "ms": ms, "ratio_to_fused": ratios, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the small shape only (smoke test)")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    ap.add_argument("--out", help="JSON path (default bench/results/encoded_backward-<time>.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    times = timing(2 if args.tiny else args.rounds, args.tiny)
    print(_common.table([[n, f"{times['ms'][n]:.2f}", f"{times['ratio_to_fused'][n]:.2f}"] for n in times["ms"]],
                        ["one layer's backward", "ms (median)", "× fused (median of per-round ratios)"]))
    print()
    rows = measure(TINY if args.tiny else SHAPES)
    header = ["shape", "dtype", "B·H·T·D", "clean flags", "worst clean ratio", "dQ: min ×RMS", "dK: min ×RMS",
              "dV: min ×RMS"]
    print(_common.table([[r["shape"], r["dtype"], f"{r['B']}·{r['H']}·{r['T']}·{r['D']}", r["clean_flags"],
                          f"{r['worst_clean_ratio']:.2g}",
                          *(r[f"{op}_min_rms"] or "> 4096" for op in ENCODED_OPS[:3])] for r in rows], header))
    path = _common.write_result("encoded_backward", {"timing": times, "sensitivity": rows, "multiples": MULTIPLES},
                                args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
