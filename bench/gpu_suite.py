"""The device script: what to run, in one command of at most 8 minutes, the first time a GPU is at hand.

It saves what has finished after every section and step row (beside --out, as *.partial.json, removed once the
whole result is written), and a row that breaks records its traceback and lets the next row run.

    python bench/gpu_suite.py [--out docs/perf/gpu_suite.json] [--budget-s 460]
    python bench/gpu_suite.py --dry-run        # on a CPU: Triton's interpreter, tiny sizes, every section end to end
    python bench/gpu_suite.py --sections profile,kernel   # some sections only (a second call on a warm machine)

On a copy of the tree whose git metadata is not the tree's (a lent machine), name the commit:
ATTNCHECKER_GIT_COMMIT=<hash> python bench/gpu_suite.py ...; the JSON's machine.git_commit then reads it.

Sections, in order (each records its own wall time; one that would pass the budget is skipped and says so):
1. tests: the `gpu`-marked tests that are not `slow` (pytest -m "gpu and not slow"), their outcome and counts; the
   slow ones run a bench in a subprocess for minutes and are left to `pytest -m "gpu and slow"`.
2. steps: training-step time (forward, backward, SGD step; CUDA-synchronised, interleaved shuffled rounds, median of
   per-round ratios) and peak memory (torch.cuda.max_memory_allocated over a step) of protection against the
   unprotected step, bf16, on a GPT-2-small-like (hidden 768, 12 heads) and a Llama-7B-like (hidden 4096, 32 heads,
   SwiGLU 11008) transformers model of 2 layers, at T = 2048 and 8192, B = 1. Variants: `baseline` (unprotected,
   attn_implementation="sdpa": PyTorch picks its best backend), `full` (Policy.full(): every op every step),
   `default` (Policy(): tier 1 every step, full checks on the adaptive schedule, measured after warming up past the
   schedule's ramp over whole periods), `all_full` and `all_default` (the same under scope="all": every Linear GEMM
   forward and backward and the attention backward too). Each row says which attention backend ran.
3. kernel: the Triton checked-attention forward with its checks against the same kernel with checks off (the cost of
   the checks inside the kernel), where the Triton backend is installed; the scores' and the context's checks each
   alone and both without the repair launch (where the full checks' cost lies), and SDPA's forward.
   vendor_residuals: bench/vendor_residuals.py, the vendor kernels' clean outputs against the identities a full check
   over them would test, in fp64 (no timing; at most VENDOR_RESIDUALS_S of the budget); under "backward",
   bench/vendor_backward_residuals.py, their clean gradients against a check over their backward's (at most
   VENDOR_BACKWARD_RESIDUALS_S more).
   backward_kernel: the same for the Triton backward (kernels/triton_attention_bwd.py): check "abft" (its repair
   launch included), "abft_fp32_refs" (the same with every reference an fp32 sum) and "tripwire" against "off",
   SDPA's backward, and what a tier-1 step without dropout runs (SDPA's forward again and its backward, the tier-1
   pass over its gradients, the repair launches) over SDPA's.
   gemm_check: the GEMM checks' Triton path alone (bench/triton_gemm_check.py's ``timing``), bf16, at Llama-7B's
   projection and MLP shapes and GPT-2's MLP (M = 8192 tokens): the GEMM (cuBLAS), its full check with the rows in
   runs and with one pair a row (what the runs cost: their operand passes' wider tl.dot), and tier 1, each against
   the GEMM (issue 32 put a check that reads its operands 2 to 4 times at 15 to 30 % of the GEMM).
   attribution: where a protected step's time goes, against the unprotected one (torch.profiler over a few steps
   of each model at T = 2048): device time in all kernels and in attnchecker's Triton kernels, kernel launches, host
   time in ops and in the driver's launch calls, the top kernels; the default policies on their tier-1 steps (what
   7 steps in 8 run). Says whether the default's overhead is device work or the host launching it; and the host
   time one call of a GEMM's tier 1 costs (its memset and launch) against one aten op's.
4. coverage: the share of a step's GEMM FLOPs each scope checks (torch.utils.flop_counter over one unprotected
   step: the attention core's products against the projections', the MLP's and the LM head's).
   tiles: the attention kernels (forward and backward, checks off and on) at head dims 128 and 256, at the tiles
   each GPU class takes (99 KB of shared memory a block, an A100's 163 KB, this GPU's), timed against each other,
   and the forward on 128-row tiles too (FORWARD_TILES_TRIED), which no launcher choice takes yet.
5. profile: Nsight Compute on the checked forward kernel (off, tier 1, full checks, each with its repair launch) at
   B, H, T, D = 1, 32, 8192, 128: occupancy, issue stalls, instructions executed, spill traffic, where ncu can read
   the GPU's counters (not in every virtual machine: the section then records ncu's error). The raw CSV lands beside
   the JSON.

Targets (docs/performance.md states them with the measured figures): full protection <= 1.10x the unprotected step at
T >= 2048 in bf16, the default policy <= 2 %, peak memory <= 1.05x, checks inside the kernel <= 5 % of the kernel;
scope="all" full <= 1.15x and default <= 3 %.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

ROOT = Path(__file__).resolve().parents[1]

SHAPES: dict[str, dict[str, int]] = {
    "gpt2_small": {"hidden": 768, "heads": 12, "inter": 3072},
    "llama_7b": {"hidden": 4096, "heads": 32, "inter": 11008},
}
DRY_SHAPES: dict[str, dict[str, int]] = {
    "gpt2_small": {"hidden": 64, "heads": 2, "inter": 256},
    "llama_7b": {"hidden": 64, "heads": 2, "inter": 176},
}
LAYERS, VOCAB = 2, 8192
VARIANTS = ("baseline", "full", "default", "all_full", "all_default")


def _model(kind: str, shape: dict[str, int], seq: int, vocab: int) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2_small":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=shape["hidden"],
                                           n_layer=LAYERS, n_head=shape["heads"], n_inner=shape["inter"],
                                           attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=shape["hidden"],
                                             intermediate_size=shape["inter"], num_hidden_layers=LAYERS,
                                             num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
                                             max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                                             pad_token_id=0))
    model.set_attn_implementation("sdpa")
    return model.train()


class _Sync:
    """Wall time of a step, the device drained before and after (no-op on a CPU)."""

    def __init__(self, device: str) -> None:
        import torch

        self.sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @contextlib.contextmanager
    def timed(self, into: list[float]) -> Iterator[None]:
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        into.append(time.perf_counter() - t0)


class _Job:
    """One model copy, its optimizer and (for a protected variant) its guard, attached once."""

    def __init__(self, variant: str, base: Any, device: str, dtype: Any) -> None:
        import copy

        import torch

        import attnchecker
        from attnchecker import Policy

        self.model = copy.deepcopy(base).to(device=device, dtype=dtype)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.guard = None
        self.overheads: list[float] = []
        """The guard's own check time / step time per step (its full checks' device time on CUDA)."""
        if variant != "baseline":
            policy = Policy.full() if variant.endswith("full") else Policy()
            self.guard = attnchecker.protect(self.model, optimizer=self.opt, policy=policy,
                                             scope="all" if variant.startswith("all") else "attention")

    def step(self, ids: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        if self.guard is not None and self.guard.last_overhead_ratio is not None:
            self.overheads.append(self.guard.last_overhead_ratio)

    def backends(self) -> list[str]:
        return [] if self.guard is None else self.guard.coverage.backend_lines()

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


def steps_section(args: argparse.Namespace, device: str, deadline: float, rows: list[dict[str, Any]],
                  save: Callable[[], None]) -> list[dict[str, Any]]:
    """Fills ``rows`` (one per model and length, the shorter length of every model first) and calls ``save`` after
    each, so a run cut short keeps the rows it finished."""
    import torch

    from attnchecker import Policy

    dtype = torch.bfloat16
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    seqs = [32] if args.dry_run else [int(s) for s in args.seqs.split(",")]
    timer = _Sync(device)
    for seq in seqs:
        for kind, shape in shapes.items():
            if time.monotonic() > deadline:
                rows.append({"model": kind, "seq": seq, "skipped": "over the time budget"})
                save()
                continue
            t0 = time.monotonic()
            base = _model(kind, shape, seq, 256 if args.dry_run else VOCAB)
            ids = torch.randint(0, 256 if args.dry_run else VOCAB, (1, seq), device=device,
                                generator=torch.Generator(device=device).manual_seed(seq))
            row: dict[str, Any] = {"model": kind, "seq": seq, "shape": shape, "variants": {}}
            jobs: dict[str, _Job] = {}
            try:
                for v in VARIANTS:
                    jobs[v] = _Job(v, base, device, dtype)
                # Warm-up: kernels compiled and autotuned, allocator settled, and the default policy past its ramp
                # (period 1 -> max_period takes 56 quiet steps, docs/adaptive.md).
                ramp = 2 if args.dry_run else 64
                last: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for v, job in jobs.items():
                    for _ in range(ramp if v.endswith("default") else 2):
                        _timed(timer, job, ids, last[v])
                # Whole periods of the default schedule, so checked and tier-1-only steps come in their proportion;
                # fewer where the rounds would run past the budget (a round: one step of every variant).
                period = Policy().max_period
                rounds = 1 if args.dry_run else period * args.periods
                # From each variant's last warm-up step: the first ones compile and autotune (a minute at T = 2048 on
                # the first H200 run, which cut those rows to 3 rounds when their worst was taken).
                round_s = sum(xs[-1] for xs in last.values())
                fit = int((deadline - time.monotonic()) / max(round_s, 1e-9))
                if fit < rounds:
                    rounds = max(3, fit // period * period if fit >= period else fit)
                    row["rounds_cut"] = f"{rounds} rounds fit the budget (a round ~{round_s:.2f} s)"
                row["rounds"] = rounds
                samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
                _common.interleaved({v: functools.partial(_timed, timer, jobs[v], ids, samples[v]) for v in VARIANTS},
                                    rounds=rounds, warmup=0, seed=seq)
                ratios = _common.ratios(samples, "baseline")
                for v, job in jobs.items():
                    row["variants"][v] = {"step_s": _common.summary(samples[v]), "ratio_vs_baseline": ratios[v],
                                          "backends": job.backends(),
                                          "detections": 0 if job.guard is None else len(job.guard.detections)}
                    if job.overheads:
                        # What the guard itself reports (and its overhead budget sees): its full checks' device
                        # time over the step, beside the overhead the rounds measured.
                        row["variants"][v]["guard_overhead_ratio"] = _common.summary(job.overheads[-rounds:])
                if device == "cuda":
                    for v, job in jobs.items():
                        torch.cuda.reset_peak_memory_stats()
                        job.step(ids)
                        torch.cuda.synchronize()
                        row["variants"][v]["peak_bytes"] = torch.cuda.max_memory_allocated()
                    peak = row["variants"]["baseline"]["peak_bytes"]
                    for entry in row["variants"].values():
                        entry["peak_ratio"] = entry["peak_bytes"] / peak
            except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
                row["error"] = f"out of memory: {e}"
            except Exception as e:  # one broken row must not cost the others (the first run on a device is the test)
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = traceback.format_exc()[-3000:]
                print(row["traceback"], file=sys.stderr)
            finally:
                for job in jobs.values():
                    job.close()
                jobs.clear()
                if device == "cuda":
                    torch.cuda.empty_cache()
            row["seconds"] = time.monotonic() - t0
            rows.append(row)
            save()
            _print_steps(row)
    return rows


def _timed(timer: _Sync, job: _Job, ids: Any, into: list[float]) -> float:
    with timer.timed(into):
        job.step(ids)
    return into[-1]


def _print_steps(row: dict[str, Any]) -> None:
    if "variants" not in row or not row["variants"]:
        print(f"{row['model']} T={row['seq']}: {row.get('skipped') or row.get('error')}")
        return
    lines = []
    for v, e in row["variants"].items():
        r = e["ratio_vs_baseline"]
        lines.append([v, e["step_s"]["median"] * 1e3, _common.pct(r["median"]),
                      f"[{_common.pct(r['p25'])}, {_common.pct(r['p75'])}]",
                      f"{e['peak_ratio']:.3f}" if "peak_ratio" in e else "", "; ".join(e["backends"])[:60]])
    print(f"\n{row['model']} T={row['seq']}")
    print(_common.table(lines, ["variant", "ms/step", "overhead", "IQR", "peak mem ratio", "backend"]))


def kernel_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """The Triton forward (kernels/triton_attention.py) with tier 1 and with its full checks (and its repair launch)
    against the same kernel with checks off, and tier 1 and the full checks over the vendor's forward (what a step
    without a mask runs: abft/given_forward.py for the full checks) against that forward, SDPA's and the kernel's
    full checks, bf16, causal, per shape."""
    import torch

    from attnchecker.attention import vendor
    from attnchecker.kernels import triton_attention

    why = triton_attention.not_available_reason(torch.device(device))
    if why is not None:
        return {"skipped": why}
    out: list[dict[str, Any]] = []
    for b, h, t, d in _kernel_shapes(args):
        if time.monotonic() > deadline:
            out.append({"shape": [b, h, t, d], "skipped": "over the time budget"})
            continue
        got = triton_attention.bench_checks(b=b, h=h, t=t, d=d, device=device, causal=True,
                                            reps=1 if args.dry_run else 20, vendor=vendor.forward)
        out.append({"shape": [b, h, t, d], **got})
        print(f"forward kernel B={b} H={h} T={t} D={d}: {got}")
    return {"rows": out}


GEMM_CHECK_SHAPES = ((8192, 4096, 4096), (8192, 4096, 11008), (8192, 11008, 4096), (8192, 768, 3072))
"""(M, K, N) of gemm_check: Llama-7B's q/k/v/o, its MLP up and down, GPT-2's MLP up, at 8192 tokens."""


def gemm_check_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """The GEMM checks' Triton path next to the GEMM it checks (bench/triton_gemm_check.timing), bf16, per shape."""
    import torch
    import triton_gemm_check

    from attnchecker.kernels import triton_gemm_check as tg

    probe = torch.zeros(1, 1, device=device, dtype=torch.bfloat16)
    if not tg.takes(probe):
        return {"skipped": "the GEMM checks' Triton path does not take tensors here (no triton, or no CUDA device "
                           "and no TRITON_INTERPRET=1)"}
    shapes = ((64, 64, 512), (64, 64, 64)) if args.dry_run else GEMM_CHECK_SHAPES
    out: list[dict[str, Any]] = []
    for m, k, n in shapes:
        if time.monotonic() > deadline:
            out.append({"shape": [m, k, n], "skipped": "over the time budget"})
            continue
        got = triton_gemm_check.timing(m, k, n, torch.bfloat16, rounds=1 if args.dry_run else 5,
                                       reps=1 if args.dry_run else 10, device=device)
        out.append(got)
        print(f"gemm check M={m} K={k} N={n}, runs={got['runs']}: "
              + ", ".join(f"{name} {r['median']:.2f}x" for name, r in got["ratio_vs_gemm"].items()))
    return {"rows": out}


