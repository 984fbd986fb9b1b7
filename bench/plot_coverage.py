"""Plot a coverage.json (bench/coverage.py) into the two figures of docs/fault-coverage.md: detection rate vs error
magnitude (calibrated and rigorous tolerance, per shape, dtype and op) and detection rate vs flipped bit. Needs
matplotlib (the `bench` extra).

    python bench/plot_coverage.py [bench/results/coverage.json ...] [docs/perf]

Several JSONs (e.g. the grouped 7B runs, one per dtype or op) are merged into one figure: their results side by side,
columns in the order the dtypes first appear. A last argument that is a directory is where the figures go.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common


def main(argv: list[str] | None = None) -> int:
    args = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    dst = args.pop() if args and args[-1].is_dir() else _common.ROOT / "docs" / "perf"
    sources = args or [_common.RESULTS / "coverage.json"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = [json.loads(src.read_text()) for src in sources]
    doc = docs[0]
    if any(d["magnitudes"] != doc["magnitudes"] for d in docs):
        raise SystemExit("the JSONs to merge were run at different magnitudes")
    results = [r for d in docs for r in d["results"]]
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    mags = doc["magnitudes"]

    size = (3.2 * len(dtypes), 2.6 * len(shapes) + 0.8)  # + room for the legend below
    fig, axes = plt.subplots(len(shapes), len(dtypes), figsize=size, sharex=True,
                             sharey=True, squeeze=False)
    for i, shape in enumerate(shapes):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            for r in results:
                if r["shape"] != shape or r["dtype"] != dtype:
                    continue
                for kind, style in (("calibrated", "-"), ("rigorous", ":")):
                    ys = [r["magnitude"][kind][str(m)] for m in mags]
                    ax.plot(mags, [y if y is not None else float("nan") for y in ys], style, marker=".",
                            label=f"{r['op']} ({kind})")
            ax.set_xscale("log")
            ax.set_ylim(-0.03, 1.03)
            ax.axvline(2, color="grey", linewidth=0.6)
            ax.set_title(f"{shape} / {dtype}", fontsize=9)
            if i == len(shapes) - 1:
                ax.set_xlabel("single error (× RMS element)")
            if j == 0:
                ax.set_ylabel("detected")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))  # room for the legend below
    out1 = dst / "coverage_magnitude.png"
    fig.savefig(out1, dpi=110)

    fig, axes = plt.subplots(len(shapes), len(dtypes), figsize=size, sharey=True,
                             squeeze=False)
    for i, shape in enumerate(shapes):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            for r in results:
                if r["shape"] != shape or r["dtype"] != dtype:
                    continue
                bits = sorted(int(b) for b in r["bits"])
                ax.plot(bits, [r["bits"][str(b)]["rate"] for b in bits], marker=".", linewidth=0.8, label=r["op"])
                man = r["layout"]["mantissa_bits"]
                ax.axvspan(man - 0.5, man + r["layout"]["exponent_bits"] - 0.5, color="orange", alpha=0.08)
            ax.set_title(f"{shape} / {dtype}", fontsize=9)
            if i == len(shapes) - 1:
                ax.set_xlabel("flipped bit (shaded: exponent)", fontsize=8)
            if j == 0:
                ax.set_ylabel("detected")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.45 / fig.get_figheight(), 1, 1))
    out2 = dst / "coverage_bits.png"
    fig.savefig(out2, dpi=110)
    print(f"wrote {out1} and {out2}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
