"""Training-step overhead as a user's job sees it: protection attached once and left on, then interleaved steps of
the protected model and of unprotected copies of it, CPU time of this process per step (one torch thread).

bench/overhead.py attaches protection before each timed step and takes it off after, on one shared model (so every
variant runs on the same tensors in the same memory). This harness is the other fair design, a second opinion on the
same question: separate models with identical weights, each with its own optimizer, protection attached once and
warmed up past the schedule's ramp, as in a real job. A second unprotected copy measures the copy-to-copy (A/A)
bias that separate models carry. Variants:

  plain        unprotected (the baseline)
  plain_again  a second unprotected copy: plain_again / plain is the A/A bias of this design
  protected    attnchecker.protect(model, optimizer=opt, scope=..., policy=...) (--reattach: attached before each
               step and closed after it, untimed, as bench/overhead.py does, to tell the two designs apart)

--no-plain-again leaves the second unprotected copy out: two models stepped in turn instead of three, to tell
whether the number of models in rotation (memory, caches) moves the protected ratio (issue 32's harness gap).

plain_again measures the bias of one copy against another, not that of the protected copy. --bare-control measures
that one too: after the timed rounds the protected job's guard is closed and the same number of interleaved rounds
runs again, all three jobs unprotected (the protected copy as protected_bare). The protected copy's ratio divided
by its own bare ratio is the overhead with its copy bias taken out (bare_control.corrected_ratio).

    python bench/attached_overhead.py [--scope all] [--policy full|default] [--optimizer sgd|adamw]
        [--vocab 8192] [--rounds 30] [--bare-control] [--tiny] [--out PATH]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import torch
from overhead import SIZES, build_model

import attnchecker
from attnchecker import Policy

POLICIES = {"full": Policy.full, "default": Policy}


class Job:
    """One model with its optimizer (and protection, attached once), stepped on demand; keeps its CPU seconds."""

    def __init__(self, model: torch.nn.Module, optimizer: str, *, protect: dict[str, Any] | None,
                 reattach: bool = False) -> None:
        self.model = model
        self.opt: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=1e-5) if optimizer == "sgd"
                                           else torch.optim.AdamW(model.parameters(), lr=1e-5))
        self.protect = protect
        self.reattach = reattach
        """Attach before each step and close after it, untimed (bench/overhead.py's way), instead of once."""
        self.guard = self._attach() if protect is not None and not reattach else None
        self.cpu_s: list[float] = []
        self.check_s: list[float] = []
        """Host time inside the guard's checks per step (OpStats.check_seconds and trip_seconds)."""

    def _attach(self) -> attnchecker.Guard:
        assert self.protect is not None
        return attnchecker.protect(self.model, optimizer=self.opt, **self.protect)

    def step(self, ids: torch.Tensor, *, record: bool = True) -> float:
        if self.reattach:
            self.guard = self._attach()
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        stats = self.guard.step_stats if self.guard is not None else None
        self.opt.step()
        dc, dt = time.process_time() - c0, time.perf_counter() - t0
        if record:
            self.cpu_s.append(dc)
            if stats is not None:
                self.check_s.append(sum(stats.check_seconds.values()) + stats.trip_seconds)
        if self.reattach and self.guard is not None:
            self.guard.close()
            self.guard = None
        return dt

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def run(arch: str, size: dict[str, int], *, scope: str, policy: str, optimizer: str, rounds: int, warmup: int,
        seed: int, reattach: bool = False, bare_control: bool = False, plain_again: bool = True) -> dict[str, Any]:
    torch.set_num_threads(1)
    base = build_model(arch, size)
    jobs = {"plain": Job(base, optimizer, protect=None)}
    if plain_again:
        jobs["plain_again"] = Job(copy.deepcopy(base), optimizer, protect=None)
    jobs["protected"] = Job(copy.deepcopy(base), optimizer, protect={"scope": scope, "policy": POLICIES[policy]()},
                            reattach=reattach)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=g)
    # The protected job past the schedule's ramp (period 1 -> 8 takes 56 quiet steps, docs/adaptive.md) on the real
    # input; every job a few steps first, so the allocator and caches of all three are in their steady state.
    for i in range(warmup):
        for name, job in jobs.items():
            if name == "protected" or i < 4:
                job.step(ids, record=False)
    wall = _common.interleaved({n: (lambda j=j: j.step(ids)) for n, j in jobs.items()}, rounds=rounds, warmup=0,
                               seed=seed)
    guard = jobs["protected"].guard
    detections = len(guard.detections) if guard is not None else None
    check_s = jobs["protected"].check_s
    cpu = {n: j.cpu_s for n, j in jobs.items()}
    for job in jobs.values():
        job.close()
    bare = _bare_control(jobs, ids, rounds=rounds, seed=seed) if bare_control else None
    result: dict[str, Any] = {"model": arch, "size": size, "scope": scope, "policy": policy, "optimizer": optimizer,
                              "rounds": rounds, "warmup_steps": warmup, "reattach": reattach,
                              "plain_again": plain_again, "detections": detections,
                              "check_s_per_step": _common.summary(check_s), "variants": {}}
    for clock, xs in (("cpu", cpu), ("wall", wall)):
        rat = _common.ratios(xs, "plain")
        for n in jobs:
            entry = result["variants"].setdefault(n, {})
            entry[clock] = {"step_s": _common.summary(xs[n]), "ratio_vs_plain": rat[n],
                            "ratio_of_means": statistics.fmean(xs[n]) / statistics.fmean(xs["plain"])}
        if bare is not None:
            own = bare["variants"]["protected_bare"][clock]["ratio_vs_plain"]["median"]
            bare["corrected_ratio"][clock] = rat["protected"]["median"] / own
    if bare is not None:
        result["bare_control"] = bare
    return result