def _kernel_shapes(args: argparse.Namespace) -> list[tuple[int, int, int, int]]:
    return ([(1, 2, 64, 16)] if args.dry_run else
            [(1, 12, 2048, 64), (1, 12, 8192, 64), (1, 32, 2048, 128), (1, 32, 8192, 128)])


def backward_kernel_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """The Triton checked-attention backward (kernels/triton_attention_bwd.py) with check "abft" (and its repair
    launch) and "tripwire" against the same kernels with checks off, and tier 1 and the full check over SDPA's
    gradients (the identities of kernels/triton_given_backward_check.py) against SDPA's backward, bf16, causal, per
    shape."""
    from attnchecker.kernels import triton_attention_bwd

    if not triton_attention_bwd.available():
        return {"skipped": "Triton cannot run here (no triton, or no CUDA device and no TRITON_INTERPRET=1)"}
    out: list[dict[str, Any]] = []
    for b, h, t, d in _kernel_shapes(args):
        if time.monotonic() > deadline:
            out.append({"shape": [b, h, t, d], "skipped": "over the time budget"})
            continue
        got = triton_attention_bwd.bench_checks(b=b, h=h, t=t, d=d, device=device, reps=1 if args.dry_run else 10)
        out.append({"shape": [b, h, t, d], **got})
        print(f"backward kernel B={b} H={h} T={t} D={d}: {got}")
    return {"rows": out}


