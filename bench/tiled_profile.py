"""Where the time of one protected attention layer goes on the tiled path (issue 12), against the unprotected fused
SDPA. One causal layer of bench/memory.py's GPT-2 stack: B = 1, 8 heads, D = 32, fp32, q/k/v strided as they come
out of GPT-2's fused c_attn projection, CheckConfig() defaults (every op checked, roundoff tolerance), default tiles.

Parts, process CPU time, median over interleaved rounds (bench/_common.py):
  sdpa_fwd, sdpa_bwd    the unprotected fused CPU kernel's forward, and its backward
  tiled_fwd             protected_sdpa's tiled forward (fast pass + the one sync), every op checked
  tiled_fwd_scores      the same with only the AS tiles checked (tier-1 tripwire off)
  tiled_fwd_context     the same with only the CL tiles checked
  (derived) scores_check = tiled_fwd - tiled_fwd_context, context_check = tiled_fwd - tiled_fwd_scores: process
  time, not the engine's own check_seconds (wall clock, which on a shared machine counts other tenants' slices)
  eager_fwd             the same tiles with no checks at all: AS GEMM, in-place softmax, P̃V GEMM (the floor of a
                        PyTorch backend: what the protected forward must compute anyway)
  tiled_bwd             the backward of the protected call (the fused kernel fed the verified out and lse)
  per_tile_python_s     fixed cost of one tile (Python and op dispatch): a (1, 1, 512, 8) call in 16 × 16 tiles,
                        whose arithmetic is negligible, divided by its tile count

    python bench/tiled_profile.py [--seqs 2048,4096] [--threads 1,2] [--rounds 5] [--out PATH]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()


def _qkv(t: int, *, heads: int = 8, d: int = 32, grad: bool = False) -> list[Any]:
    """q, k, v (1, heads, t, d) as views of one (1, t, 3·heads·d) projection output, like GPT-2's split heads."""
    import torch

    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, t, 3 * heads * d, generator=g)
    parts = [x.view(1, t, heads, d).transpose(1, 2) for x in qkv.split(heads * d, dim=-1)]
    return [p.detach().requires_grad_(grad) for p in parts]


def _ctx(only: str | None = None) -> Any:
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime

    config = CheckConfig() if only is None else CheckConfig(checked_ops=frozenset({only}), tripwire=False)
    runtime = Runtime(step=0, config=config, injector=None, on_detection=lambda _: None, stats=OpStats())
    return LayerContext(layer=0, runtime=runtime)


def _eager_forward(q: Any, k: Any, v: Any, block_q: int) -> Any:
    """Causal attention in query blocks over each block's key prefix, with no checks: the tiled path's arithmetic."""
    import torch

    from attnchecker.abft.tiled import finish, fold_scores

    t = q.shape[-2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lead = q.shape[:-2]
    for r0 in range(0, t, block_q):
        r1 = min(t, r0 + block_q)
        m = torch.full((*lead, r1 - r0), -math.inf)
        p, _, m, l_, _ = fold_scores(q[..., r0:r1, :] @ k[..., :r1, :].mT, m, torch.zeros_like(m),
                                     scale=1 / math.sqrt(q.shape[-1]), blocked=None, additive=None, causal_offset=r0)
        out[..., r0:r1, :] = finish(p @ v[..., :r1, :], m, l_, q.dtype)[0]
    return out


def profile(t: int, rounds: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from attnchecker.attention.backends.tiled_torch import default_tiles
    from attnchecker.attention.pipeline import protected_sdpa

    q, k, v = _qkv(t, grad=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    tiles = default_tiles(t, q.shape[:-2].numel())

    def cpu(fn: Any) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    def sdpa_fwd() -> float:
        with torch.no_grad():
            return cpu(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def sdpa_bwd() -> float:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return cpu(lambda: out.backward(grad))

    def tiled_fwd(only: str | None = None) -> float:
        ctx = _ctx(only)
        with torch.no_grad():
            return cpu(lambda: protected_sdpa(q, k, v, ctx=ctx, is_causal=True))

    def tiled_bwd() -> float:
        out = protected_sdpa(q, k, v, ctx=_ctx(), is_causal=True)
        return cpu(lambda: out.backward(grad))

    def eager_fwd() -> float:
        with torch.no_grad():
            return cpu(lambda: _eager_forward(q, k, v, tiles.block_q))

    parts = {"sdpa_fwd": sdpa_fwd, "sdpa_bwd": sdpa_bwd, "tiled_fwd": tiled_fwd, "eager_fwd": eager_fwd,
             "tiled_bwd": tiled_bwd, "tiled_fwd_scores": lambda: tiled_fwd("scores"),
             "tiled_fwd_context": lambda: tiled_fwd("context")}
    samples = _common.interleaved(parts, rounds=rounds, warmup=1, seed=t)
    # Per round (the parts ran back to back in it), then the median.
    samples["scores_check"] = [a - b for a, b in zip(samples["tiled_fwd"], samples["tiled_fwd_context"], strict=True)]
    samples["context_check"] = [a - b for a, b in zip(samples["tiled_fwd"], samples["tiled_fwd_scores"], strict=True)]
    medians = {name: _common.summary(xs)["median"] for name, xs in samples.items()}
    return {"seq": t, "threads": torch.get_num_threads(), "tiles": [tiles.block_q, tiles.block_k],
            "median_s": medians, "samples_s": samples}


def per_tile_python() -> float:
    """Seconds of fixed cost per tile: a call whose tiles are too small for the arithmetic to count."""
    import torch

    from attnchecker.attention.backends.tiled_torch import TILE_ENV
    from attnchecker.attention.pipeline import protected_sdpa

    q, k, v = _qkv(512, heads=1, d=8)
    saved = os.environ.get(TILE_ENV)
    os.environ[TILE_ENV] = "16,16"
    try:
        n_tiles = sum(i + 1 for i in range(512 // 16))  # causal: query block i visits key blocks 0..i
        best = math.inf
        for _ in range(3):
            with torch.no_grad():
                t0 = time.process_time()
                protected_sdpa(q, k, v, ctx=_ctx(), is_causal=True)
                best = min(best, time.process_time() - t0)
    finally:
        if saved is None:
            os.environ.pop(TILE_ENV, None)
        else:
            os.environ[TILE_ENV] = saved
    return best / n_tiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from attnchecker.attention.backends.tiled_torch import PATH_ENV

    os.environ[PATH_ENV] = "tiled"
    results = []
    rows = []
    for threads in (int(x) for x in args.threads.split(",")):
        torch.set_num_threads(threads)
        per_tile = per_tile_python()
        for t in (int(x) for x in args.seqs.split(",")):
            res = profile(t, args.rounds)
            res["per_tile_python_s"] = per_tile
            results.append(res)
            m = res["median_s"]
            rows.append([t, threads, *(1e3 * m[k] for k in ("sdpa_fwd", "eager_fwd", "tiled_fwd", "scores_check",
                                                             "context_check", "sdpa_bwd", "tiled_bwd")),
                         1e3 * per_tile])
    print(_common.table(rows, ["T", "threads", "sdpa fwd ms", "eager fwd ms", "tiled fwd ms", "scores chk ms",
                               "context chk ms", "sdpa bwd ms", "tiled bwd ms", "per-tile python ms"]))
    path = _common.write_result("tiled_profile", {"layer": {"batch": 1, "heads": 8, "head_dim": 32, "causal": True},
                                                  "profile": results}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