def _bare_control(jobs: dict[str, Job], ids: torch.Tensor, *, rounds: int, seed: int) -> dict[str, Any]:
    """The protected copy's own bias: the same interleaved rounds again with its guard closed (see the docstring).
    run() fills in corrected_ratio, the protected ratio over this one, per clock."""
    bare_jobs = {n: j for n, j in jobs.items() if n != "protected"} | {"protected_bare": jobs["protected"]}
    assert bare_jobs["protected_bare"].guard is None or bare_jobs["protected_bare"].guard.closed
    bare_jobs["protected_bare"].guard = None
    for job in bare_jobs.values():
        job.cpu_s = []
        job.step(ids, record=False)  # the first step after the guard's close, untimed
    wall = _common.interleaved({n: (lambda j=j: j.step(ids)) for n, j in bare_jobs.items()}, rounds=rounds,
                               warmup=0, seed=seed + 1000)
    out: dict[str, Any] = {"rounds": rounds, "variants": {}, "corrected_ratio": {}}
    for clock, xs in (("cpu", {n: j.cpu_s for n, j in bare_jobs.items()}), ("wall", wall)):
        rat = _common.ratios(xs, "plain")
        for n in bare_jobs:
            out["variants"].setdefault(n, {})[clock] = {"step_s": _common.summary(xs[n]), "ratio_vs_plain": rat[n]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=["gpt2", "llama"])
    ap.add_argument("--scope", default="all", choices=["attention", "all"])
    ap.add_argument("--policy", default="full", choices=sorted(POLICIES))
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--vocab", type=int, default=None, help="the LM head's size (default: the bench size's, 8192)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=64, help="untimed steps of the protected job first (4 of the others)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reattach", action="store_true",
                    help="attach before each protected step and close after it, untimed (bench/overhead.py's way)")
    ap.add_argument("--bare-control", action="store_true",
                    help="then close the protected job's guard and run the rounds again: its own copy bias")
    ap.add_argument("--no-plain-again", action="store_true",
                    help="leave out the second unprotected copy: two models in rotation instead of three")
    ap.add_argument("--tiny", action="store_true", help="the smoke test's size: seconds, not minutes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    size = dict(SIZES["tiny" if args.tiny else "full"])
    if args.vocab is not None:
        size["vocab"] = args.vocab
    res = run(args.model, size, scope=args.scope, policy=args.policy, optimizer=args.optimizer,
              rounds=args.rounds, warmup=2 if args.tiny else args.warmup, seed=args.seed, reattach=args.reattach,
              bare_control=args.bare_control, plain_again=not args.no_plain_again)
    rows = []
    for n, e in res["variants"].items():
        c, w = e["cpu"]["ratio_vs_plain"], e["wall"]["ratio_vs_plain"]
        rows.append([n, e["cpu"]["step_s"]["median"] * 1e3, _common.pct(c["median"]),
                     f"[{_common.pct(c['p25'])}, {_common.pct(c['p75'])}]", _common.pct(w["median"])])
    print(f"{args.model} {size}, scope={args.scope}, policy={args.policy}, {args.optimizer}, attached once, "
          f"{res['rounds']} interleaved rounds after {res['warmup_steps']} warm-up steps; overhead = median of "
          "per-round ratios to plain [IQR]")
    print(_common.table(rows, ["variant", "CPU ms/step", "overhead (CPU)", "IQR (CPU)", "overhead (wall)"]))
    print(f"check time (host, in the guard's checks): {res['check_s_per_step']['median'] * 1e3:.1f} ms/step")
    if "bare_control" in res:
        b = res["bare_control"]
        bare = b["variants"]["protected_bare"]["cpu"]["ratio_vs_plain"]
        print(f"bare control ({b['rounds']} rounds, guard closed): the protected copy unprotected "
              f"{_common.pct(bare['median'])} [{_common.pct(bare['p25'])}, {_common.pct(bare['p75'])}]; "
              f"overhead with its copy bias taken out {_common.pct(b['corrected_ratio']['cpu'])} (CPU)")
    path = _common.write_result("attached_overhead", res, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
