"""Recovery cost: in-line ABFT correction vs checkpoint/restore (ATTNChecker's "up to 49x", paper section 6).

In-line: the extra time of a protected training step (Policy.full()) in which a fault is injected and corrected,
over a clean protected step, both interleaved in the same rounds. Measured two ways: the step-time difference (median
of per-round differences) and the engine's own check time (OpStats.check_seconds, which includes locate/correct/
recompute); the ratio uses the larger, so noise cannot flatter it.

Checkpoint/restore: torch.save of model + AdamW state to a file, torch.load + load_state_dict back, plus replaying
the steps lost since the last checkpoint. A fault is equally likely anywhere in an interval of N steps, so the
expected replay is N/2 unprotected steps (the worst case is N); we use N/2 and report N too. The paper's own metric
(save + load, no replay) is reported alongside.

    python bench/recovery.py [--model gpt2] [--rounds 4] [--intervals 10,100] [--tiny]
"""
from __future__ import annotations

import argparse
import copy
import functools
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common
import overhead
import torch

import attnchecker
from attnchecker import Policy
from attnchecker.inject import Fault, FaultPlan, Injector

# name -> Fault fields (op, kind, pattern, layer as a fraction of the depth). 0d/1d are corrected from the
# checksums; 2d is recomputed (the ladder's second rung).
SCENARIOS: dict[str, dict[str, Any]] = {
    "scores_inf_0d": {"op": "scores", "kind": "inf", "pattern": "0d", "layer": 0.0},
    "context_nan_1d": {"op": "context", "kind": "nan", "pattern": "1d", "layer": 0.5},
    "q_near_inf_0d": {"op": "q", "kind": "near_inf", "pattern": "0d", "layer": 1.0},
    "scores_inf_2d": {"op": "scores", "kind": "inf", "pattern": "2d", "layer": 0.0},
}


class Protected:
    """One protected model (Policy.full()) that every scenario steps in turn: the injector is swapped before each
    step, so a faulty step and a clean one run on the same tensors in the same memory (separate model copies differ
    by a few percent from each other, more than a correction costs)."""

    def __init__(self, base: torch.nn.Module, batch: torch.Tensor, layers: int) -> None:
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batch = batch
        self.layers = layers
        self.guard = attnchecker.protect(self.model, policy=Policy.full(), faults=FaultPlan([]))
        self.rec: dict[str, dict[str, Any]] = {}

    def _faults(self, scenario: str, step: int) -> list[Fault]:
        if scenario == "clean":
            # Same machinery as the faulty steps (an injector that is consulted), nothing planned on this step.
            return [Fault(op="scores", kind="inf", layer=0, step=step + 10**9)]
        s = SCENARIOS[scenario]
        return [Fault(op=s["op"], kind=s["kind"], pattern=s["pattern"], layer=round(s["layer"] * (self.layers - 1)),
                      step=step, seed=step)]

    def step(self, scenario: str) -> float:
        self.guard.injector = Injector(FaultPlan(self._faults(scenario, self.guard.step_count)))
        before = self.guard.report()
        c0, t0 = time.process_time(), time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        stats = self.guard.step_stats
        self.guard.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        after = self.guard.report()
        r = self.rec.setdefault(scenario, {"cpu_s": [], "check_s": [], "corrected": 0, "uncorrectable": 0,
                                           "losses_finite": True})
        r["cpu_s"].append(dc)
        r["check_s"].append(sum(stats.check_seconds.values()) if stats is not None else 0.0)
        r["corrected"] += after.corrected - before.corrected
        r["uncorrectable"] += after.uncorrectable - before.uncorrectable
        r["losses_finite"] &= bool(torch.isfinite(loss.detach()))  # sync: outside the timed region
        return dt


