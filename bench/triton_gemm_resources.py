"""What the GEMM checks' Triton kernels compile to on a GPU, without one: the launches a checked Linear makes at a
model's shape, captured from the launchers themselves (kernels/triton_gemm_check.py, with the tiles and operand modes
they pick for a CUDA device) and compiled offline for sm_90 (an H100/H200) with the specialisation Triton's JIT gives
those arguments on a GPU (a stride of 1 a constant, 16-divisible sizes and 16-byte-aligned pointers marked). Per
kernel: registers, the stack frame, and its scan loop (the first innermost loop that loads from global memory: the
one read of its matrix every call makes) by instruction class, with the issue slots one element costs there.

A static report, not a timing (bench/gpu_suite.py's ``gemm_check`` section times the kernels on a GPU). The figure
it gives, warp instructions per element of the scanned matrix, weighs against the data sheet: an H100 SXM issues at
most 132 SMs × 4 schedulers × 1.98 GHz ≈ 1.05·10¹² warp instructions a second and reads 3.35·10¹² bytes, so a bf16
scan is issue-bound past ~0.6 instructions an element (``issue_vs_hbm`` > 1: the loop, not memory, sets its time).

    .venv/bin/python bench/triton_gemm_resources.py [--shape llama_7b|gpt2] [--dtype bf16|fp16|fp32]
        [--kernels operand_pass,...] [--operand-tiles BR,BC,WARPS] [--out docs/perf/triton_gemm_resources.json]

Compiling the check pass and the repair kernel takes a minute or two on one core the first time (cached in the
checkout, as bench/triton_resources.py caches).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "agent"))
os.environ.pop("TRITON_INTERPRET", None)  # this process compiles: nothing here may be built interpreted

import _common
import torch
import triton
import triton_resources
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from attnchecker.abft import Tolerance
from attnchecker.gemm import device
from attnchecker.kernels import triton_gemm_check as tg

SHAPES = {
    # name: (tokens M, in features I, out features O, layout, bias, dtype)
    "llama_7b": (8192, 4096, 4096, "out_in", False, torch.bfloat16),
    "gpt2": (8192, 768, 3072, "in_out", True, torch.bfloat16),
}
"""A Llama-7B projection (nn.Linear, bf16) and GPT-2-small's MLP c_fc (HF Conv1D, bias), 8192 tokens."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "autocast-bf16": torch.bfloat16}
"""autocast-bf16: a Linear given with fp32 x and W (the master weights) and bf16 outputs and dY, as a caller that does
not hand the checks autocast's rounded copies (the integrations do: their autocast GEMMs are the bf16 rows)."""
H100_WARP_ISSUE_PER_S = 132 * 4 * 1.98e9
H100_HBM_BYTES_PER_S = 3.35e12


