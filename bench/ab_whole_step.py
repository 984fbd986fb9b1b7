"""A/B the whole-step check path of two engine versions in one process, interleaved: protect(scope="all") with
Policy.full() using this checkout's gemm.check / attention.backward.checked / checksum helpers ("new") against those
files as they were at another revision ("old", read with `git show REV:path`), plus the unprotected baseline. CPU time
of this process per step, median of per-round ratios to the baseline [IQR]: the comparison that survives a loaded shared
machine, where separate runs differ by more than the change.

    python bench/ab_whole_step.py REV [--models gpt2] [--rounds 6] [--tiny] [--out PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import overhead as ov
import torch

import attnchecker
import attnchecker.abft.checksum as checksum_new
import attnchecker.abft.gemm
import attnchecker.attention.backward.checked as attention_backward_new
import attnchecker.attention.backward.fused
import attnchecker.attention.pipeline
import attnchecker.gemm.check as gemm_check_new
import attnchecker.gemm.linear
import attnchecker.gemm.projection
from attnchecker import Policy

# Modules swapped as a whole (the functions the whole-step path calls from them): key -> (module in the package, its
# file). REV must have the agent's layout in folders (f240a9d or later): an older file's relative imports name modules
# that no longer exist.
SWAPPED = {"abft.checksum": ("abft.checksum", "agent/attnchecker/abft/checksum.py"),
           "gemm_check": ("gemm.check", "agent/attnchecker/gemm/check.py"),
           "attention_backward": ("attention.backward.checked", "agent/attnchecker/attention/backward/checked.py")}
NAMES = ("weighted_rows", "times_skinny", "check_gemms", "linear_sums", "checked_backward")


def _load_old(rev: str, tmp: Path) -> dict[str, ModuleType]:
    out = {}
    for key, (mod, path) in SWAPPED.items():
        src = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=_common.ROOT, check=True, capture_output=True,
                             text=True).stdout
        file = tmp / f"{key.replace('.', '_')}.py"
        file.write_text(src)
        # Named inside the package, so its relative imports resolve to this checkout's other modules.
        spec = importlib.util.spec_from_file_location(f"attnchecker.{mod}_old", file)
        assert spec is not None and spec.loader is not None
        m = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = m
        spec.loader.exec_module(m)
        out[key] = m
    # The old attention backward calls the old check_gemms.
    out["attention_backward"].check_gemms = out["gemm_check"].check_gemms  # type: ignore[attr-defined]
    return out


def _swapper(old: dict[str, ModuleType]) -> Any:
    old_check_gemms = old["gemm_check"].check_gemms
    takes_given = "given" in inspect.signature(old_check_gemms).parameters

    def old_checks(ctx: Any, gemms: Any, *, tier: str = "abft", **given: Any) -> Any:
        # An older check_gemms takes no operand sums: the linear layer then makes none (``no_sums``) and it reads
        # every operand itself, as it did.
        return old_check_gemms(ctx, gemms, tier=tier, **(given if takes_given else {}))

    def no_sums(*_args: Any, **_kwargs: Any) -> None:
        return None

    pairs = {
        "weighted_rows": (checksum_new.weighted_rows, old["abft.checksum"].weighted_rows),
        "times_skinny": (checksum_new.times_skinny, old["abft.checksum"].times_skinny),
        "check_gemms": (gemm_check_new.check_gemms, old_checks),
        "linear_sums": (gemm_check_new.linear_sums, old["gemm_check"].linear_sums if takes_given else no_sums),
        "checked_backward": (attention_backward_new.checked_backward, old["attention_backward"].checked_backward),
    }
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("attnchecker") and not n.endswith("_old")]

    def use(which: str) -> None:
        i = 0 if which == "new" else 1
        for m in mods:
            for name, pair in pairs.items():
                if getattr(m, name, None) in pair:
                    setattr(m, name, pair[i])

    return use


def run_model(arch: str, size: dict[str, int], rounds: int, use: Any) -> dict[str, Any]:
    model = ov.build_model(arch, size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0))

    def step(name: str) -> tuple[float, dict[str, float]]:
        guard = None if name == "baseline" else attnchecker.protect(model, policy=Policy.full(), scope="all")
        use("old" if name == "all_full_old" else "new")
        c0 = time.process_time()
        opt.zero_grad(set_to_none=True)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        dt = time.process_time() - c0
        checks = dict(guard.step_stats.check_seconds) if guard is not None and guard.step_stats else {}
        if guard is not None:
            guard.step()
            guard.close()
        return dt, checks

    names = ["baseline", "all_full_old", "all_full_new"]
    for n in names:
        step(n)  # warm-up
    cpu: dict[str, list[float]] = {n: [] for n in names}
    checks: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(names)
        for n in names:
            dt, cs = step(n)
            cpu[n].append(dt)
            checks[n].append(cs)
    ratios = _common.ratios(cpu, "baseline")
    variants = {}
    for n in ("baseline", "all_full_old", "all_full_new"):
        ops = sorted({op for c in checks[n] for op in c})
        variants[n] = {"step_s": _common.summary(cpu[n]), "ratio_vs_baseline": ratios[n], "samples_s": cpu[n],
                       "check_s_per_step": {op: statistics.median(c.get(op, 0.0) for c in checks[n]) for op in ops}}
    return {"model": arch, "size": size, "rounds": rounds, "clock": "process CPU time", "variants": variants}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare against (e.g. main)")
    p.add_argument("--models", default="gpt2")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="the smoke-test size (seconds)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/ab_whole_step.json)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        use = _swapper(_load_old(a.rev, Path(tmp)))
        results = []
        for arch in a.models.split(","):
            res = run_model(arch, ov.SIZES["tiny" if a.tiny else "full"], a.rounds, use)
            rows = [[n, e["step_s"]["median"] * 1e3, _common.pct(e["ratio_vs_baseline"]["median"]),
                     f"[{_common.pct(e['ratio_vs_baseline']['p25'])}, {_common.pct(e['ratio_vs_baseline']['p75'])}]",
                     f"{sum(e['check_s_per_step'].values()) * 1e3:.0f}"] for n, e in res["variants"].items()]
            print(f"\n{arch}: {a.rounds} interleaved rounds, scope='all' Policy.full(), old = {a.rev}")
            print(_common.table(rows, ["variant", "CPU ms/step", "vs baseline", "IQR", "check ms/step (wall)"]))
            results.append(res)
    path = _common.write_result("ab_whole_step", {"before": a.rev, "size_name": "tiny" if a.tiny else "full",
                                                  "models": results}, a.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
