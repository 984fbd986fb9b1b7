"""Plot overhead per variant from an overhead.json (bench/overhead.py) into a PNG. Needs matplotlib, which nothing
else in the repository does, so it is not a test requirement.

    python bench/plot.py [bench/results/overhead.json] [docs/perf/overhead.png]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    src = Path(args[0]) if args else _common.RESULTS / "overhead.json"
    dst = Path(args[1]) if len(args) > 1 else _common.ROOT / "docs" / "perf" / "overhead.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(src.read_text())
    models = doc["models"]
    names = [n for n in models[0]["variants"] if n != "baseline"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(models)
    for i, m in enumerate(models):
        med = [(m["variants"][n]["ratio_vs_baseline"]["median"] - 1) * 100 for n in names]
        lo = [(m["variants"][n]["ratio_vs_baseline"]["p25"] - 1) * 100 for n in names]
        hi = [(m["variants"][n]["ratio_vs_baseline"]["p75"] - 1) * 100 for n in names]
        xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(names))]
        ax.bar(xs, med, width, label=m["model"],
               yerr=[[a - b for a, b in zip(med, lo, strict=True)], [b - a for a, b in zip(med, hi, strict=True)]],
               capsize=3)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("CPU time per step vs unprotected SDPA (%)")
    ax.set_title("Training-step overhead per variant (median of per-round ratios, bars: IQR)\n"
                 f"{doc['machine'].get('cpu', '?')}, {doc['machine'].get('torch_threads', '?')} torch thread(s), "
                 "no GPU")
    ax.legend()
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
