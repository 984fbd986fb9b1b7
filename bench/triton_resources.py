"""What the Triton checked-attention kernel compiles to, without a GPU: each variant (plain, tier 1, full checks, the
repair) compiled offline for a target (default sm_90, an H100/H200) and its registers, local-memory spill stack and
shared memory read from the cubin (cuobjdump, bundled with triton). A static report, not a timing: a GPU run
measures the time (bench/gpu_suite.py); this says which variants spill, and what one iteration of the key-tile loop
executes: its machine instructions by class (``--mix``: tensor-core products, fp32, fp64, special functions,
shuffles, barriers, spill loads and stores), which a change to the checks can be weighed by before a GPU is at hand.

    .venv/bin/python bench/triton_resources.py [--arch 90] [--head-dim 64] [--mix [--lines N]] [--by-dot auto|on|off]
        [--warps 4|8] [--tiles M,N,WARPS,STAGES] [--types-only] [--only VARIANT[;VARIANT]]
        [--out docs/perf/triton_resources.json]

The tiles and warps are those the launcher picks on that arch for each variant's dtype (``gpu_blocks`` with its
shared memory per block). Each kernel is compiled as Triton's JIT specialises a launch on a GPU (``source``): a
contiguous (1, 32, 4096, d) call, its unit strides constants and its 16-divisible sizes and aligned pointers marked,
so that its loads vectorise and pipeline; ``--types-only`` compiles from the argument types alone, as this tool did
before (and docs/perf's earlier JSONs hold), which overstates the loop's memory instructions several times over.
``per_1k_scores``: the loop's instructions summed over the program's warps per 1,000 elements of its tile of scores,
which compares tiles and warp counts. The loop is counted on three paths where it has them: as compiled (every
branch), the clean path (``clean_path``: the full checks' flag-only branches never taken) and the interior path
(``interior``: a tile with no masked element, under is_causal every tile below the diagonal, which skips the
per-element mask). ``--lines N`` attributes the interior loop's instructions to the source lines they were
compiled from and keeps the N costliest (``loop_lines``): where a change to the checks would save.

Compiling a full-check variant takes about a minute on one CPU core (the repair variant two), the first time: the
tool caches what it compiled in .cache/triton-resources/ of the checkout, one cache per version of the kernels'
sources (``own_cache``), not in Triton's shared cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import linecache
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "agent"))
sys.path.insert(0, str(ROOT / "bench"))
import _common
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from attnchecker.abft import Tolerance
from attnchecker.kernels import triton_attention as ta
from attnchecker.kernels import triton_given_check

KERNELS = Path(ta.__file__).parent
CACHE = ROOT / ".cache" / "triton-resources"


def own_cache() -> Path:
    """Point Triton's cache, for this process, at one of this checkout's own, keyed by the kernels' sources, and
    return it. Triton's cache key is a kernel's source and its first line, not its file: a cubin that another
    checkout compiled (a worktree since removed, say) carries that checkout's paths in its line table, and a device
    function moved within its file keeps its old lines there. ``loop_lines`` reads the lines back from the files
    named, so they must be these files as they are now. Caches of earlier versions are removed."""
    digest = hashlib.sha256()
    for path in sorted(KERNELS.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    here = CACHE / digest.hexdigest()[:16]
    here.mkdir(parents=True, exist_ok=True)
    for old in CACHE.iterdir():
        if old != here:
            shutil.rmtree(old, ignore_errors=True)
    triton.knobs.cache.dir = str(here)
    return here


own_cache()

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
_SPECIAL = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?MUFU\.([A-Z0-9_]+)")
"""A special-function instruction and its function (EX2, SQRT, RCP, RSQ, LG2, ...)."""


LAUNCH = {"batch": 1, "heads": 32, "length": 4096}
"""The call ``source`` specialises for: contiguous (B, H, T, D) q, k, v and out, T = S, no GQA, a (T, S) mask."""


def source(dtype: str, blocks: ta.Blocks, kernel: Any = None, *, launched: bool = True,
           **constexprs: Any) -> ASTSource:
    """The kernel's compile source for a (1, 32, 4096, blocks.d) call of ``dtype`` at these tiles and constexprs.
    launched: specialised as Triton's JIT specialises such a launch on a GPU (triton.runtime.jit's
    ``native_specialize_impl``: an integer argument of 1 a constant, a 16-divisible one and a 16-byte-aligned
    pointer marked so), which lets the loads vectorise and go through the pipeliner's asynchronous copies; else
    from the argument types alone."""
    kernel = kernel if kernel is not None else ta._attention
    names = kernel.arg_names
    consts = {"BLOCK_M": blocks.m, "BLOCK_N": blocks.n, "BLOCK_D": blocks.d, "IS_CAUSAL": True, "WINDOWED": False,
              "MASK_KIND": 0, "DROPOUT": False, "MODE": 2, "CHECK_SCORES": True, "CHECK_CONTEXT": True,
              "CALIBRATED": True, "TF32": False, "DOT": 0, "COLS": False, "REPAIR": False, "FAULTS": False,
              "DEBUG": False, "K_MAX_GIVEN": False, "KEY_TILES": False, "VALUE_TILES": False, "NORMALISE_LSE": False,
              "BY_DOT": dtype in ("bf16", "fp16") and blocks.m >= ta.BY_DOT_MIN_ROWS, **constexprs}
    if "NEVER" in names:
        consts["NEVER"] = False  # interior_kernel's never-taken branch
    pointer = "*" + dtype
    h, t, d = LAUNCH["heads"], LAUNCH["length"], blocks.d
    mask_strides = (0, 0, t, 1) if consts["MASK_KIND"] else (0, 0, 0, 0)
    values = {**dict(zip(("sqb", "sqh", "sqt", "sqd"), (h * t * d, t * d, d, 1), strict=True)),
              **{f"s{x}{a}": v for x in "kvo" for a, v in zip("bhtd" if x == "o" else "bhsd", (h * t * d, t * d, d, 1),
                                                               strict=True)},
              **dict(zip(("smb", "smh", "smt", "sms"), mask_strides, strict=True)),
              "skmb": h * t, "skmh": t, "H": h, "GROUP": 1, "T": t, "S": t, "S_PAD": t, "D": d, "HK": h,
              "N_BLOCKS": t // blocks.m, "N_TILES": t // blocks.n, "N_KEY_TILES": t // blocks.n, "window": 0,
              "n_faults": 0}
    signature: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
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
                      "KeyNorms", "ValueTiles", "ValueNorms", "VC", "VCMax"):
            signature[name] = "*fp32"
        elif name in ("scale", "dropout_p", "tau_u", "kappa_u32", "kappa_a_u32", "a_floor_u", "near_inf"):
            signature[name] = "fp32"
        elif name in ("s_row", "s_col", "c_row", "c_col"):
            signature[name] = ("fp32",) * len(ta._terms_of(Tolerance(), None, blocks.m, blocks.n, blocks.d)[0])
        elif name == "fixing":
            signature[name] = ("fp32", "fp32")
        else:
            signature[name] = "i32"
    if launched:
        attrs = specialise(names, signature, values, consts)
    return ASTSource(fn=kernel, signature=signature,
                     constexprs={(names.index(k),): v for k, v in consts.items() if k in names}, attrs=attrs)


def specialise(names: list[str], signature: dict[str, Any], values: dict[str, int],
               consts: dict[str, Any]) -> dict[tuple[int, ...], Any]:
    """Specialise ``signature`` in place as Triton's JIT does a launch on a GPU (``native_specialize_impl``): an i32
    argument whose value (``values``) is 1 becomes a constexpr (added to ``consts``); the attributes it returns mark
    every pointer 16-byte aligned (torch's allocations are) and every i32 of a 16-divisible value so. Arguments
    ``values`` does not name stay as typed."""
    attrs: dict[tuple[int, ...], Any] = {}
    for index, name in enumerate(names):
        kind = signature[name]
        if not isinstance(kind, str) or kind == "constexpr":
            continue
        if kind.startswith("*"):
            attrs[(index,)] = CUDABackend.parse_attr("D")
        elif kind == "i32" and name in values:
            if values[name] == 1:
                signature[name], consts[name] = "constexpr", 1
            elif values[name] % 16 == 0:
                attrs[(index,)] = CUDABackend.parse_attr("D")
    return attrs


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


# A tile with no masked element (under is_causal every tile below the diagonal, and every tile of a call without a
# mask but the last rows' and keys'): the per-element mask's branch made never-taken.
INTERIOR_EDITS = (
    ("            if edge:\n                z = tl.where(valid, z, float(\"-inf\"))",
     "            if NEVER:\n                z = tl.where(valid, z, float(\"-inf\"))", 1),
    ("        BY_DOT: tl.constexpr,\n    ):\n        pid_m = tl.program_id(0)",
     "        BY_DOT: tl.constexpr, NEVER: tl.constexpr = False,\n    ):\n        pid_m = tl.program_id(0)", 1),
)


# The same for the full checks over the vendor's forward (kernels/triton_given_check.py).
GIVEN_INTERIOR_EDITS = (
    ("            if tc.holds_masked(pid_m * BLOCK_M, start_n, T, S, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False):",
     "            if NEVER:", 1),
    ("        DOT: tl.constexpr,\n    ):\n        \"\"\"Identities A and B",
     "        DOT: tl.constexpr, NEVER: tl.constexpr = False,\n    ):\n        \"\"\"Identities A and B", 1),
)


def clean_path_kernel() -> Any:
    """triton_attention's kernel with CLEAN_PATH_EDITS applied: the loop a tile that does not flag executes. For the
    instruction count only (a flagged tile would go unrecorded)."""
    return edited_kernel("clean", CLEAN_PATH_EDITS)


def interior_kernel(clean: bool = False) -> Any:
    """triton_attention's kernel with INTERIOR_EDITS applied (and with ``clean`` CLEAN_PATH_EDITS too): the loop a
    tile with no masked element executes. For the instruction count only."""
    return edited_kernel("interior_clean" if clean else "interior",
                         (CLEAN_PATH_EDITS if clean else ()) + INTERIOR_EDITS)


def edited_kernel(name: str, edits: tuple[tuple[str, str, int], ...]) -> Any:
    """triton_attention's kernel with its source edited in memory (``edited_module``)."""
    return edited_module(ta, name, edits)._attention


@functools.cache
def edited_module(module: types.ModuleType, name: str, edits: tuple[tuple[str, str, int], ...]) -> types.ModuleType:
    """A kernels module with its source edited in memory and loaded under another name; raises if an edit no longer
    matches the source (each (old, new, how many times old occurs))."""
    src = Path(str(module.__file__)).read_text()
    for old, new, count in edits:
        if src.count(old) != count:
            raise RuntimeError(f"the kernel's source changed, update its edits ({old.strip()!r})")
        src = src.replace(old, new)
    module_name = f"{module.__name__.rsplit('.', 1)[0]}._{module.__name__.rsplit('.', 1)[1]}_{name}"
    filename = f"<{module_name}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)  # triton.jit reads its source
    edited = types.ModuleType(module_name)
    edited.__package__ = module.__package__
    sys.modules[module_name] = edited
    exec(compile(src, filename, "exec"), edited.__dict__)
    return edited


def _loop_range(code: list[tuple[int, str, str]]) -> tuple[int, int]:
    """The tile loop's first and last address in a disassembly's (address, opcode, operands): the longest loop that
    makes tensor-core products and holds no other loop that does; the longest loop where none makes them; (0, -1)
    where there is no loop."""
    back = [(int(t.group(1), 16), addr) for addr, op, rest in code if op == "BRA"
            if (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < addr]
    mma = [addr for addr, op, _ in code if CLASSES.get(op) == "tensor core"]
    making = [(a, b) for a, b in back if any(a <= m <= b for m in mma)]
    innermost = [(a, b) for a, b in making if not any((c, d) != (a, b) and a <= c and d <= b for c, d in making)]
    return max(innermost or back, key=lambda r: r[1] - r[0]) if back else (0, -1)


def loop_mix(cubin: bytes) -> dict[str, Any]:
    """The instructions of the kernel's tile loop (one iteration per tile of the other side: BLOCK_N keys in the
    forward) by class, and the kernel's total. Static counts, from the disassembly: what one iteration issues per
    warp, not a time. The tile loop is the longest loop that makes tensor-core products and holds no other loop that
    does (so not the backward key pass's loop over a GQA group's heads around it, nor a flagged program's loop over
    its inputs); the longest loop where none makes them. loop_special: its special-function instructions by
    function (MUFU.EX2, .SQRT, .RCP, ...)."""
    text = _cuobjdump(cubin, "-sass")
    code = [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(text)]
    lo, hi = _loop_range(code)
    mix: dict[str, int] = {}
    for addr, op, _ in code:
        if lo <= addr <= hi:
            name = CLASSES.get(op, "integer, move, control")
            mix[name] = mix.get(name, 0) + 1
    # The special functions by function: the softmax's ex2 against the checks' square roots and reciprocals.
    special: dict[str, int] = {}
    for addr, function in _SPECIAL.findall(text):
        if lo <= int(addr, 16) <= hi:
            special[function] = special.get(function, 0) + 1
    return {"instructions": len(code), "loop_instructions": sum(mix.values()),
            "loop_mix": dict(sorted(mix.items(), key=lambda kv: -kv[1])),
            "loop_special": dict(sorted(special.items(), key=lambda kv: -kv[1]))}


_LINE_INFO = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_LIBRARY = str(Path(triton.__file__).parent / "language")
"""Triton's own device functions (tl.sum's combine, tl.max, ...): their instructions count at the line that called
them."""


def loop_lines(cubin: bytes, top: int = 20) -> dict[str, Any]:
    """The tile loop's instructions (``loop_mix``'s loop) by the source line they were compiled from: what a change
    to the checks would save, line by line. From nvdisasm's line table (Triton compiles with line info); an inlined
    device function's instructions count at its own line, Triton's library functions (tl.sum's combine, ...) at the
    line that called them. loop_lines: the ``top`` lines by instructions, each with "at" (file:line), "via" (the line
    that called it, for a device function), its source text (a kernel edited in memory by ``edited_module`` keeps
    its lines' numbers) and its count; loop_lines_rest: every other line's instructions. The two add up to
    ``loop_mix``'s loop_instructions."""
    text = _disassemble(cubin, ["-gi", "-c"])
    code: list[tuple[int, str, str]] = []
    at: tuple[tuple[str, int], tuple[str, int] | None] | None = None
    where: dict[int, Any] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    frames: list[tuple[str, int]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if (m := _LINE_INFO.search(line)) is not None:
            # An inlined location is printed innermost first, one line per caller: the line is the first frame
            # outside Triton's library.
            if not frames:
                frames = [(m.group(1), int(m.group(2)))]
            if m.group(3):
                frames.append((m.group(3), int(m.group(4))))
            ours = [f for f in frames if not f[0].startswith(_LIBRARY)] or frames[-1:]
            at = (ours[0], ours[1] if len(ours) > 1 else None)
            continue
        frames = []
        if (m := re.match(r"\.L_x_(\d+):", line)) is not None:
            pending.append(m.group(1))
        elif (m := _INSTRUCTION.match(line)) is not None:
            addr = int(m.group(1), 16)
            for label in pending:
                labels[label] = addr
            pending = []
            code.append((addr, m.group(2), m.group(3)))
            where[addr] = at
    # nvdisasm names branch targets by label (.L_x_N), cuobjdump by address: the same loop either way.
    code = [(a, op, re.sub(r"\.L_x_(\d+)", lambda t: hex(labels.get(t.group(1), -1)), rest)) for a, op, rest in code]
    lo, hi = _loop_range(code)
    counts: dict[Any, int] = {}
    for addr, _, _ in code:
        if lo <= addr <= hi:
            counts[where[addr]] = counts.get(where[addr], 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])

    def frame(f: tuple[str, int] | None) -> str:
        return f"{Path(f[0]).name}:{f[1]}" if f else ""

    lines = [{"at": frame(key[0]) if key else "?", "via": frame(key[1]) if key else "",
              "source": linecache.getline(*key[0]).strip() if key else "", "instructions": count}
             for key, count in ranked[:top]]
    return {"loop_lines": lines, "loop_lines_rest": sum(c for _, c in ranked[top:])}


def lines_table(mix: dict[str, Any]) -> str:
    """``loop_lines`` as a table: instructions, line, the line that called it, source."""
    rows = [[x["instructions"], x["at"], x["via"], x["source"][:90]] for x in mix["loop_lines"]]
    rows.append([mix["loop_lines_rest"], "(every other line)", "", ""])
    return _common.table(rows, ["instructions", "line", "called from", "source"])


def _disassemble(cubin: bytes, flags: list[str], tool: str = "nvdisasm") -> str:
    """The output of one of the CUDA binary tools bundled with Triton (nvdisasm, cuobjdump) on a cubin."""
    path = Path("/tmp") / f"attnchecker_{time.time_ns()}.cubin"
    path.write_bytes(cubin)
    try:
        return subprocess.run([str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool), *flags,
                               str(path)], capture_output=True, text=True, check=True).stdout
    finally:
        path.unlink()


def _cuobjdump(cubin: bytes, flag: str) -> str:
    return _disassemble(cubin, [flag], "cuobjdump")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--mix", action="store_true", help="also the key-tile loop's instructions by class")
    parser.add_argument("--lines", type=int, default=0, metavar="N",
                        help="with --mix, each variant's interior loop by source line: its N costliest lines, "
                             "printed and in the JSON (loop_lines)")
    parser.add_argument("--by-dot", choices=("auto", "on", "off"), default="auto",
                        help="the bf16/fp16 variants' row references on the tensor cores (BY_DOT): as the launcher "
                             "picks for the arch's tiles (auto), or forced, to weigh the two forms on the same tiles")
    parser.add_argument("--warps", type=int, default=None,
                        help="compile every variant on this many warps instead of the launcher's choice")
    parser.add_argument("--tiles", default=None, metavar="M,N,WARPS,STAGES",
                        help="compile every variant on these tiles (query rows, keys, warps, stages) instead of the "
                             "launcher's choice, e.g. 128,64,8,3 (gpu_suite.py's FORWARD_TILES_TRIED)")
    parser.add_argument("--types-only", action="store_true",
                        help="compile from the argument types alone, not specialised as a GPU launch is")
    parser.add_argument("--only", default=None, metavar="VARIANT[;VARIANT]",
                        help="compile only these of the kernel's variants (names as printed, ';'-separated); the "
                             "full checks over the vendor's forward are always compiled")
    parser.add_argument("--out", type=Path, default=None, help="write the table as JSON here")
    args = parser.parse_args()
    only = None if args.only is None else [x.strip() for x in args.only.split(";")]
    if only is not None and (unknown := sorted(set(only) - set(VARIANTS))):
        parser.error(f"--only: unknown variants {unknown}; choose from {list(VARIANTS)}")
    d = args.head_dim
    # The tiles the launcher picks on that arch (gpu_blocks with its shared memory per block, per dtype): 64 × 32
    # past head dim 64 and 16 × 16 past 128 on the 99 KB GPUs; 4 warps or 8.
    from triton_compile_matrix import SHARED_MEMORY_PER_BLOCK

    limit = SHARED_MEMORY_PER_BLOCK.get(args.arch)
    launched = not args.types_only

    def build(kernel: Any, dtype: str, blocks: ta.Blocks, spec: dict[str, Any]) -> Any:
        return triton.compile(source(dtype, blocks, kernel, launched=launched, **spec),
                              target=GPUTarget("cuda", args.arch, 32),
                              options={"num_warps": blocks.warps, "num_stages": blocks.stages})

    rows = []
    for name, spec in VARIANTS.items():
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        spec = dict(spec)
        dtype = spec.pop("dtype")
        blocks = ta.gpu_blocks(d, limit, TORCH_DTYPES[dtype], full=spec.get("MODE") == 2)
        if spec.get("REPAIR") or args.warps:
            blocks = dataclasses.replace(blocks, warps=args.warps or ta.REPAIR_WARPS)
        if args.tiles:
            m, n, warps, stages = (int(x) for x in args.tiles.split(","))
            blocks = dataclasses.replace(blocks, m=m, n=n, warps=warps, stages=stages)
        if args.by_dot != "auto" and dtype != "fp32":
            spec["BY_DOT"] = args.by_dot == "on"
        compiled = build(None, dtype, blocks, spec)
        row = {"variant": name, "dtype": dtype, "head_dim": d, "block_m": blocks.m, "block_n": blocks.n,
               "warps": blocks.warps, "stages": blocks.stages, "launched": launched,
               **resources(compiled.asm["cubin"]), "shared_launch": compiled.metadata.shared}
        if args.mix:
            row.update(_per_scores(loop_mix(compiled.asm["cubin"]), blocks))
            checked = spec.get("MODE") == 2 and not spec.get("REPAIR")
            if checked:
                lean = build(clean_path_kernel(), dtype, blocks, spec)
                row["clean_path"] = {**resources(lean.asm["cubin"]), **_per_scores(loop_mix(lean.asm["cubin"]), blocks)}
            if not spec.get("REPAIR"):
                inner = build(interior_kernel(clean=checked), dtype, blocks, spec)
                row["interior"] = {**resources(inner.asm["cubin"]),
                                   **_per_scores(loop_mix(inner.asm["cubin"]), blocks)}
                if args.lines:
                    row["interior"].update(loop_lines(inner.asm["cubin"], top=args.lines))
                    print(f"{name}, interior loop by source line:\n{lines_table(row['interior'])}", flush=True)
        rows.append(row)
        print(f"{name:45s} {dtype:5s} {blocks.m}x{blocks.n} warps {blocks.warps}: {row['reg']} registers, "
              f"{row['stack']} B stack (spills), {row['shared_launch']} B shared ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    # Tier 1 over the vendor's forward: one pass over its output and log-sum-exp, no key loop (so no mix).
    given = []
    for dtype in ("bf16", "fp16", "fp32"):
        blocks = ta.gpu_blocks(d, limit, TORCH_DTYPES[dtype], full=False)
        compiled = triton.compile(source(dtype, blocks, ta._trip_given, launched=launched),
                                  target=GPUTarget("cuda", args.arch, 32), options={"num_warps": blocks.warps})
        given.append({"kernel": "_trip_given", "dtype": dtype, "head_dim": d, "block_m": blocks.m,
                      "warps": blocks.warps, **resources(compiled.asm["cubin"])})
        print(f"{'tier 1 over the vendor forward (_trip_given)':45s} {dtype:5s} {blocks.m} rows warps "
              f"{blocks.warps}: {given[-1]['reg']} registers, {given[-1]['stack']} B stack (spills)", flush=True)
    # The full checks over the vendor's forward (kernels/triton_given_check.py): its key-tile loop, on the tiles the
    # launcher gives the full checks, against the plain kernel's loop above.
    for dtype in ("bf16", "fp16"):
        t0 = time.perf_counter()
        blocks = ta.given_check_blocks(ta.gpu_blocks(d, limit, TORCH_DTYPES[dtype], full=True))
        if args.warps:
            blocks = dataclasses.replace(blocks, warps=args.warps)
        if args.tiles:
            m, n, warps, stages = (int(x) for x in args.tiles.split(","))
            blocks = dataclasses.replace(blocks, m=m, n=n, warps=warps, stages=stages)
        compiled = build(triton_given_check._check_given, dtype, blocks, {})
        row = {"variant": f"full checks over the vendor's forward (_check_given), {dtype}", "dtype": dtype,
               "head_dim": d, "block_m": blocks.m, "block_n": blocks.n, "warps": blocks.warps, "stages": blocks.stages,
               "launched": launched, **resources(compiled.asm["cubin"]), "shared_launch": compiled.metadata.shared}
        if args.mix:
            row.update(_per_scores(loop_mix(compiled.asm["cubin"]), blocks))
            inner = build(edited_module(triton_given_check, "interior", GIVEN_INTERIOR_EDITS)._check_given, dtype,
                          blocks, {})
            row["interior"] = {**resources(inner.asm["cubin"]), **_per_scores(loop_mix(inner.asm["cubin"]), blocks)}
            if args.lines:
                row["interior"].update(loop_lines(inner.asm["cubin"], top=args.lines))
                print(f"{row['variant']}, interior loop by source line:\n{lines_table(row['interior'])}", flush=True)
        rows.append(row)
        print(f"{row['variant']:45s} {blocks.m}x{blocks.n} warps {blocks.warps}: {row['reg']} registers, "
              f"{row['stack']} B stack (spills), {row['shared_launch']} B shared ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    if args.mix:
        print_mix(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"arch": f"sm_{args.arch}", "triton": triton.__version__, "by_dot": args.by_dot,
                                        "launch": LAUNCH if launched else None, "warps": args.warps,
                                        "tiles": args.tiles, "rows": rows,
                                        "given_pass": given}, indent=2) + "\n")


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _per_scores(mix: dict[str, Any], blocks: ta.Blocks) -> dict[str, Any]:
    """The loop mix with per_1k_scores: its instructions over the program's warps per 1,000 scores of its tile."""
    return {**mix, "per_1k_scores": round(1000 * mix["loop_instructions"] * blocks.warps / (blocks.m * blocks.n), 1)}


def print_mix(rows: list[dict[str, Any]]) -> None:
    """One line per variant and path: the loop's instructions per warp, per 1,000 scores over the warps, its ratio
    to the plain kernel's, and the classes."""
    plain = rows[0]["per_1k_scores"]
    classes = sorted({c for r in rows for c in r["loop_mix"]},
                     key=lambda c: -max(r["loop_mix"].get(c, 0) for r in rows))
    print("\nkey-tile loop, instructions per iteration per warp, and per 1,000 scores over the program's warps; "
          "'clean path': without the branches only a flagged tile takes; 'interior': a tile with no masked element")
    print(f"{'variant':62s} {'warp':>6s} {'/1k':>6s} {'× plain':>7s} {'stack':>6s}  "
          + "  ".join(f"{c[:14]:>14s}" for c in classes))
    for r in rows:
        for label, m in ((r["variant"], r), (r["variant"] + ", clean path", r.get("clean_path")),
                         (r["variant"] + ", interior", r.get("interior"))):
            if m is not None:
                print(f"{label:62s} {m['loop_instructions']:6d} {m['per_1k_scores']:6.0f} "
                      f"{m['per_1k_scores'] / plain:7.2f} {m['stack']:6d}  "
                      + "  ".join(f"{m['loop_mix'].get(c, 0):14d}" for c in classes))


if __name__ == "__main__":
    main()