SMALL_GPU_SHARED = 101376
"""sm_86 and sm_89's shared memory per block (99 KB): the tiles section times the tiles such a GPU takes."""


TILE_FORMS = (("off", "tier1", "full"), ("off", "tripwire", "abft"))
"""The forms the tiles section times at each choice, forward and backward: the kernel, tier 1 and the full checks.
The kernel and backward_kernel sections split the full checks' cost and time SDPA beside them at the launcher's
tiles; here every form would run 8 calls a round forward and 6 backward, where these run 3, for nothing the choice of
tiles turns on."""
FORWARD_TILES_TRIED = ((128, 64, 8, 3), (128, 128, 8, 2))
"""Forward tiles (query rows, keys, warps, stages) the tiles section times beside the launcher's choices."""


def tiles_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """The attention kernels at the tiles each GPU class takes (kernels' ``gpu_blocks`` and ``gpu_tiles`` for 99 KB,
    163 KB and this GPU's shared memory per block), each timed here against the others: what the smaller tiles of a
    99 KB GPU cost, and whether they would pay on this one (at head dim 128 the 64 × 32 forward tiles spill 2.6 KB
    where 64 × 64 spill 8.9 KB, compiled for sm_89 and sm_90). bf16, causal; the forward's and the backward's
    bench_checks at each choice, and each again at the other warp count (4 where the launcher took 8, 8 where it
    took 4; ``gpu_blocks`` for the forward, ``warps_for`` for the backward), the forms of TILE_FORMS each: whether
    fewer warps, which hold a tile fewer times over, pay on the GPU as they do in the compiler's counts; and at head
    dim 64 the backward on 64 × 64 tiles, 4 warps, which issue fewer instructions per score than 32 × 32 but spill."""
    import torch

    from attnchecker.kernels import triton_attention, triton_attention_bwd
    from attnchecker.kernels.triton_common import shared_per_block

    why = triton_attention.not_available_reason(torch.device(device))
    if why is not None:
        return {"skipped": why}
    here = shared_per_block(torch.device(device))
    limits = {"sm_86_89": SMALL_GPU_SHARED, "sm_80": 166912, "here": here}
    # Under the interpreter the GPU's tile choices of head dim 256 at a small head dim: every code path (16 × 16 and
    # 64 × 32 forward tiles, 16 × 16 and 32 × 32 backward ones on 2 and 3 stages, each on both warp counts), in
    # seconds; head dim 128's choices are more of the same tiles' sizes.
    shapes = [(1, 1, 48, 256, 32)] if args.dry_run else [(1, 12, 8192, 64, 64), (1, 32, 4096, 128, 128),
                                                         (1, 16, 4096, 256, 256)]
    rows: list[dict[str, Any]] = []
    for b, h, t, d_tiles, d in shapes:
        forward_choices: dict[tuple[int, ...], list[str]] = {}
        backward_choices: dict[Any, list[str]] = {}
        for name, limit in limits.items():
            blk = triton_attention.gpu_blocks(d_tiles, limit, torch.bfloat16)
            forward_choices.setdefault((blk.m, blk.n, blk.warps, blk.stages), []).append(name)
            # And on the other warp count: on 4 a 64-row tile is one warpgroup's, with about half the instructions
            # over the warps that 8 issue (sm_90 and sm_80 offline, bf16; kernels/triton_attention._four_warps).
            forward_choices.setdefault((blk.m, blk.n, 8 if blk.warps == 4 else 4, blk.stages), [])
            tile = triton_attention_bwd.gpu_tiles(d_tiles, limit)
            backward_choices.setdefault(tile, []).append(name)
            # The other warp count at the same tiles, timed beside it (warps_for chose from the compiler's counts).
            other = 8 if tile.warps != 8 else 4
            backward_choices.setdefault(triton_attention_bwd.Tiles(tile.block, tile.stages, other), [])
            if tile.checked_key_warps is not None:
                # The checked key pass on the passes' own warps too (KEY_PASS_CHECKED_WARPS: from the counts).
                backward_choices.setdefault(triton_attention_bwd.Tiles(tile.block, tile.stages, tile.warps), [])
            if d_tiles <= 64:
                # And 64 × 64 tiles on 4 warps, 2 stages: compiled as launched for sm_90 (bench/triton_kernels.py
                # --mix --block 64) the checked key pass issues 1,983 instructions per 1,000 scores on a tile with
                # no masked element against 4,914 on 32 × 32 (the query pass 3,938 against 5,027), but spills 1.1
                # and 1.6 KB: whether that pays is the GPU's to say. At 128 they spill 2.2 to 3.3 KB and one
                # program holds an SM's shared memory.
                backward_choices.setdefault(triton_attention_bwd.Tiles(64, 2, 4), [])
        if d_tiles <= 128 or args.dry_run:
            # 128 query rows on 8 warps, the tiles Triton's own attention tutorial takes on Hopper, never timed here:
            # the kernel with its checks off is 2.3 to 3.6 times SDPA's forward on 64 × 64 (docs/performance.md §9).
            # Offline (sm_90, bf16, checks off) 128 × 64 issues 7 to 9 % fewer instructions per score and 128 × 128
            # a quarter fewer, without spilling; with the full checks at head dim 128, 128 × 64 issues 43 % fewer
            # than the launcher's 64 rows on 8 warps, whose two warpgroups each compute the whole tile (docs/
            # performance.md §9). What the GPU makes of them only it can say. A choice whose shared memory a form
            # exceeds records the launch's error and the next one runs.
            for extra in FORWARD_TILES_TRIED:
                forward_choices.setdefault(extra, [])
        for (m, n, warps, stages), names in forward_choices.items():
            if time.monotonic() > deadline:
                rows.append({"shape": [b, h, t, d], "skipped": "over the time budget"})
                continue
            blocks = triton_attention.Blocks(m, n, max(16, d), warps, stages)
            try:
                got = triton_attention.bench_checks(b=b, h=h, t=t, d=d, device=device, causal=True,
                                                    reps=1 if args.dry_run else 10, blocks=blocks,
                                                    forms=TILE_FORMS[0])
            except Exception as e:  # e.g. out of shared memory at these tiles: the other choices still run
                rows.append({"kernel": "forward", "shape": [b, h, t, d], "tiles": [m, n], "warps": warps,
                             "stages": stages, "taken_by": names, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"tiles: forward {m}x{n} warps {warps} stages {stages} failed: {e}", file=sys.stderr)
                continue
            rows.append({"kernel": "forward", "shape": [b, h, t, d], "tiles": [m, n], "warps": warps,
                         "stages": stages, "taken_by": names, **got})
            print(f"tiles: forward B={b} H={h} T={t} D={d} {m}x{n} stages {stages} warps {warps} "
                  f"({', '.join(names) or 'none: timed beside the chosen'}): "
                  f"off {got['off_ms']:.3f} ms, full {got['full_ms']:.3f} ms")
        for tile, names in backward_choices.items():
            block, stages, warps = tile.block, tile.stages, tile.warps
            if time.monotonic() > deadline:
                rows.append({"shape": [b, h, t, d], "skipped": "over the time budget"})
                continue
            got = triton_attention_bwd.bench_checks(b=b, h=h, t=t, d=d, device=device, reps=1 if args.dry_run else 5,
                                                    tile=tile, forms=TILE_FORMS[1])
            rows.append({"kernel": "backward", "shape": [b, h, t, d], "tiles": [block, block], "stages": stages,
                         "warps": warps, "checked_key_warps": tile.checked_key_warps, "taken_by": names, **got})
            print(f"tiles: backward B={b} H={h} T={t} D={d} {block}x{block} stages {stages} warps {warps} "
                  f"(checked key pass {tile.checked_key_warps or warps}) "
                  f"({', '.join(names) or 'none: timed beside the chosen'}): off {got['off_ms']:.3f} ms, "
                  f"abft {got['abft_ms']:.3f} ms")
    return {"shared_per_block_here": here, "rows": rows}


ATTRIBUTION_VARIANTS = ("baseline", "default", "all_default", "all_full")
"""The variants the attribution section profiles; the default ones on tier-1 steps (Guard.tripwire_only_this_step)."""
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def attribution_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """Per model at one length: each variant warmed up, timed over 3 steps (wall, device drained), then 2 steps under
    torch.profiler (CPU, and CUDA where there is one), summed by ``_attribution``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    seq = 32 if args.dry_run else 2048
    vocab = 256 if args.dry_run else VOCAB
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    ours = _our_kernel_names()
    timer = _Sync(device)
    rows = []
    for kind, shape in shapes.items():
        if time.monotonic() > deadline:
            rows.append({"model": kind, "seq": seq, "skipped": "over the time budget"})
            continue
        base = _model(kind, shape, seq, vocab)
        ids = torch.randint(0, vocab, (1, seq), device=device, generator=torch.Generator(device=device).manual_seed(1))
        row: dict[str, Any] = {"model": kind, "seq": seq, "variants": {}}
        for v in ATTRIBUTION_VARIANTS:
            job = _Job(v, base, device, torch.bfloat16)

            def step(job: _Job = job, v: str = v, ids: Any = ids) -> None:
                if job.guard is not None and v.endswith("default"):
                    job.guard.tripwire_only_this_step()
                job.step(ids)

            try:
                for _ in range(3):
                    step()
                wall: list[float] = []
                for _ in range(3):
                    with timer.timed(wall):
                        step()
                with profile(activities=activities) as prof:
                    for _ in range(2):
                        step()
                    timer.sync()
                row["variants"][v] = {"wall_ms_per_step": 1e3 * sorted(wall)[1],
                                      **_attribution(prof.key_averages(), 2, ours)}
            finally:
                job.close()
        base_row = row["variants"]["baseline"]
        for entry in row["variants"].values():
            entry["over_baseline"] = {k: entry[k] - base_row[k] for k in (
                "wall_ms_per_step", "device_ms_per_step", "kernels_per_step", "host_ms_per_step")}
        rows.append(row)
        lines = [[v, e["wall_ms_per_step"], e["device_ms_per_step"], e["ours_device_ms_per_step"],
                  e["kernels_per_step"], e["ours_kernels_per_step"], e["host_ms_per_step"], e["launch_api_ms_per_step"]]
                 for v, e in row["variants"].items()]
        print(f"\nattribution, {kind} T={seq} (per step; the default variants on tier-1 steps)")
        print(_common.table(lines, ["variant", "wall ms", "device ms", "attnchecker kernels ms", "kernels",
                                    "attnchecker kernels", "host ops ms", "launch calls ms"]))
    host_us = _host_us_per_call(device, calls=10 if args.dry_run else 200)
    print(f"host time per call, no sync: {host_us}")
    return {"rows": rows, "host_us_per_call": host_us}


def _host_us_per_call(device: str, calls: int) -> dict[str, float]:
    """What one call costs the host before the device runs it (median of ``calls``, nothing waited for): a GEMM's tier
    1 on the Triton path (its memset and one launch: gemm.device.trip_product) against one aten op, on a 256 x 256
    product. Where the attribution says a step is host-bound, this says by how much each of our launches weighs."""
    import statistics

    import torch

    from attnchecker.abft import Tolerance
    from attnchecker.gemm import device as gemm_device

    a, b = (torch.randn(256, 256, device=device, dtype=torch.bfloat16) for _ in range(2))
    c = a @ b
    tol = Tolerance()
    calls_of: dict[str, Callable[[], object]] = {
        "gemm_tier1": lambda: gemm_device.trip_product(c, a, b, None, tol),
        "aten_add": lambda: torch.add(a, b),
    }
    got = {}
    for name, call in calls_of.items():
        call()  # compiled, cached
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        _Sync(device).sync()
        got[name] = statistics.median(times) * 1e6
    return got


def _our_kernel_names() -> set[str]:
    """The names attnchecker's Triton kernels launch under (a @triton.jit function's own name)."""
    from attnchecker.kernels import triton_attention, triton_attention_bwd, triton_gemm_kernels

    names = set()
    for module in (triton_attention, triton_attention_bwd, triton_gemm_kernels):
        for name, obj in vars(module).items():
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
                names.add(name)
    return names


def _attribution(events: Any, steps: int, ours: set[str]) -> dict[str, Any]:
    """One profile's events per step: kernels (device events) by device time, attnchecker's among them (by name),
    host ops' own CPU time, and the driver's launch calls' (what launching costs the host)."""
    from torch.autograd import DeviceType

    def device_us(e: Any) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    kernels = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    host = [e for e in events if getattr(e, "device_type", None) != DeviceType.CUDA]
    mine = [e for e in kernels if e.key in ours]
    top = sorted(kernels, key=device_us, reverse=True)[:12]
    return {
        "device_ms_per_step": sum(map(device_us, kernels)) / steps / 1e3,
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "ours_device_ms_per_step": sum(map(device_us, mine)) / steps / 1e3,
        "ours_kernels_per_step": sum(e.count for e in mine) / steps,
        "host_ms_per_step": sum(e.self_cpu_time_total for e in host) / steps / 1e3,
        "launch_api_ms_per_step": sum(e.self_cpu_time_total for e in host if e.key in _LAUNCH_CALLS) / steps / 1e3,
        "top_kernels": [{"name": e.key[:100], "ms_per_step": device_us(e) / steps / 1e3, "calls_per_step":
                         e.count / steps, "attnchecker": e.key in ours} for e in top],
    }


