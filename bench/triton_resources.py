"""What the Triton checked-attention kernel compiles to, without a GPU: each variant (plain, tier 1, full checks, the
repair) compiled offline for a target (default sm_90, an H100/H200) and its registers, local-memory spill stack and
shared memory read from the cubin (cuobjdump, bundled with triton). A static report, not a timing: a GPU run
measures the time (bench/gpu_suite.py); this says which variants spill, and what one iteration of the key-tile loop
executes: its machine instructions by class (``--mix``: tensor-core products, fp32, fp64, special functions,
shuffles, barriers, spill loads and stores), which a change to the checks can be weighed by before a GPU is at hand.

    .venv/bin/python bench/triton_resources.py [--arch 90] [--head-dim 64] [--mix] [--by-dot auto|on|off]
        [--out docs/perf/triton_resources.json]

The tiles are those the launcher picks on that arch (``gpu_blocks`` with its shared memory per block).

Compiling a full-check variant takes about a minute on one CPU core (the repair variant two), the first time: Triton
caches what it compiled.
"""
from __future__ import annotations

import argparse
import functools
import json
import linecache
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "agent"))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from attnchecker.abft import Tolerance
from attnchecker.kernels import triton_attention as ta

VARIANTS: dict[str, dict[str, Any]] = {
    # name: (dtype, MODE, REPAIR, extra constexprs)
    "plain (checks off)": {"dtype": "bf16", "MODE": 0},
    "tier 1": {"dtype": "bf16", "MODE": 1, "K_MAX_GIVEN": True},
    "full checks": {"dtype": "bf16", "MODE": 2, "KEY_TILES": True, "VALUE_TILES": True},
    "full checks, fp16, dropout, additive mask": {"dtype": "fp16", "MODE": 2, "DROPOUT": True, "MASK_KIND": 2,
                                                  "KEY_TILES": True, "VALUE_TILES": True},
    "full checks, fp32 TF32": {"dtype": "fp32", "MODE": 2, "TF32": True, "DOT": 1},
    "repair": {"dtype": "bf16", "MODE": 2, "REPAIR": True, "KEY_TILES": True, "VALUE_TILES": True},
    "full checks, scores only": {"dtype": "bf16", "MODE": 2, "CHECK_CONTEXT": False, "KEY_TILES": True},
    "full checks, context only": {"dtype": "bf16", "MODE": 2, "CHECK_SCORES": False, "VALUE_TILES": True},
}

