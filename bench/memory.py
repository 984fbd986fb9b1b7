"""Peak memory (and step time) of a protected training step against the unprotected one, per sequence length
(issue 12: tiled protected attention).

Model: the issue's GPT-2 stack, 2 layers, n_embd 256, 8 heads, B = 1, vocab 8192 (as bench/overhead.py: GPT-2's
50257 would make the LM head's T × vocab logits the largest tensor at every T and hide the attention's memory).
One training step = forward + backward + AdamW step.

Variants:
  baseline  unprotected, attn_implementation="sdpa" (the fused flash kernel: no T×T tensor)
  tiled     attnchecker.protect(model, policy=Policy.full()) with ATTNCHECKER_ATTENTION=tiled: the native pass
            (kernels/fused_attention.py) where it applies, as a user gets it
  tiled_torch  the same with the native pass off (fused_attention.enabled = False): the PyTorch tile loop
  unfused   the same with ATTNCHECKER_ATTENTION=unfused (the checked path that holds AS and AP, B·H·T·S each)
  tiled_all protect(model, policy=Policy.full(), scope="all") on the tiled path: every Linear GEMM checked too, and
            the attention backward checked on the fused kernel with encoded operands (its recovery: the checked
            products, a block of query rows at a time)

Memory: each measurement is a fresh process (`--child`), so no allocator cache or earlier peak leaks into the next.
The child builds the model, runs one warm-up step (AdamW's state and the gradients exist from then on), then resets
the kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs, Linux >= 4.0; glibc's malloc_trim first, so the
resident size before the step counts live memory only), runs the measured step and reads
VmHWM from /proc/self/status. `step_mb` = that peak minus the resident size just before the step: what one training
step needs on top of the model, its gradients and optimizer state, for every tensor the step allocates (torch's CPU
allocator returns large blocks to the OS on free, so RSS follows live tensors). `process_mb` is the whole process's
peak (Python, torch, the model). Why RSS and not a tensor counter: it is what the OOM killer and a job's memory
limit see, and it counts what no tensor hook would (autograd buffers, kernel workspaces).

Time (`--time`): in one process per T, the three variants are stepped in interleaved, shuffled rounds
(bench/_common.py); each step's process CPU time (1 torch thread), and the overhead is the median of per-round
ratios against the baseline.

    python bench/memory.py [--seqs 1024,2048,4096,8192,16384] [--repeats 3] [--unfused-max 4096]
                           [--time | --time-only] [--time-seqs 1024,2048,4096 --rounds 3] [--padded] [--tiny]
                           [--out PATH]
                           [--variants baseline,tiled,tiled_torch,unfused,tiled_all]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

VARIANTS = ("baseline", "tiled", "tiled_torch", "unfused", "tiled_all")
PATHS = {"baseline": "auto", "tiled": "tiled", "tiled_torch": "tiled", "unfused": "unfused", "tiled_all": "tiled"}
"""ATTNCHECKER_ATTENTION per variant."""
SIZES = {
    "full": {"hidden": 256, "heads": 8, "layers": 2, "batch": 1, "vocab": 8192},
    "tiny": {"hidden": 32, "heads": 4, "layers": 2, "batch": 1, "vocab": 64},
}


def _build(size: dict[str, int], seq: int, variant: str, device: str = "cpu", padded: bool = False
           ) -> tuple[Any, Any, Any, Any]:
    """(model, optimizer, batch (the model's keyword arguments), guard or None) for one variant; the path is forced
    through the environment. padded: the last eighth of the tokens are padding (attention_mask 0, labels -100), as a
    fine-tuning batch has: transformers then hands SDPA a 4-D mask, causal and padding together."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=size["vocab"], n_positions=seq, n_embd=size["hidden"], n_layer=size["layers"],
                     n_head=size["heads"], attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.set_attn_implementation("sdpa")
    model.train().to(device)
    guard = None
    if variant != "baseline":
        import attnchecker
        from attnchecker import Policy

        os.environ["ATTNCHECKER_ATTENTION"] = PATHS[variant]
        _native(variant)
        guard = attnchecker.protect(model, policy=Policy.full(), scope="all" if variant == "tiled_all" else "attention")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, size["vocab"], (size["batch"], seq), generator=torch.Generator().manual_seed(1)).to(device)
    batch = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones_like(ids)
        mask[:, seq - seq // 8:] = 0
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return model, opt, batch, guard


def _native(variant: str) -> None:
    """The native attention pass on, except for the variant that prices the PyTorch tile loop beside it."""
    from attnchecker.kernels import fused_attention

    fused_attention.enabled = variant != "tiled_torch"


def _step(model: Any, opt: Any, batch: Any, guard: Any) -> float:
    """One training step; returns its process CPU time (on this shared machine wall time also counts the other
    tenants' time slices; docs/performance.md, method)."""
    t0 = time.process_time()
    opt.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    if guard is not None:
        guard.step()
    return time.process_time() - t0


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(variant: str, seq: int, size: dict[str, int]) -> dict[str, Any]:
    import ctypes
    import gc

    model, opt, batch, guard = _build(size, seq, variant)
    _step(model, opt, batch, guard)
    opt.zero_grad(set_to_none=True)
    gc.collect()
    # Hand freed heap back to the OS, so that "before" counts live memory, not what glibc kept from the warm-up step.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before_kb = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    seconds = _step(model, opt, batch, guard)
    peak_kb = _status_kb("VmHWM")
    stats: dict[str, Any] = {}
    if guard is not None:
        # Clean data: a protected step must flag nothing (0 false positives), and must really have checked.
        rep = guard.report()
        stats = {"detected": rep.detected, "scores_checks": rep.checks.get("scores", 0)}
        guard.close()
    return {"variant": variant, "seq": seq, "step_mb": (peak_kb - before_kb) / 1024, "process_mb": peak_kb / 1024,
            "before_mb": before_kb / 1024, "step_s": seconds, **stats}


def measure(variant: str, seq: int, tiny: bool) -> dict[str, Any]:
    """One measurement in a fresh process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--seq", str(seq)]
    if tiny:
        cmd.append("--tiny")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=_common.ROOT)
    if proc.returncode != 0:
        return {"variant": variant, "seq": seq, "error": (proc.stderr or proc.stdout)[-800:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def time_section(seqs: list[int], rounds: int, size: dict[str, int], variants: tuple[str, ...] = VARIANTS,
                 padded: bool = False) -> list[dict[str, Any]]:
    """Step time per variant, interleaved in one process per T (memory is measured elsewhere); padded: a padded
    batch (``_build``)."""
    import torch

    out = []
    for seq in seqs:
        built = {v: _build(size, seq, v, padded=padded) for v in variants}

        def runner(v: str, variant_built: tuple[Any, Any, Any, Any]) -> Any:
            def go() -> float:
                # The path is chosen per call from the environment: set it for the variant being stepped.
                os.environ["ATTNCHECKER_ATTENTION"] = PATHS[v]
                _native(v)
                return _step(*variant_built)

            return go

        samples = _common.interleaved({v: runner(v, built[v]) for v in variants}, rounds=rounds, warmup=1, seed=seq)
        ratios = _common.ratios(samples, "baseline")
        out.append({"seq": seq, "threads": torch.get_num_threads(), "padded": padded,
                    "variants": {v: {"step_s": _common.summary(samples[v]), "samples_s": samples[v],
                                     "ratio_vs_baseline": ratios[v]} for v in variants}})
        del built
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384", help="sequence lengths for memory")
    ap.add_argument("--repeats", type=int, default=3, help="fresh-process measurements per (variant, T)")
    ap.add_argument("--unfused-max", type=int, default=4096,
                    help="largest T for the unfused variant (its T×T tensors: 8 heads × 8192² × 4 B = 2 GB each)")
    ap.add_argument("--single-above", type=int, default=8192,
                    help="above this T, one measurement per variant (a step takes minutes on one core)")
    ap.add_argument("--time", action="store_true", help="also measure step time, interleaved")
    ap.add_argument("--time-only", action="store_true", help="only the step-time section")
    ap.add_argument("--time-seqs", default="1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--padded", action="store_true", help="time a padded batch (the last eighth of the tokens "
                    "padding: SDPA gets a 4-D mask, not is_causal)")
    ap.add_argument("--tiny", action="store_true", help="small model and T (the smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; baseline is always measured")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "full"]
    variants = tuple(v for v in VARIANTS if v == "baseline" or v in args.variants.split(","))
    unknown = set(args.variants.split(",")) - set(VARIANTS) - {""}
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    import torch

    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, args.seq, size)))
        return 0
    seqs = [] if args.time_only else [64] if args.tiny else [int(s) for s in args.seqs.split(",")]
    unfused_max = 128 if args.tiny else args.unfused_max
    jobs = [(v, t) for t in seqs for v in variants if not (v == "unfused" and t > unfused_max)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {job: [] for job in jobs}
    rng = random.Random(0)
    for r in range(args.repeats):
        order = [job for job in jobs if r == 0 or job[1] <= args.single_above]
        rng.shuffle(order)  # interleaved: every (variant, T) once per round, in a new order
        for v, t in order:
            res = measure(v, t, args.tiny)
            runs[(v, t)].append(res)
            print(f"  {v:8s} T={t:6d}: " + (f"step {res['step_mb']:.0f} MB, process {res['process_mb']:.0f} MB, "
                                            f"{res['step_s']:.1f} s" if "error" not in res else "FAILED"), flush=True)
    results = []
    rows = []
    for t in seqs:
        entry: dict[str, Any] = {"seq": t, "variants": {}}
        for v in variants:
            got = [x for x in runs.get((v, t), []) if "error" not in x]
            if (v, t) not in runs:
                continue
            if not got:
                entry["variants"][v] = {"error": runs[(v, t)][0]["error"]}
                continue
            entry["variants"][v] = {"step_mb": _common.summary([x["step_mb"] for x in got]),
                                    "process_mb": _common.summary([x["process_mb"] for x in got]),
                                    "step_s": _common.summary([x["step_s"] for x in got])}
        base = entry["variants"].get("baseline", {})
        for v, e in entry["variants"].items():
            if "step_mb" in e and "step_mb" in base:
                e["step_ratio_vs_baseline"] = e["step_mb"]["median"] / base["step_mb"]["median"]
                e["process_ratio_vs_baseline"] = e["process_mb"]["median"] / base["process_mb"]["median"]
            rows.append([t, v, e.get("step_mb", {}).get("median", float("nan")),
                         e.get("step_ratio_vs_baseline", float("nan")),
                         e.get("process_mb", {}).get("median", float("nan")),
                         e.get("process_ratio_vs_baseline", float("nan")),
                         len([x for x in runs[(v, t)] if "error" not in x])])
        results.append(entry)
    if rows:
        print(_common.table(rows, ["T", "variant", "step MB", "x baseline", "process MB", "x baseline", "n"]))
    payload: dict[str, Any] = {"size": size, "method": "fresh process per measurement; VmHWM after clear_refs=5 minus "
                               "VmRSS before the measured (second) step", "memory": results}
    if args.time or args.time_only:
        tseqs = [64] if args.tiny else [int(s) for s in args.time_seqs.split(",")]
        payload["time"] = time_section(tseqs, 2 if args.tiny else args.rounds, size, variants, padded=args.padded)
        trows = [[e["seq"], v, e["variants"][v]["step_s"]["median"], _common.pct(
            e["variants"][v]["ratio_vs_baseline"]["median"]), _common.pct(e["variants"][v]["ratio_vs_baseline"]["p25"]),
            _common.pct(e["variants"][v]["ratio_vs_baseline"]["p75"])] for e in payload["time"] for v in variants]
        print(_common.table(trows, ["T", "variant", "step s", "overhead", "p25", "p75"]))
    path = _common.write_result("memory", payload, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