VENDOR_RESIDUALS_S = 60.0
"""The vendor_residuals section's own time limit."""
VENDOR_BACKWARD_RESIDUALS_S = 45.0
"""Its backward part's, after it."""


def vendor_residuals_section(args: argparse.Namespace, device: str, deadline: float) -> dict[str, Any]:
    """bench/vendor_residuals.py on this device's vendor kernels (FlashAttention, memory-efficient attention, cuDNN):
    how far their clean outputs are, in fp64, from the identities a full check over them would test (issue 32)."""
    import vendor_backward_residuals
    import vendor_residuals

    # At most a minute of the suite's budget: its rows are data for a design, the timings after it are the targets'.
    got: dict[str, Any] = vendor_residuals.run(device=device, dry_run=args.dry_run,
                                               deadline=min(deadline, time.monotonic() + VENDOR_RESIDUALS_S))
    # The backward's identities (abft/given_backward.py), not yet a check: whether their bounds hold on this GPU's
    # vendors, before one is built.
    got["backward"] = vendor_backward_residuals.run(
        device=device, dry_run=args.dry_run, deadline=min(deadline, time.monotonic() + VENDOR_BACKWARD_RESIDUALS_S))
    return got


def coverage_section(args: argparse.Namespace, device: str) -> dict[str, Any]:
    """FLOPs of one unprotected training step by GEMM class: what scope="attention" and scope="all" check."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    shapes = DRY_SHAPES if args.dry_run else SHAPES
    seq = 32 if args.dry_run else 2048
    rows = []
    for kind, shape in shapes.items():
        model = _model(kind, shape, seq, 256 if args.dry_run else VOCAB).to(device=device, dtype=torch.bfloat16)
        ids = torch.randint(0, 256 if args.dry_run else VOCAB, (1, seq), device=device)
        counter = FlopCounterMode(display=False)
        with counter:
            model(input_ids=ids, labels=ids).loss.backward()
        by_op = counter.get_flop_counts()["Global"]
        total = sum(by_op.values())
        # The fused attention kernels' products (forward and backward): what scope="attention" checks in the core;
        # its projections are Linear GEMMs (checked in both scopes), the MLP's and the LM head's under "all" only.
        core = sum(n for op, n in by_op.items() if "scaled_dot_product" in str(op) or "flash_attention" in str(op))
        estimated = core == 0
        if estimated:
            # The CPU's fused attention op has no FLOP formula in the counter: forward 2 products of 2·H·T·S·D each,
            # backward twice that (as the counter counts the CUDA kernels, mask ignored).
            core = 3 * 2 * 2 * shape["heads"] * seq * seq * (shape["hidden"] // shape["heads"]) * LAYERS
            total += core
        rows.append({"model": kind, "seq": seq, "gemm_flops": total, "attention_core_flops": core,
                     "attention_core_estimated": estimated,
                     "attention_core_share": core / total if total else None,
                     "by_op": {str(op): n for op, n in by_op.items()}})
        print(f"{kind} T={seq}: attention core {core / max(total, 1):.1%} of a step's GEMM FLOPs; scope='all' checks "
              "every GEMM of the step")
        del model
    return {"rows": rows}


def _checkout_env() -> dict[str, str]:
    """This environment with the checkout's agent/ and tests/ first on PYTHONPATH: a child process (pytest, the
    profiled program) imports attnchecker from the checkout, which the device's Python has not installed."""
    paths = [str(ROOT / "agent"), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def marked_tests_section(budget_s: float, files: list[str] | None = None) -> dict[str, Any]:
    """pytest -m "gpu and not slow" over ``files`` (default: the agent's test modules holding gpu-marked tests) under
    ``budget_s``: its outcome, or what it printed before the budget stopped it."""
    # Only the modules that hold gpu-marked tests: collecting all of tests/agent would import what a bare GPU image
    # may lack (the collector's server stack, integrations), and one collection error stops the whole run.
    if files is None:
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "agent").glob("test_*.py")
                       if "pytest.mark.gpu" in p.read_text())
    # A per-test limit, so that one slow test cannot keep the run from its end, where pytest prints the failures.
    # The slow gpu tests run a bench end to end in a subprocess (a minute or more, with its kernels' compiles): under
    # that limit they can only time out (test_gpu_overhead_bench_runs failed on the H100 at its 26 s limit, its
    # traceback not captured; docs/performance.md §9), so they are left to `pytest -m "gpu and slow"`, and this
    # section's time goes to the tests that can finish in it.
    # _instafail: each failure's traceback as it happens, so that a run the budget stops still has it.
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu and not slow", "-v", "--tb=short", "--durations=10", "-p",
           "no:cacheprovider", "-p", "_instafail", f"--timeout={max(10, int(budget_s / 4))}", *files]
    env = _checkout_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench"), env["PYTHONPATH"]])
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=budget_s, check=False, env=env)
    except subprocess.TimeoutExpired as e:  # the tests that finished are in what it printed so far
        so_far = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print(f"gpu-marked tests: stopped after {budget_s:.0f} s", file=sys.stderr)
        return {"command": " ".join(cmd), "timed_out_after_s": budget_s, "output_tail": so_far[-12000:]}
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    print("gpu-marked tests:", tail[0] if tail else done.stderr[-300:])
    return {"command": " ".join(cmd), "returncode": done.returncode, "summary": tail, "seconds": time.monotonic() - t0,
            "output_tail": done.stdout[-12000:]}


