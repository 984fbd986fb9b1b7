"""Plot a memory.json (bench/memory.py) into a PNG: peak step memory per variant against T, and the ratio to the
unprotected step. Needs matplotlib (not a test requirement).

    python bench/plot_memory.py [bench/results/memory.json] [docs/perf/memory.png]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    src = Path(args[0]) if args else _common.RESULTS / "memory.json"
    dst = Path(args[1]) if len(args) > 1 else _common.ROOT / "docs" / "perf" / "memory.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(src.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, style in (("baseline", "k-o"), ("tiled", "b-s"), ("unfused", "r-^")):
        pts = [(e["seq"], e["variants"][variant]) for e in doc["memory"] if "step_mb" in e["variants"].get(variant, {})]
        if not pts:
            continue
        seqs = [t for t, _ in pts]
        med = [v["step_mb"]["median"] for _, v in pts]
        err = [[m - v["step_mb"]["min"] for m, (_, v) in zip(med, pts, strict=True)],
               [v["step_mb"]["max"] - m for m, (_, v) in zip(med, pts, strict=True)]]
        left.errorbar(seqs, med, yerr=err, fmt=style, label=variant, capsize=3)
        if variant != "baseline":
            right.plot(seqs, [v["step_ratio_vs_baseline"] for _, v in pts], style, label=variant)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.legend()
    left.set_yscale("log")
    left.set_ylabel("peak memory of one training step (MB, RSS)")
    right.axhline(1.25, color="grey", linestyle="--", linewidth=0.8)
    right.set_ylabel("× the unprotected step")
    size = doc["size"]
    fig.suptitle(f"GPT-2 {size['layers']} layers, n_embd {size['hidden']}, {size['heads']} heads, B={size['batch']}, "
                 f"Policy.full(); CPU ({doc['machine'].get('cpu', '?')}), bars: min-max of the repeats")
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