class _Captured:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` is recorded, nothing runs."""

    def __init__(self, name: str, into: list[dict[str, Any]]) -> None:
        self.name, self.into = name, into

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.into.append({"kernel": self.name, "grid": grid, "args": args, "kwargs": kwargs})
        return launch


@contextlib.contextmanager
def captured_as_on_cuda() -> Iterator[list[dict[str, Any]]]:
    """The launchers' calls recorded instead of made, with the tiles and operand modes they take on a CUDA device."""
    launches: list[dict[str, Any]] = []
    stand_in = types.SimpleNamespace(**{name: _Captured(name, launches)
                                        for name in ("operand_pass", "check_pass", "repair_rows", "trip_pass",
                                                     "trip_pass_pair")})
    saved = tg._kernels, tg._compiled
    tg._kernels, tg._compiled = (lambda: stand_in), (lambda _device: True)  # type: ignore[assignment]
    try:
        yield launches
    finally:
        tg._kernels, tg._compiled = saved  # type: ignore[assignment]


def linear_launches(shape: str, dtype: torch.dtype, autocast: bool = False) -> list[dict[str, Any]]:
    """A Linear's launches on a full-check step at this shape (its forward: the weight pass, the x pass, y's check
    pass and repair; its backward: the dY pass, dX's and dW's check passes and repairs), y's tier-1 pass and dX's and
    dW's in one launch."""
    m, i, o, layout, has_bias, _ = SHAPES[shape]
    tol = Tolerance()
    operand = torch.float32 if autocast else dtype
    x = torch.empty(m, i, dtype=operand)
    weight = torch.empty((o, i) if layout == "out_in" else (i, o), dtype=operand)
    bias = torch.empty(o, dtype=operand) if has_bias else None
    y, dy = torch.empty(m, o, dtype=dtype), torch.empty(m, o, dtype=dtype)
    dx, dw = torch.empty(m, i, dtype=dtype), torch.empty(weight.shape, dtype=dtype)
    w_io = weight.T if layout == "out_in" else weight
    w_oi = weight if layout == "out_in" else weight.T
    with captured_as_on_cuda() as launches:
        runs_o, runs_i = device.runs(o, tol), device.runs(i, tol)
        ws = tg.Workspace(torch.device("cpu"), 1 << 26)
        cast = device._casts(y.dtype, x, weight)
        fwd, fwd_sq, ww, w_sq = device._weight_pass(weight, layout, ws, runs_o=runs_o, runs_i=runs_i, cast=cast)
        xo = tg.operand_pass(x, ws, right=fwd, right_w=runs_i, row_sq=True, col_sq=True, cast=cast)
        assert xo.xv is not None and xo.rsq is not None and fwd_sq is not None and xo.vsq is not None
        assert xo.xw is not None and xo.csq is not None and ww is not None and w_sq is not None
        fwd_gemm = device.DeviceGemm("linear", y, x, w_io, bias)
        device._launch(fwd_gemm, tg.RowSide(ref=xo.xv, a_sq=xo.rsq, b_sq=fwd_sq, ref_sq=xo.vsq, runs=runs_o), ws, tol,
                       correct=True)
        do = tg.operand_pass(dy, ws, right=ww, row_sq=True, left=xo.xw, col_sq=True)
        assert do.xv is not None and do.rsq is not None and do.vsq is not None
        assert do.lx is not None and do.csq is not None and do.lsq is not None
        device._launch(device.DeviceGemm("linear_dx", dx, dy, w_oi, None),
                       tg.RowSide(ref=do.xv, a_sq=do.rsq, b_sq=w_sq, ref_sq=do.vsq, runs=runs_i), ws, tol, correct=True)
        dw_oi = dw if layout == "out_in" else dw.mT
        device._launch(device.DeviceGemm("linear_dw", dw_oi, dy.T, x, None),
                       tg.RowSide(ref=do.lx, a_sq=do.csq, b_sq=xo.csq, ref_sq=do.lsq, runs=runs_i), ws, tol,
                       correct=True)
        device._trip_launch(fwd_gemm, ws, tol, correct=True)
        tg.trip_pass_pair(*(tg.TripGemm(g.c, g.a, g.b, None, device._rule(g, tol, 1))
                            for g in (device.DeviceGemm("linear_dx", dx, dy, w_oi, None),
                                      device.DeviceGemm("linear_dw", dw_oi, dy.T, x, None))), ws, correct=True)
    names = ["operand_pass (W)", "operand_pass (x)", "check_pass (y)", "repair_rows (y)", "operand_pass (dY)",
             "check_pass (dX)", "repair_rows (dX)", "check_pass (dW)", "repair_rows (dW)", "trip_pass (y)",
             "trip_pass_pair (dX, dW)"]
    for launch, name in zip(launches, names, strict=True):
        launch["role"] = name
    return launches


def source(launch: dict[str, Any]) -> tuple[ASTSource, dict[str, Any]]:
    """The launch as Triton's JIT would compile it on a GPU: each argument specialised as ``native_specialize_impl``
    specialises it there (tensors by dtype and 16-byte alignment, integers 1 as constants and 16-divisible ones
    marked, floats as fp32), the constexprs as given. Returns (source, options)."""
    fn = getattr(importlib.import_module("attnchecker.kernels.triton_gemm_kernels"), launch["kernel"])
    names = fn.arg_names
    values = dict(zip(names, launch["args"], strict=False))
    options = {k: launch["kwargs"][k] for k in ("num_warps", "num_stages") if k in launch["kwargs"]}
    values.update({k: v for k, v in launch["kwargs"].items() if k not in options})
    signature: dict[str, Any] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for index, name in enumerate(names):
        value = values[name]
        param = fn.params[index]
        if param.is_constexpr:
            signature[name], constexprs[(index,)] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize, True)
        if kind == "constexpr":
            signature[name], constexprs[(index,)] = "constexpr", attr
            continue
        signature[name] = kind
        if attr:
            attrs[(index,)] = CUDABackend.parse_attr(attr)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options


def scan_loop(sass: str) -> list[tuple[int, str]]:
    """The scan loop's instructions (address, opcode): the first innermost loop (a backward branch's range holding
    no other) that loads from global memory."""
    code = [(int(a, 16), op) for a, op, _ in triton_resources._INSTRUCTION.findall(sass)]
    back = [(int(t.group(1), 16), int(a, 16)) for a, op, rest in triton_resources._INSTRUCTION.findall(sass)
            if op == "BRA" and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < int(a, 16)]
    loads = [a for a, op in code if op in ("LDG", "LDGSTS", "UTMALDG")]
    loops = [(lo, hi) for lo, hi in back if any(lo <= a <= hi for a in loads)]
    innermost = sorted((lo, hi) for lo, hi in loops
                       if not any((c, d) != (lo, hi) and lo <= c and d <= hi for c, d in loops))
    lo, hi = innermost[0]
    return [(a, op) for a, op in code if lo <= a <= hi]


def analyse(launch: dict[str, Any]) -> dict[str, Any]:
    src, options = source(launch)
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": options.get("num_warps", 4),
                                       "num_stages": options.get("num_stages", 3)})
    seconds = time.perf_counter() - t0
    cubin = compiled.asm["cubin"]
    sass = triton_resources._cuobjdump(cubin, "-sass")
    loop = scan_loop(sass)
    mix: dict[str, int] = {}
    for _, op in loop:
        cls = triton_resources.CLASSES.get(op, "integer, move, control")
        mix[cls] = mix.get(cls, 0) + 1
    consts = launch["kwargs"]
    rows = consts.get("BM", consts.get("BR"))
    cols = consts.get("BN", consts.get("BC"))
    warps = options.get("num_warps", 4)
    per_element = len(loop) * warps / (rows * cols)
    issue_s = per_element / H100_WARP_ISSUE_PER_S
    # The matrix the loop scans is each kernel's first argument (x_ptr, c_ptr): an autocast pass reads fp32.
    hbm_s = launch["args"][0].element_size() / H100_HBM_BYTES_PER_S
    return {"role": launch["role"], "kernel": launch["kernel"],
            "constexprs": {k: v for k, v in consts.items() if isinstance(v, (bool, int))},
            "compile_s": round(seconds, 1), **triton_resources.resources(cubin),
            "instructions": len(triton_resources._INSTRUCTION.findall(sass)),
            "scan_loop": {"instructions": len(loop), "tile": [rows, cols], "warps": warps, "mix": mix,
                          "warp_instructions_per_element": round(per_element, 3),
                          "issue_vs_hbm": round(issue_s / hbm_s, 2)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama_7b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="the tensors' dtype (default: the shape's); autocast-bf16: fp32 operands, bf16 outputs")
    ap.add_argument("--kernels", default=None, help="compile only these kernels (comma-separated, e.g. operand_pass)")
    ap.add_argument("--operand-tiles", default=None, metavar="BR,BC,WARPS",
                    help="compile the operand passes at these tiles and warps instead of the launcher's")
    ap.add_argument("--out", default=None, help="JSON path (default docs/perf/triton_gemm_resources.json)")
    args = ap.parse_args()
    dtype = DTYPES[args.dtype] if args.dtype else SHAPES[args.shape][-1]
    rows = []
    seen: dict[str, dict[str, Any]] = {}
    for launch in linear_launches(args.shape, dtype, autocast=args.dtype == "autocast-bf16"):
        if args.kernels and launch["kernel"] not in args.kernels.split(","):
            continue
        if args.operand_tiles and launch["kernel"] == "operand_pass":
            br, bc, warps = (int(v) for v in args.operand_tiles.split(","))
            launch["kwargs"] = {**launch["kwargs"], "BR": br, "BC": bc, "num_warps": warps}
        src, _ = source(launch)
        key = repr((launch["kernel"], sorted(src.signature.items()), sorted(src.constants.items()),
                    sorted(src.attrs.items()) if isinstance(src.attrs, dict) else src.attrs))
        row = seen.get(key) or analyse(launch)
        seen[key] = row
        rows.append({**row, "role": launch["role"]})
        s = row["scan_loop"]
        print(f"{launch['role']:18s} reg {row['reg']:3d} stack {row['stack']:5d} B  scan loop {s['instructions']:5d} "
              f"instr on a {s['tile'][0]}x{s['tile'][1]} tile, {s['warp_instructions_per_element']:.2f} warp instr "
              f"/ element ({s['issue_vs_hbm']:.1f}x the HBM time), local {s['mix'].get('local memory (spills)', 0)}",
              flush=True)
    m, i, o, layout, bias, _ = SHAPES[args.shape]
    shape = {"name": args.shape, "tokens": m, "in": i, "out": o, "layout": layout, "bias": bias, "dtype": str(dtype),
             "autocast": args.dtype == "autocast-bf16"}
    sheet = {"warp_issue_per_s": H100_WARP_ISSUE_PER_S, "hbm_bytes_per_s": H100_HBM_BYTES_PER_S}
    path = _common.write_result("triton_gemm_resources", {
        "arch": "sm_90", "triton": triton.__version__, "shape": shape, "operand_tiles": args.operand_tiles,
        "h100_data_sheet": sheet, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