PROFILE_SHAPE = (1, 32, 8192, 128)
PROFILE_VARIANTS = ("off", "tier1", "full")
# Kept from ncu's raw page: what says where a kernel's time goes (occupancy, issue stalls, instructions, local-memory
# traffic of spills, registers, duration). Everything else ncu printed stays in the CSV beside the JSON.
PROFILE_KEEP = ("duration", "inst_executed", "warps_active", "occupancy", "stall", "local", "registers",
                "issue_active", "pipe_", "cycles_elapsed")
PROFILE_SECTIONS = ("LaunchStats", "Occupancy", "SpeedOfLight", "WarpStateStats", "SchedulerStats",
                    "InstructionStats", "MemoryWorkloadAnalysis")


def profile_target() -> None:
    """What `ncu` profiles (profile_section): each forward variant once to compile it, then once more, the launches
    profiled. Launch order (the repair kernel follows a checked call): off; tier1 + repair; full + repair."""
    import torch

    from attnchecker.kernels import triton_attention as ta

    b, h, t, d = PROFILE_SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    checks = {"off": ta.Checks(mode=None), "tier1": ta.Checks(mode="tier1"), "full": ta.Checks(mode="full")}
    for _ in range(2):
        for name in PROFILE_VARIANTS:
            ta.forward(q, k, v, scale=d ** -0.5, checks=checks[name], is_causal=True)
        torch.cuda.synchronize()


