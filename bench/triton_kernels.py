"""The Triton attention backward's kernels compiled for a GPU without one: Triton's compiler down to a cubin for sm_90
(H100/H200), and its bundled ptxas for each kernel's registers per thread, spills and shared memory. What a first GPU
run should look at before it times anything: a kernel that spills to local memory is slow whatever its checks cost.

Variants: the query pass and the key pass, bf16, causal, head dim 64 and 128, check off / tripwire / abft, at the
tile size and warps kernels/triton_attention_bwd.py launches with (BLOCK, ``pass_warps``), at BLOCK with 8 and 4
warps, and (without --mix) at 64×64 tiles with 8 and 4 warps for comparison; and tier 1 over SDPA's gradients: the
pass that reads them and the two repair launches; and the full check over them (the identities,
kernels/triton_given_backward_check.py) and its two repair launches, which check in full (``--given``: these
only).
Needs triton, not a GPU; TRITON_INTERPRET must be unset.

    python bench/triton_kernels.py [--out docs/perf/triton_backward_kernels.json]
    python bench/triton_kernels.py --mix [--block 64] [--lines 20] [--out docs/perf/triton_backward_kernels_mix.json]

--mix: BLOCK (or --block) only, and each pass's loop (over the other side's tiles) counted by instruction class, as
bench/triton_resources.py --mix counts the forward's; ``per_tile`` is the loop times the program's warps, the
instructions one tile costs the whole program (a tile smaller than the warps' layout is held several times over);
``interior``: the same for a tile with no masked element (under is_causal every tile off the diagonal), which skips
the per-element mask. ``--lines N``: that interior loop's N costliest source lines (``loop_lines``), where a change to
the checks would save.

Each kernel is compiled as Triton's JIT specialises a launch on a GPU (a contiguous (1, 32, 4096, d) call: unit
strides constants, 16-divisible sizes and aligned pointers marked; triton_resources.specialise);
``--types-only`` from the argument types alone, as this tool did before (docs/perf's earlier JSONs).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
import triton
import triton_resources
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnchecker.kernels import triton_attention_bwd as kernels
from attnchecker.kernels import triton_given_backward_check as given_check

TARGET = GPUTarget("cuda", 90, 32)


def _signature(fn: Any, dtype: str) -> dict[str, Any]:
    pointers = {"Q": dtype, "K": dtype, "V": dtype, "DO": dtype, "DQ": dtype, "DK": dtype, "DV": dtype,
                "LSE": "fp32", "DELTA": "fp32", "SUMMARY": "fp32", "FAULTS": "fp32", "MASK": "fp32", "STATUS": "i32",
                "FIRST": "i32", "SEED": "i64", "KROWS": "fp32", "KTILE": "fp32", "QROWS": "fp32",
                "QTILE": "fp32", "QPARTS": dtype, "ONORM": "fp32", "OUT": dtype}
    sig: dict[str, Any] = {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in ("scale", "p_drop", "tau_u", "kappa_u32", "tau_tiny"):
            sig[name] = "fp32"
        elif name in ("R_TILE", "R_Q", "R_KV"):
            sig[name] = ("fp32",) * 12
        elif name == "R_SM":
            sig[name] = ("fp32",) * 8
        elif name == "seed":
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


LAUNCH = {"heads": 32, "length": 4096}
"""The call a launched compile specialises for: contiguous (1, H, T, D) q, k, v, dO and gradients, T = S, no GQA or
mask."""


def _values(d: int) -> dict[str, int]:
    """The launch's integer arguments that Triton's JIT specialises on (triton_resources.specialise)."""
    h, t = LAUNCH["heads"], LAUNCH["length"]
    strides = (h * t * d, t * d, d, 1)
    values = {f"s{x}_{a}": v for x in ("q", "do", "dq", "o") for a, v in zip("bhtd", strides, strict=True)}
    values.update({f"s{x}_{a}": v for x in ("k", "v", "dk", "dv") for a, v in zip("bhsd", strides, strict=True)})
    values.update({"sl_b": h * t, "sl_h": t, "sl_t": 1, "sm_b": 0, "sm_h": 0, "sm_t": 0, "sm_s": 0, "H": h, "HK": h,
                   "T": t, "S": t, "D": d, "window": 0, "n_faults": 0})
    return values


# The per-element mask of _scores_to_probs made never-taken: the loop a tile with no masked element runs.
INTERIOR_EDITS = (
    ("        if edge | (MASK_KIND == 2):\n            p = tl.where(seen, p, 0.0)",
     "        if NEVER:\n            p = tl.where(seen, p, 0.0)", 1),
    ("                         DROPOUT: tl.constexpr):\n        \"\"\"(AP, Z,",
     "                         DROPOUT: tl.constexpr, NEVER: tl.constexpr = False):\n        \"\"\"(AP, Z,", 1),
)


def interior_module() -> Any:
    """kernels/triton_attention_bwd with INTERIOR_EDITS, loaded under another name (raises if an edit no longer
    matches its source). For the instruction count only."""
    return triton_resources.edited_module(kernels, "interior", INTERIOR_EDITS)


def compile_one(fn: Any, *, d: int, check: int, block: int, warps: int, mix: bool = False, by_dot: int | None = None,
                repair: bool = False, launched: bool = True, lines: int = 0) -> dict[str, Any]:
    """ptxas's registers, spill and shared memory of one kernel (and with mix its tile loop's instructions by class,
    and the interior path's for the passes). by_dot: the passes' BY_DOT; None for what the launcher picks for bf16 at
    this head dim (kernels.by_dot). launched: specialised as a GPU's JIT launches it. lines: with mix, the interior
    loop's ``lines`` costliest source lines too (triton_resources.loop_lines)."""
    if by_dot is None:
        by_dot = kernels.by_dot(torch.bfloat16, d)[fn.__name__ == "_key_pass"]
    const = {"BLOCK_M": block, "BLOCK_N": block, "BLOCK_D": d, "CAUSAL": True, "WINDOW": False, "MASK_KIND": 0,
             "DROPOUT": False, "CHECK": check, "FAULTS_ON": False, "INTERPRET": False, "PRECISION": "ieee",
             "REPAIR": repair, "SEED_ON_DEVICE": False, "GIVEN": repair, "BY_DOT": by_dot}
    const = {k: v for k, v in const.items() if k in fn.arg_names}
    sig = {k: v for k, v in _signature(fn, "bf16").items() if k not in const}
    sig.update(dict.fromkeys(const, "constexpr"))
    sig = {name: sig[name] for name in fn.arg_names}
    attrs = triton_resources.specialise(fn.arg_names, sig, _values(d), const) if launched else {}
    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in const.items()}
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=TARGET,
                              options={"num_warps": warps})
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas*"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    report = subprocess.run([ptxas[0], "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                            text=True, check=True).stderr
    os.unlink(f.name)
    regs = re.findall(r"Used (\d+) registers", report)
    spills = re.findall(r"(\d+) bytes spill stores", report)
    got: dict[str, Any] = {"registers": int(regs[-1]), "spill_store_bytes": int(spills[-1]) if spills else 0,
                           "shared_bytes": int(compiled.metadata.shared), "by_dot": by_dot if check == 2 else 0}
    if mix:
        got.update(triton_resources.loop_mix(compiled.asm["cubin"]))
        if fn.__name__ in ("_query_pass", "_key_pass") and not repair:
            inner = compile_one(getattr(interior_module(), fn.__name__), d=d, check=check, block=block, warps=warps,
                                by_dot=by_dot, launched=launched)
            got["interior"] = {"registers": inner["registers"], "spill_store_bytes": inner["spill_store_bytes"],
                               **triton_resources.loop_mix(inner["cubin"])}
            if lines:
                got["interior"].update(triton_resources.loop_lines(inner["cubin"], top=lines))
    got["cubin"] = compiled.asm["cubin"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", action="store_true", help="the launched configuration only, with its loop's mix")
    ap.add_argument("--by-dot", choices=("auto", "off"), default="auto",
                    help="the checked passes' references on the tensor cores as the launcher picks them for bf16 "
                         "(kernels.by_dot), or all fp32 sums (off), to weigh the two on the same code")
    ap.add_argument("--block", type=int, default=None,
                    help="with --mix, count the passes at this tile size instead of the launcher's (kernels.BLOCK)")
    ap.add_argument("--types-only", action="store_true",
                    help="compile from the argument types alone, not specialised as a GPU launch is")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="with --mix, each pass's interior loop by source line: its N costliest lines, printed and "
                         "in the JSON (triton_resources.loop_lines)")
    ap.add_argument("--given", action="store_true",
                    help="only the kernels over another backward's gradients: tier 1's pass, the full check's "
                         "identities (kernels/triton_given_backward_check.py) and the repairs they gate")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    as_launched = not args.types_only
    if kernels.interpreting():
        raise SystemExit("TRITON_INTERPRET was set when the kernels were built: unset it")
    rows = []
    for fn in () if args.given else (kernels._query_pass, kernels._key_pass):
        for d in (64, 128):
            tile = kernels.gpu_tiles(d)
            block = args.block or kernels.BLOCK
            # Each pass and check at the warps run() launches it on (pass_warps), and at the other counts.
            picked = kernels.by_dot(torch.bfloat16, d)[fn is kernels._key_pass]
            counts = sorted({tile.warps, 8, 4, kernels.pass_warps(tile, fn.__name__, "abft", picked)}, reverse=True)
            configs = [(block, w) for w in counts]
            configs += [] if args.mix else [(64, 8), (64, 4)]
            for block, warps in configs:
                for check, name in enumerate(kernels.CHECKS):
                    got = compile_one(fn, d=d, check=check, block=block, warps=warps, mix=args.mix,
                                      by_dot=None if args.by_dot == "auto" else 0, launched=as_launched,
                                      lines=args.lines)
                    got.pop("cubin")
                    by_dot = (picked if args.by_dot == "auto" else 0) if name == "abft" else 0
                    launched = (block, warps) == (kernels.BLOCK, kernels.pass_warps(tile, fn.__name__, name, by_dot))
                    rows.append({"kernel": fn.__name__.strip("_"), "head_dim": d, "block": block, "warps": warps,
                                 "launched": launched, "check": name, "specialised": as_launched, **got})
                    if args.mix:
                        rows[-1]["per_tile"] = warps * got["loop_instructions"]
                        rows[-1]["interior"]["per_tile"] = warps * got["interior"]["loop_instructions"]
                    print({k: v for k, v in rows[-1].items() if k not in ("loop_mix", "interior")}, flush=True)
                    if args.mix and args.lines:
                        print(triton_resources.lines_table(got["interior"]), flush=True)
    # Over another backward's gradients (run(given=...)): tier 1's pass and the full check's identities, and the
    # repairs they gate (with tier 1's checks, or the full ones).
    given = given_check._check_given_bwd
    for d in (64, 128):
        for fn, check, repair in ((kernels._trip_given, 1, False), (kernels._query_pass, 1, True),
                                  (kernels._key_pass, 1, True), (given, 2, False), (kernels._query_pass, 2, True),
                                  (kernels._key_pass, 2, True)):
            # _trip_given and the identities launch on their own warps; the repairs on the passes' (gpu_tiles,
            # pass_warps).
            picked = kernels.by_dot(torch.bfloat16, d)[fn is kernels._key_pass] if check == 2 else 0
            warps = {kernels._trip_given: kernels.TRIP_WARPS, given: kernels.GIVEN_WARPS}.get(fn) or \
                kernels.pass_warps(kernels.gpu_tiles(d), fn.__name__, kernels.CHECKS[check], picked)
            got = compile_one(fn, d=d, check=check, block=kernels.BLOCK, warps=warps, mix=args.mix, repair=repair,
                              launched=as_launched)
            got.pop("cubin")
            name = fn.__name__.strip("_") + (" (repair, given)" if repair else "")
            rows.append({"kernel": name, "head_dim": d, "block": kernels.BLOCK, "warps": warps, "launched": True,
                         "check": kernels.CHECKS[check], "specialised": as_launched, **got})
            print({k: v for k, v in rows[-1].items() if k != "loop_mix"}, flush=True)
    for r in rows:
        if "interior" in r:
            r["interior_per_tile"] = r["interior"]["per_tile"]
    extra = ["loop_instructions", "per_tile", "interior_per_tile"] if args.mix else []
    print(_common.table([[r["kernel"], r["head_dim"], r["block"], r["warps"], r["check"], r["registers"],
                          r["spill_store_bytes"], r["shared_bytes"], *(r.get(k, "") for k in extra)] for r in rows],
                        ["kernel", "D", "block", "warps", "check", "registers", "spill B", "shared B",
                         *(["loop instructions (per warp)", "per tile (× warps)", "interior tile (× warps)"]
                           if args.mix else [])]))
    path = _common.write_result("triton_backward_kernels", {"target": "sm_90", "dtype": "bf16", "causal": True,
                                                            "triton": triton.__version__, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
