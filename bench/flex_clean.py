"""FlexAttention's checked path at a realistic shape (issue 33): how close clean calls come to a flag, and what a
checked call costs against flex_attention's own (eager, as on CPU) forward.

Shape: B = 1, H = 8 query heads over 2 KV heads (GQA), T = S = 2048, D = 128 (a 7B-class head), inputs N(0, 1) with
a shared per-head offset on q and k (correlated scores, as trained attention has); the mask and score_mod cases of
tests/agent/test_flex_attention.py at that size: causal, sliding window (512), packed documents (4, causal), ALiBi,
tanh softcapping (cap 20). fp32 and bf16. Every op checked (the step's full check), no gradient.

Per case and dtype: detections (must be 0: clean data), the worst clean residual / threshold ratio of the scores and
the context checks over the seeds (1 is where a check flags), and the time of the checked call against flex_attention's
forward (compiled for the mod once before, untimed), interleaved per seed (one torch thread; wall time, median of
the seeds).

    python bench/flex_clean.py [--seeds 3] [--t 2048] [--out PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import setup_path, table, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--t", type=int, default=2048)
    parser.add_argument("--out")
    args = parser.parse_args()
    setup_path()
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from attnchecker.attention.flex import protected_flex_attention
    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.set_num_threads(1)
    t, h, hk, d = args.t, 8, 2, 128
    docs = torch.arange(t) * 4 // t
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(h)])
    # FlexAttention's mod signatures: (b, h, q_idx, kv_idx) and (score, b, h, q_idx, kv_idx), used or not.
    masks = {
        "causal": lambda b, hh, q, kv: q >= kv,  # noqa: ARG005
        "sliding_window": lambda b, hh, q, kv: (q >= kv) & (q - kv < 512),  # noqa: ARG005
        "documents": lambda b, hh, q, kv: (docs[q] == docs[kv]) & (q >= kv),  # noqa: ARG005
        "alibi": lambda b, hh, q, kv: q >= kv,  # noqa: ARG005
        "softcap": None,
    }
    mods = {"alibi": lambda s, b, hh, q, kv: s + slopes[hh] * (kv - q),  # noqa: ARG005
            "softcap": lambda s, b, hh, q, kv: 20.0 * torch.tanh(s / 20.0)}  # noqa: ARG005
    rows, results = [], {}
    for dtype in (torch.float32, torch.bfloat16):
        for case, mask_mod in masks.items():
            bm = None if mask_mod is None else create_block_mask(mask_mod, None, None, t, t, device="cpu")
            worst = {"scores": 0.0, "context": 0.0}
            detections, mine, theirs = 0, [], []
            # flex_attention compiles its call for each new mod (a Dynamo trace even eagerly): once before the timing.
            w = torch.zeros(1, h, t, d, dtype=dtype)
            with torch.no_grad():
                flex_attention(w, w[:, :hk], w[:, :hk], score_mod=mods.get(case), block_mask=bm, enable_gqa=True)
            for seed in range(args.seeds):
                g = torch.Generator().manual_seed(seed)
                q = (torch.randn(1, h, t, d, generator=g) + torch.randn(1, h, 1, d, generator=g)).to(dtype)
                k = (torch.randn(1, hk, t, d, generator=g) + torch.randn(1, hk, 1, d, generator=g)).to(dtype)
                v = torch.randn(1, hk, t, d, generator=g).to(dtype)
                seen: list[object] = []
                ctx = LayerContext(layer=0, runtime=Runtime(config=CheckConfig(), on_detection=seen.append,
                                                            stats=OpStats()))
                with torch.no_grad():
                    t0 = time.perf_counter()
                    flex_attention(q, k, v, score_mod=mods.get(case), block_mask=bm, enable_gqa=True)
                    theirs.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    protected_flex_attention(q, k, v, ctx=ctx, score_mod=mods.get(case), block_mask=bm,
                                             enable_gqa=True)
                    mine.append(time.perf_counter() - t0)
                detections += len(seen)
                stats = ctx.runtime.stats
                assert stats is not None
                for op in worst:
                    worst[op] = max(worst[op], float(stats.residual_max[op]))
            name = str(dtype).removeprefix("torch.")
            ratio = statistics.median(m / f for m, f in zip(mine, theirs, strict=True))
            results[f"{case}/{name}"] = {"detections": detections, "worst_ratio": worst,
                                         "checked_s": mine, "flex_s": theirs, "time_ratio_median": ratio}
            rows.append([case, name, detections, f"{worst['scores']:.3f}", f"{worst['context']:.3f}",
                         f"{statistics.median(mine):.2f}", f"{statistics.median(theirs):.2f}", f"{ratio:.2f}"])
    print(table(rows, ["case", "dtype", "detections", "worst scores ratio", "worst context ratio", "checked s",
                       "flex s", "checked / flex"]))
    path = write_result("flex_clean", {"t": t, "heads": h, "kv_heads": hk, "head_dim": d, "seeds": args.seeds,
                                       "results": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
