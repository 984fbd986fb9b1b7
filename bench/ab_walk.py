"""A/B of the projection rows' random-walk model (issue 13, tolerance.bounds(walk=...)) against the Cauchy-Schwarz
model it replaced, in one process, interleaved, on the overhead benchmark's GPT-2 size: what the tighter threshold
costs a training step. "cs" variants run with projection._walks patched to False (the model before), the others as
installed. Full protection in both scopes; baseline unprotected.

    python bench/ab_walk.py [--rounds 8] [--out bench/results/ab_walk.json]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import overhead as ov
import torch

import attnchecker.gemm.projection as projection


@contextlib.contextmanager
def cauchy_schwarz(on: bool) -> Iterator[None]:
    """projection._walks forced False while ``on``: every projection row bound is the Cauchy-Schwarz one."""
    walks = projection._walks
    if on:
        projection._walks = lambda _tol: False
    try:
        yield
    finally:
        projection._walks = walks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ab_walk.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    size = ov.SIZES["full"]
    base = ov.build_model("gpt2", size)
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]),
                          generator=torch.Generator().manual_seed(args.seed))
    shared = (base, torch.optim.AdamW(base.parameters(), lr=1e-5))
    tiny = batch[:1, :8]
    vs: dict[str, tuple[ov.Variant, bool]] = {"baseline": (ov.Variant("baseline", shared, batch, tiny_batch=tiny),
                                                           False)}
    for name in ("full", "all_full"):
        vs[f"{name}_walk"] = (ov.Variant(name, shared, batch, tiny_batch=tiny), False)
        vs[f"{name}_cs"] = (ov.Variant(name, shared, batch, tiny_batch=tiny), True)

    def run(v: ov.Variant, cs: bool) -> float:
        with cauchy_schwarz(cs):
            return v.step()

    _common.interleaved({n: functools.partial(run, *vc) for n, vc in vs.items()}, rounds=args.rounds, warmup=1,
                        seed=args.seed)
    cpu = {n: vc[0].cpu_s[1:] for n, vc in vs.items()}
    r = _common.ratios(cpu, "baseline")
    rows = [[n, statistics.median(cpu[n]) * 1e3, _common.pct(r[n]["median"]),
             f"[{_common.pct(r[n]['p25'])}, {_common.pct(r[n]['p75'])}]"] for n in vs]
    print(_common.table(rows, ["variant (walk: as installed; cs: Cauchy-Schwarz rows)", "CPU ms/step",
                               "vs baseline", "IQR"]))
    path = _common.write_result("ab_walk", {"rounds": args.rounds, "variants": {
        n: {"cpu_step_s": _common.summary(cpu[n]), "ratio_vs_baseline": r[n], "samples_s": cpu[n]} for n in vs}},
        args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