def profile_section(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Nsight Compute on the checked forward kernel at one shape (bf16, causal): why the full checks cost 14-20x the
    kernel on the first H200 run when a clean tile issues 4-5x its instructions (docs/performance.md §8). Where ncu
    cannot read counters (not installed, or a virtual machine that hides them), the section says so and the suite
    goes on."""
    import shutil

    ncu = shutil.which("ncu")
    if ncu is None or args.dry_run:
        return {"skipped": "ncu not on the PATH" if ncu is None else "--dry-run"}
    launches = 1 + 2 + 2  # off; tier1 and its repair launch; full and its repair launch
    cmd = [ncu, "--kernel-name", "regex:attention", "--launch-skip", str(launches), "--launch-count", str(launches),
           "--clock-control", "none", *(x for sec in PROFILE_SECTIONS for x in ("--section", sec)),
           "--csv", "--page", "raw", sys.executable, str(Path(__file__).resolve()), "--profile-target"]
    env = _checkout_env()
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"command": " ".join(cmd), "timed_out_after_s": 240}
    csv_path = out.with_name(out.stem + "_ncu.csv")
    csv_path.write_text(done.stdout)
    rows = _ncu_rows(done.stdout)
    kernels = []
    for i, row in enumerate(rows):
        kept = {k: v for k, v in row.items() if any(key in k.lower() for key in PROFILE_KEEP)}
        kernels.append({"launch": i, "kernel": row.get("Kernel Name", ""), "metrics": kept})
    print(f"ncu: {len(rows)} kernels profiled, raw CSV {csv_path.name}" if rows else
          f"ncu gave no rows: {done.stderr[-500:]}")
    return {"command": " ".join(cmd), "returncode": done.returncode, "seconds": time.monotonic() - t0,
            "shape": list(PROFILE_SHAPE), "launch_order": ["off", "tier1", "tier1 repair", "full", "full repair"],
            "csv": csv_path.name, "kernels": kernels, "stderr_tail": done.stderr[-2000:]}


def _ncu_rows(text: str) -> list[dict[str, str]]:
    """ncu --csv --page raw: a header line of metric names, a line of units, then one line per kernel launch (lines
    before the header are the program's own output and ncu's notes)."""
    import csv

    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    table = list(csv.reader(lines[start:]))
    header, body = table[0], table[2:]
    return [dict(zip(header, r, strict=False)) for r in body if len(r) == len(header)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: Triton's interpreter, tiny sizes, 1 round")
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--periods", type=int, default=2, help="whole default-policy periods of timed rounds")
    ap.add_argument("--budget-s", type=float, default=460.0, help="wall-time budget of the whole suite")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--sections", default=None,
                    help="comma-separated subset of tests,steps,kernel,vendor_residuals,backward_kernel,gemm_check,"
                    "attribution,coverage,tiles,profile (default all)")
    ap.add_argument("--out", default=None, help="JSON path (default docs/perf/gpu_suite[_dry_run].json)")
    ap.add_argument("--profile-target", action="store_true", help=argparse.SUPPRESS)  # what ncu runs (profile)
    args = ap.parse_args(argv)
    if args.profile_target:
        _common.setup_path()
        profile_target()
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _common.setup_path()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("gpu_suite: no CUDA device visible; run it on a GPU machine, or with --dry-run here", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    result: dict[str, Any] = {"dry_run": args.dry_run, "device": device,
                              "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                              "torch": torch.__version__}
    out = Path(args.out) if args.out else ROOT / "docs" / "perf" / f"gpu_suite{'_dry_run' if args.dry_run else ''}.json"
    partial = out.with_name(out.stem + ".partial.json")

    def save() -> None:
        # What has finished so far, beside the final file: a run killed at its limit still leaves its numbers.
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(result, indent=2, default=str) + "\n")

    step_rows: list[dict[str, Any]] = []
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("tests", lambda: {"skipped": "--skip-tests"} if args.skip_tests else marked_tests_section(args.budget_s / 4)),
        ("steps", lambda: steps_section(args, device, deadline, step_rows, save)),
        ("kernel", lambda: kernel_section(args, device, deadline)),
        ("vendor_residuals", lambda: vendor_residuals_section(args, device, deadline)),
        ("backward_kernel", lambda: backward_kernel_section(args, device, deadline)),
        ("gemm_check", lambda: gemm_check_section(args, device, deadline)),
        ("attribution", lambda: attribution_section(args, device, deadline)),
        ("coverage", lambda: coverage_section(args, device)),
        ("tiles", lambda: tiles_section(args, device, deadline)),
        ("profile", lambda: profile_section(args, out)),
    ]
    if args.sections is not None:
        wanted = set(args.sections.split(","))
        unknown = wanted - {name for name, _ in sections}
        if unknown:
            print(f"gpu_suite: no section {', '.join(sorted(unknown))}; there are "
                  f"{', '.join(name for name, _ in sections)}", file=sys.stderr)
            return 2
        sections = [(name, run) for name, run in sections if name in wanted]
    result["steps"] = step_rows
    for name, run in sections:
        if time.monotonic() > deadline:
            result[name] = {"skipped": "over the time budget"}
            continue
        t0 = time.monotonic()
        try:
            result[name] = run()
        except Exception as e:  # a section that breaks must not lose the others' numbers
            result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"gpu_suite: section {name} failed:\n{result[name]['traceback']}", file=sys.stderr)
        result.setdefault("seconds", {})[name] = time.monotonic() - t0
        save()
    result["total_seconds"] = time.monotonic() - start
    path = _common.write_result("gpu_suite", result, out)
    partial.unlink(missing_ok=True)
    print(f"wrote {path} ({result['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
