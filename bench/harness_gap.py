"""Where bench/overhead.py and bench/attached_overhead.py part (issue 32): both designs' protected steps in one
interleaved run, beside the two ways they differ, so each difference gets its own ratio against one baseline.

bench/overhead.py protects the model its baseline runs on, attaching before each step and closing after it;
bench/attached_overhead.py protects a deep copy once and leaves it on. Jobs here, all stepped in one shuffled
rotation per round, each with its own SGD optimizer (stateless, so two optimizers over one model's parameters
update it as one would):

  orig_plain     the model as transformers built it, unprotected: the baseline of every ratio
  orig_per_step  the same model object, protected before each step and closed after it (bench/overhead.py's design)
  orig2_once     a second model built the same way (same seed, same weights), protected once
  copy_plain     a deep copy of the first model, unprotected: the copies' A/A control
  copy_per_step  another deep copy, protected before each step and closed after it
  copy_once      another deep copy, protected once (bench/attached_overhead.py's design)

Beside each protected job's ratio, its checks' share (the guard's timers over the baseline's step) and what it adds
outside them: median step - median checks - median baseline step, in ms.

    python bench/harness_gap.py [--rounds 12] [--seed 0] [--tiny] [--out PATH]
    python bench/harness_gap.py --pool RUN.json [RUN.json ...]
    python bench/harness_gap.py --code-path [--tiny] [--out PATH]

Every protected job runs Policy.full(): a guard attached before each step checks everything on that step whatever
its policy, so full protection is the one both designs can time alike.

--pool reads runs written by this script and pairs their rounds: for each comparison below, the per-round ratio of
two jobs stepped in the same round, over every round of every run (median [IQR], and in how many runs the per-run
median was above 1). A run's own rounds share its phase of the machine; pooling them gives the comparison the
rounds that a single run's median lacks.

--code-path times nothing: it profiles one step of a guard attached once (past its warm-up) and one of a guard
attached just before its step (bench/overhead.py's way, the attach itself outside the profile) and counts the Python
and torch functions whose call counts differ; then it counts the tensors a live guard keeps between steps (those
alive before its close and gone after it), beside the entries of the engine's caches, which the last live guard's
close releases.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import pstats
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
from attached_overhead import POLICIES, Job
from overhead import SIZES, build_model

from attnchecker.checks.caches import engine_caches

COMPARISONS = (
    ("orig_per_step", "orig_plain", "bench/overhead.py's design: protected and baseline on one model"),
    ("copy_once", "orig_plain", "bench/attached_overhead.py's design: a copy protected once"),
    ("orig2_once", "orig_per_step", "attached once against per step, on models transformers built"),
    ("copy_once", "copy_per_step", "attached once against per step, on deep copies"),
    ("copy_per_step", "orig_per_step", "a copy against the model itself, both protected per step"),
    ("copy_plain", "orig_plain", "a copy against the model itself, unprotected (A/A)"),
)
"""(job, over, what it tells) for --pool."""


def run(size: dict[str, int], *, rounds: int, warmup: int, seed: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    orig = build_model("gpt2", size)
    orig2 = build_model("gpt2", size)
    protect = {"scope": "all", "policy": POLICIES["full"]()}
    jobs = {
        "orig_plain": Job(orig, "sgd", protect=None),
        "orig_per_step": Job(orig, "sgd", protect=protect, reattach=True),
        "orig2_once": Job(orig2, "sgd", protect=protect),
        "copy_plain": Job(copy.deepcopy(orig), "sgd", protect=None),
        "copy_per_step": Job(copy.deepcopy(orig), "sgd", protect=protect, reattach=True),
        "copy_once": Job(copy.deepcopy(orig), "sgd", protect=protect),
    }
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    # The attached-once jobs a few more steps than the others; every job a few, so the allocator and caches are in
    # their steady state.
    for i in range(warmup):
        for name, job in jobs.items():
            if name.endswith("_once") or i < 4:
                job.step(ids, record=False)
    _common.interleaved({n: (lambda j=j: j.step(ids)) for n, j in jobs.items()}, rounds=rounds, warmup=0, seed=seed)
    for job in jobs.values():
        job.close()
    cpu = {n: j.cpu_s for n, j in jobs.items()}
    rat = _common.ratios(cpu, "orig_plain")
    base_ms = statistics.median(cpu["orig_plain"]) * 1e3
    variants: dict[str, Any] = {}
    for n, j in jobs.items():
        step_ms = statistics.median(j.cpu_s) * 1e3
        entry: dict[str, Any] = {"step_s": _common.summary(j.cpu_s), "ratio_vs_orig_plain": rat[n],
                                 "samples_s": j.cpu_s}
        if j.check_s:
            check_ms = statistics.median(j.check_s) * 1e3
            entry["check_s_per_step"] = _common.summary(j.check_s)
            entry["check_samples_s"] = j.check_s
            entry["check_share"] = check_ms / base_ms
            entry["outside_checks_ms"] = step_ms - check_ms - base_ms
        variants[n] = entry
    return {"model": "gpt2", "size": size, "policy": "full", "optimizer": "sgd", "rounds": rounds,
            "warmup_steps": warmup, "variants": variants}


def code_path(size: dict[str, int], *, warmup: int) -> dict[str, Any]:
    """What differs, call for call, between a step under a guard left on and one under a fresh guard; and what a
    live guard holds between steps (see the docstring)."""
    torch.set_num_threads(1)
    orig = build_model("gpt2", size)
    protect = {"scope": "all", "policy": POLICIES["full"]()}
    once = Job(copy.deepcopy(orig), "sgd", protect=protect)
    fresh = Job(copy.deepcopy(orig), "sgd", protect=protect, reattach=True)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0))
    for i in range(warmup):
        once.step(ids, record=False)
        if i < 3:
            fresh.step(ids, record=False)
    # The profiled step's guard attached here, outside the profile (bench/overhead.py attaches untimed too).
    fresh.reattach, fresh.guard = False, fresh._attach()
    calls: dict[str, dict[tuple[str, int, str], int]] = {}
    for name, job in (("once", once), ("fresh", fresh)):
        prof = cProfile.Profile()
        prof.enable()
        job.step(ids, record=False)
        prof.disable()
        calls[name] = {k: v[1] for k, v in pstats.Stats(prof).stats.items()}  # type: ignore[attr-defined]
    fresh.close()
    differ = sorted((f"{k[0].rsplit('/', 1)[-1]}:{k[1]} {k[2]}", calls["once"].get(k, 0) - calls["fresh"].get(k, 0))
                    for k in set(calls["once"]) | set(calls["fresh"]) if calls["once"].get(k) != calls["fresh"].get(k))
    # What the live guard holds: the tensors alive now that are gone once it is closed (the last live guard's close
    # also empties the engine's process-wide caches, counted beside them).
    cache_entries = engine_caches.entries()
    before = _tensor_storages()
    once.close()
    after = _tensor_storages()
    held = {ptr: n for ptr, n in before.items() if ptr not in after}
    return {"policy": "full", "size": size, "warmup_steps": warmup, "functions": len(calls["once"]),
            "functions_fresh": len(calls["fresh"]), "call_counts_differ": differ,
            "tensors_held_between_steps": len(held), "bytes_held_between_steps": sum(held.values()),
            "engine_cache_entries": cache_entries}


def _tensor_storages() -> dict[int, int]:
    """data_ptr -> bytes of every tensor storage the garbage collector can see."""
    gc.collect()
    out: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                st = obj.untyped_storage()
                out[st.data_ptr()] = st.nbytes()
    return out


def pool(paths: list[str]) -> dict[str, Any]:
    """The per-round ratios of COMPARISONS over every round of the runs at ``paths``."""
    runs = [json.loads(Path(p).read_text())["variants"] for p in paths]
    out: dict[str, Any] = {"runs": paths, "comparisons": []}
    for job, over, what in COMPARISONS:
        per_run = [[a / b for a, b in zip(v[job]["samples_s"], v[over]["samples_s"], strict=True)] for v in runs]
        every = [r for rs in per_run for r in rs]
        out["comparisons"].append({"job": job, "over": over, "what": what, "ratio": _common.summary(every),
                                   "run_medians": [statistics.median(rs) for rs in per_run]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps of the attached-once jobs first (4 of the "
                                                          "others)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the smoke test's size: seconds, not minutes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pool", nargs="+", metavar="RUN", help="pool the paired rounds of runs this script wrote")
    ap.add_argument("--code-path", action="store_true",
                    help="no timing: the functions whose call counts differ between a step under a guard left on "
                         "and one under a fresh guard, and the tensors a live guard holds between steps")
    args = ap.parse_args(argv)
    size = dict(SIZES["tiny" if args.tiny else "full"])
    if args.code_path:
        got = code_path(size, warmup=2 if args.tiny else 8)
        print("one step (gpt2, scope=all, Policy.full()), a guard attached once against one attached just "
              "before it")
        print(_common.table([
            ["functions called (once / fresh)", f"{got['functions']} / {got['functions_fresh']}"],
            ["functions with different call counts", len(got["call_counts_differ"])],
            ["tensors a live guard keeps between steps", got["tensors_held_between_steps"]],
            ["their bytes", got["bytes_held_between_steps"]],
            ["entries in the engine's caches (released with the last guard)", got["engine_cache_entries"]],
        ], ["what", "count"]))
        for fn, d in got["call_counts_differ"][:20]:
            print(f"  {d:+d}  {fn}")
        print(f"wrote {_common.write_result('harness_gap_code_path', got, args.out)}")
        return 0
    if args.pool:
        pooled = pool(args.pool)
        rows = [[f"{c['job']} / {c['over']}", _common.pct(c["ratio"]["median"]),
                 f"[{_common.pct(c['ratio']['p25'])}, {_common.pct(c['ratio']['p75'])}]", c["ratio"]["n"],
                 " ".join(_common.pct(m) for m in c["run_medians"]), c["what"]] for c in pooled["comparisons"]]
        print(f"{len(args.pool)} runs pooled; per-round CPU-time ratios of two jobs stepped in the same round")
        print(_common.table(rows, ["ratio", "median", "IQR", "rounds", "per-run medians", "what it tells"]))
        if args.out:
            print(f"wrote {_common.write_result('harness_gap_pool', pooled, args.out)}")
        return 0
    res = run(size, rounds=args.rounds, warmup=2 if args.tiny else args.warmup, seed=args.seed)
    rows = []
    for n, e in res["variants"].items():
        r = e["ratio_vs_orig_plain"]
        rows.append([n, e["step_s"]["median"] * 1e3, _common.pct(r["median"]),
                     f"[{_common.pct(r['p25'])}, {_common.pct(r['p75'])}]",
                     f"{e['check_share'] * 100:.1f} %" if "check_share" in e else "",
                     f"{e['outside_checks_ms']:+.0f}" if "outside_checks_ms" in e else ""])
    print(f"gpt2 {res['size']}, scope=all, Policy.full(), SGD, {res['rounds']} interleaved rounds; "
          "overhead = median of per-round CPU-time ratios to orig_plain [IQR]")
    print(_common.table(rows, ["job", "CPU ms/step", "vs orig_plain", "IQR", "checks' share",
                               "outside checks, ms"]))
    path = _common.write_result("harness_gap", res, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