# SASS opcode (its first dotted part) -> class, for the loop's mix; anything else is integer, move or control.
CLASSES: dict[str, str] = {
    **dict.fromkeys(("HGMMA", "HMMA", "IMMA", "WGMMA"), "tensor core"),
    **dict.fromkeys(("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK"), "fp32"),
    **dict.fromkeys(("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "F2F"), "fp64 (and F2F conversions)"),
    "MUFU": "special function (exp, log, sqrt, rcp)",
    **dict.fromkeys(("SHFL", "REDUX"), "shuffle (reduction across lanes)"),
    **dict.fromkeys(("BAR", "DEPBAR"), "barrier (reduction across warps)"),
    **dict.fromkeys(("LDS", "STS", "LDSM", "STSM"), "shared memory"),
    **dict.fromkeys(("LDL", "STL"), "local memory (spills)"),
    **dict.fromkeys(("LDG", "STG", "LDGSTS", "UTMALDG", "RED", "ATOM", "ATOMG"), "global memory"),
    "CALL": "call (a slow-path subroutine)",
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[A-Z0-9_.]*([^;]*);")


def source(dtype: str, blocks: ta.Blocks, kernel: Any = None, **constexprs: Any) -> ASTSource:
    kernel = kernel if kernel is not None else ta._attention
    names = kernel.arg_names
    consts = {"BLOCK_M": blocks.m, "BLOCK_N": blocks.n, "BLOCK_D": blocks.d, "IS_CAUSAL": True, "WINDOWED": False,
              "MASK_KIND": 0, "DROPOUT": False, "MODE": 2, "CHECK_SCORES": True, "CHECK_CONTEXT": True,
              "CALIBRATED": True, "TF32": False, "DOT": 0, "COLS": False, "REPAIR": False, "FAULTS": False,
              "DEBUG": False, "K_MAX_GIVEN": False, "KEY_TILES": False, "VALUE_TILES": False,
              "BY_DOT": dtype in ("bf16", "fp16") and blocks.m >= ta.BY_DOT_MIN_ROWS, **constexprs}
    pointer = "*" + dtype
    signature: dict[str, Any] = {}
    for name in names:
        if name in consts:
            signature[name] = "constexpr"
        elif name in ("Q", "K", "V", "Out", "KeyParts", "ValueParts"):
            signature[name] = pointer
        elif name == "Mask":
            signature[name] = "*u8" if consts["MASK_KIND"] == 1 else "*fp32"
        elif name in ("Seed", "Faults"):
            signature[name] = "*i64"
        elif name in ("Lse", "Status", "Records", "Saved", "FaultValues", "FaultSeen", "Debug", "KMax", "KeyTiles",
                      "KeyNorms", "ValueTiles", "ValueNorms"):
            signature[name] = "*fp32"
        elif name in ("scale", "dropout_p"):
            signature[name] = "fp32"
        elif name in ("s_row", "s_col", "c_row", "c_col"):
            signature[name] = ("fp32",) * len(ta._terms_of(Tolerance(), None, blocks.m, blocks.n, blocks.d)[0])
        elif name == "fixing":
            signature[name] = ("fp32", "fp32")
        else:
            signature[name] = "i32"
    return ASTSource(fn=kernel, signature=signature,
                     constexprs={(names.index(k),): v for k, v in consts.items() if k in names})


def resources(cubin: bytes) -> dict[str, int]:
    text = _cuobjdump(cubin, "--dump-resource-usage")
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


# The fast pass's branch that only a flagged tile takes (the record of the flag, its kept row), made never-taken:
# what a clean tile runs, compiled. The source edited in memory and loaded under another name (clean_path_kernel).
CLEAN_PATH_EDITS = (
    ("        if tc.rsum(bad.to(tl.int32), 0) > 0:\n            rec, rows_seen = _note_rows(",
     "        if NEVER:\n            rec, rows_seen = _note_rows(", 1),
    ("    def _tally_rows(worst, rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, r0, c0, At):",
     "    def _tally_rows(worst, rec, rows_seen, x, bad, d1, b1, ratio, ref1, ref2, r0, c0, At,\n"
     "                    NEVER: tl.constexpr = False):", 1),
)


@functools.lru_cache(maxsize=1)
def clean_path_kernel() -> Any:
    """triton_attention's kernel with CLEAN_PATH_EDITS applied: the loop a tile that does not flag executes. For the
    instruction count only (a flagged tile would go unrecorded)."""
    src = Path(ta.__file__).read_text()
    for old, new, count in CLEAN_PATH_EDITS:
        if src.count(old) != count:
            raise RuntimeError(f"triton_resources: the kernel's source changed, update CLEAN_PATH_EDITS "
                               f"({old.strip()!r})")
        src = src.replace(old, new)
    name = "attnchecker.kernels._triton_attention_clean_path"
    filename = f"<{name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # triton.jit reads its source
    module = types.ModuleType(name)
    module.__package__ = "attnchecker.kernels"
    sys.modules[name] = module
    exec(compile(src, filename, "exec"), module.__dict__)
    return module._attention


def loop_mix(cubin: bytes) -> dict[str, Any]:
    """The instructions of the kernel's tile loop (one iteration per tile of the other side: BLOCK_N keys in the
    forward) by class, and the kernel's total. Static counts, from the disassembly: what one iteration issues per
    warp, not a time. The tile loop is the longest loop that makes tensor-core products and holds no other loop that
    does (so not the backward key pass's loop over a GQA group's heads around it, nor a flagged program's loop over
    its inputs); the longest loop where none makes them."""
    text = _cuobjdump(cubin, "-sass")
    code = [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(text)]
    back = [(int(t.group(1), 16), addr) for addr, op, rest in code if op == "BRA"
            if (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr]
    mma = [addr for addr, op, _ in code if CLASSES.get(op) == "tensor core"]
    making = [(a, b) for a, b in back if any(a <= m <= b for m in mma)]
    innermost = [(a, b) for a, b in making if not any((c, d) != (a, b) and a <= c and d <= b for c, d in making)]
    lo, hi = max(innermost or back, key=lambda r: r[1] - r[0]) if back else (0, -1)
    mix: dict[str, int] = {}
    for addr, op, _ in code:
        if lo <= addr <= hi:
            name = CLASSES.get(op, "integer, move, control")
            mix[name] = mix.get(name, 0) + 1
    return {"instructions": len(code), "loop_instructions": sum(mix.values()),
            "loop_mix": dict(sorted(mix.items(), key=lambda kv: -kv[1]))}


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path("/tmp") / f"attnchecker_{time.time_ns()}.cubin"
    path.write_bytes(cubin)
    try:
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=True).stdout
    finally:
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mix", action="store_true", help="also the key-tile loop's instructions by class")
    parser.add_argument("--by-dot", choices=("auto", "on", "off"), default="auto",
                        help="the bf16/fp16 variants' row references on the tensor cores (BY_DOT): as the launcher "
                             "picks for the arch's tiles (auto), or forced, to weigh the two forms on the same tiles")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    d = args.head_dim
    # The tiles the launcher picks on that arch (gpu_blocks with its shared memory per block): 64 × 32 past head dim
    # 64 and 16 × 16 past 128 on the 99 KB GPUs.
    from triton_compile_matrix import SHARED_MEMORY_PER_BLOCK

    tiles = ta.gpu_blocks(d, SHARED_MEMORY_PER_BLOCK.get(args.arch))
    rows = []
    for name, spec in VARIANTS.items():
        t0 = time.perf_counter()
        spec = dict(spec)
        dtype = spec.pop("dtype")
        blocks = tiles
        if args.by_dot != "auto" and dtype != "fp32":
            spec["BY_DOT"] = args.by_dot == "on"
        compiled = triton.compile(source(dtype, blocks, **spec), target=GPUTarget("cuda", args.arch, 32),
                                  options={"num_warps": blocks.warps, "num_stages": blocks.stages})
        row = {"variant": name, "dtype": dtype, "head_dim": d, "block_m": blocks.m, "block_n": blocks.n,
               "warps": blocks.warps, "stages": blocks.stages, **resources(compiled.asm["cubin"])}
        if args.mix:
            row.update(loop_mix(compiled.asm["cubin"]))
            if spec.get("MODE") == 2 and not spec.get("REPAIR"):
                lean = triton.compile(source(dtype, blocks, clean_path_kernel(), **spec),
                                      target=GPUTarget("cuda", args.arch, 32),
                                      options={"num_warps": blocks.warps, "num_stages": blocks.stages})
                row["clean_path"] = {**resources(lean.asm["cubin"]), **loop_mix(lean.asm["cubin"])}
        rows.append(row)
        print(f"{name:45s} {dtype:5s} {blocks.m}x{blocks.n} warps {blocks.warps}: {row['reg']} registers, "
              f"{row['stack']} B stack (spills), {row['shared']} B shared ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    # Tier 1 over the vendor's forward: one pass over its output and log-sum-exp, no key loop (so no mix).
    given = []
    for dtype in ("bf16", "fp16", "fp32"):
        blocks = tiles
        compiled = triton.compile(source(dtype, blocks, ta._trip_given), target=GPUTarget("cuda", args.arch, 32),
                                  options={"num_warps": blocks.warps})
        given.append({"kernel": "_trip_given", "dtype": dtype, "head_dim": d, "block_m": blocks.m,
                      "warps": blocks.warps, **resources(compiled.asm["cubin"])})
        print(f"{'tier 1 over the vendor forward (_trip_given)':45s} {dtype:5s} {blocks.m} rows warps "
              f"{blocks.warps}: {given[-1]['reg']} registers, {given[-1]['stack']} B stack (spills)", flush=True)
    if args.mix:
        print_mix(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"arch": f"sm_{args.arch}", "triton": triton.__version__, "by_dot": args.by_dot,
                                        "rows": rows,
                                        "given_pass": given}, indent=2) + "\n")


def print_mix(rows: list[dict[str, Any]]) -> None:
    """One line per variant: the loop's instructions, its ratio to the plain kernel's, and the classes."""
    plain = rows[0]["loop_instructions"]
    classes = sorted({c for r in rows for c in r["loop_mix"]},
                     key=lambda c: -max(r["loop_mix"].get(c, 0) for r in rows))
    print("\nkey-tile loop, instructions per iteration (per warp); 'clean path': without the branches only a "
          "flagged tile takes")
    print(f"{'variant':58s} {'total':>6s} {'× plain':>7s} {'stack':>6s}  "
          + "  ".join(f"{c[:14]:>14s}" for c in classes))
    for r in rows:
        for label, m in ((r["variant"], r), (r["variant"] + ", clean path", r.get("clean_path"))):
            if m is not None:
                print(f"{label:58s} {m['loop_instructions']:6d} {m['loop_instructions'] / plain:7.1f} "
                      f"{m['stack']:6d}  " + "  ".join(f"{m['loop_mix'].get(c, 0):14d}" for c in classes))


if __name__ == "__main__":
    main()