def checkpoint_costs(model: torch.nn.Module, opt: torch.optim.Optimizer, reps: int) -> dict[str, Any]:
    """torch.save / torch.load of model + optimizer state: to a file (what a job restart reads), and to memory
    (the best case, an in-RAM checkpoint as in Gemini/CheckFreq)."""
    out: dict[str, list[float]] = {"save_file_s": [], "load_file_s": [], "save_mem_s": [], "load_mem_s": []}
    size = 0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt.pt"
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
            out["save_file_s"].append(time.perf_counter() - t0)
            size = path.stat().st_size
            t0 = time.perf_counter()
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            out["load_file_s"].append(time.perf_counter() - t0)
            buf = io.BytesIO()
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
            out["save_mem_s"].append(time.perf_counter() - t0)
            buf.seek(0)
            t0 = time.perf_counter()
            state = torch.load(buf, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            out["load_mem_s"].append(time.perf_counter() - t0)
    res: dict[str, Any] = {k: _common.summary(v) for k, v in out.items()}
    res["bytes"] = size
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ckpt-reps", type=int, default=3)
    p.add_argument("--intervals", default="10,100", help="checkpoint intervals in steps")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (see overhead.py); 0 = torch's choice")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    size = overhead.SIZES["tiny" if a.tiny else "full"]
    scenarios = [s for s in a.scenarios.split(",") if s]
    intervals = [int(x) for x in a.intervals.split(",") if x]
    base = overhead.build_model(a.model, size)
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0))
    own = copy.deepcopy(base)
    unprotected = overhead.Variant("baseline", (own, torch.optim.AdamW(own.parameters(), lr=1e-5)), batch,
                                   tiny_batch=batch[:1, :8])
    prot = Protected(base, batch, size["layers"])
    fns = {"baseline": unprotected.step, **{n: functools.partial(prot.step, n) for n in ("clean", *scenarios)}}
    samples = _common.interleaved(fns, rounds=a.rounds, warmup=1)

    clean = prot.rec["clean"]
    # The replayed steps are unprotected steps; wall time, because replay is what the job waits for.
    base_step = _common.summary(samples["baseline"])["median"]
    ckpt = checkpoint_costs(unprotected.model, unprotected.opt, a.ckpt_reps)
    save_load_file = ckpt["save_file_s"]["median"] + ckpt["load_file_s"]["median"]
    save_load_mem = ckpt["save_mem_s"]["median"] + ckpt["load_mem_s"]["median"]
    result: dict[str, Any] = {
        "model": a.model, "size": size, "rounds": a.rounds, "size_name": "tiny" if a.tiny else "full",
        "unprotected_step_s": _common.summary(samples["baseline"]),
        "clean_protected_step_s": _common.summary(samples["clean"]),
        "checkpoint": ckpt,
        "replay_steps": "interval/2 (expected; worst case = interval)",
        "scenarios": {},
    }
    rows = []
    for s in scenarios:
        r = prot.rec[s]
        # CPU time of this process (see overhead.py): the extra work of the faulty step, not the neighbours' noise.
        diffs = [x - y for x, y in zip(r["cpu_s"][1:], clean["cpu_s"][1:], strict=True)]
        wall_diffs = [x - y for x, y in zip(samples[s], samples["clean"], strict=True)]
        # Skip the warm-up round's check time, like the step samples.
        check_extra = [x - y for x, y in zip(r["check_s"][1:], clean["check_s"][1:], strict=True)]
        step_extra = statistics.median(diffs)
        engine_extra = statistics.median(check_extra)
        cost = max(step_extra, engine_extra)
        basis = "median"
        if cost <= 0:
            # The correction costs less than the step-to-step noise: take the upper quartile instead, and if even
            # that is not positive, the spread of the differences (the smallest cost this run could resolve). Both
            # overstate the cost, so the ratio is a lower bound rather than a division by noise.
            d, c = _common.summary(diffs), _common.summary(check_extra)
            cost, basis = max(d["p75"], c["p75"]), "p75 (median within noise)"
            if cost <= 0:
                cost, basis = max(d["p75"] - d["p25"], c["p75"] - c["p25"], 1e-3), "IQR of the differences (p75 <= 0)"
        entry: dict[str, Any] = {
            "step_extra_s": _common.summary(diffs),
            "step_extra_wall_s": _common.summary(wall_diffs),
            "check_extra_s": _common.summary(check_extra),
            "inline_cost_s": cost,
            "inline_cost_basis": basis,
            "corrected": r["corrected"],
            "uncorrectable": r["uncorrectable"],
            "losses_finite": r["losses_finite"],
            "ratio_paper_file": save_load_file / cost if cost > 0 else None,
            "ratio_paper_mem": save_load_mem / cost if cost > 0 else None,
            "intervals": {},
        }
        for n in intervals:
            cr_expected = save_load_file + n / 2 * base_step
            cr_worst = save_load_file + n * base_step
            entry["intervals"][str(n)] = {
                "checkpoint_restore_s": cr_expected,
                "checkpoint_restore_worst_s": cr_worst,
                "checkpoint_restore_mem_s": save_load_mem + n / 2 * base_step,
                "ratio": cr_expected / cost if cost > 0 else None,
                "ratio_mem": (save_load_mem + n / 2 * base_step) / cost if cost > 0 else None,
            }
        result["scenarios"][s] = entry
        rows.append([s, step_extra * 1e3, engine_extra * 1e3, f"{r['corrected']}/{r['uncorrectable']}",
                     r["losses_finite"], entry["ratio_paper_file"] or float("nan"),
                     *(entry["intervals"][str(n)]["ratio"] or float("nan") for n in intervals)])
    prot.guard.close()
    print(f"\n{a.model} ({'tiny' if a.tiny else 'full'} size): unprotected step {base_step * 1e3:.0f} ms, clean "
          f"protected step {result['clean_protected_step_s']['median'] * 1e3:.0f} ms; checkpoint "
          f"{ckpt['bytes'] / 2**20:.1f} MiB: save {ckpt['save_file_s']['median'] * 1e3:.0f} ms + load "
          f"{ckpt['load_file_s']['median'] * 1e3:.0f} ms (file), {save_load_mem * 1e3:.0f} ms (memory)")
    print(_common.table(rows, ["fault", "step extra ms (CPU)", "check extra ms", "corrected/uncorr.", "loss finite",
                               "C/R(save+load) / inline", *(f"C/R@{n} / inline" for n in intervals)]))
    path = _common.write_result("recovery", result, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
