"""Every Triton kernel configuration the tests launch, compiled for a GPU without one.

The Triton tests run on the CPU under Triton's interpreter, which executes a kernel's Python and never compiles it.
A configuration that Triton's compiler rejects (a constexpr branch, a mask kind, a dtype) therefore passes every
test here and fails on a GPU at its first launch. This tool runs a pytest selection under the interpreter with
every launch recorded (bench/_launch_recorder.py: kernel, argument types, constexprs, warps), turns each into the
configuration a GPU launches (``gpu_config``: the tile sizes and operand modes the interpreter replaces), and compiles
each distinct one for the target with Triton's compiler and its bundled ptxas, offline. A static check, not a
timing: which configurations compile, and each one's registers and spill stack.

    .venv/bin/python bench/triton_compile_matrix.py [--jobs 2] [--arch 90] [--out docs/perf/triton_compile_matrix.json]
        [--only kernel=_attention,REPAIR=true] [PYTEST_ARGS ...]   (default: the Triton test files, TESTS)

``--only`` compiles the configurations that match every ``KEY=VALUE`` (``kernel`` the kernel's name, any other key a
constexpr) and leaves the rest out of the report, so a check of one kernel need not compile the others.

Exits 1 when a configuration does not compile. The first run compiles each configuration (seconds for most, 20 s to
three minutes for the attention's repair kernel on one core, by machine); Triton's cache keeps them.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _common

_common.setup_path()
TESTS = ("tests/agent/test_triton_attention.py", "tests/agent/test_attention_triton.py",
         "tests/agent/test_triton_attention_backward.py", "tests/agent/test_triton_gemm_check.py",
         "tests/agent/test_whole_step_triton.py")
"""The test files that launch the Triton kernels: the attention forward and backward, the GEMM checks, whole steps."""


def record(pytest_args: list[str], jobs: int) -> tuple[dict[str, int], str]:
    """Run pytest_args under the interpreter with launches recorded: ({launch key (JSON): launches}, pytest's
    summary line). Test outcomes do not matter here, only what was launched."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRITON_INTERPRET": "1", "ATTNCHECKER_LAUNCHES": f"{tmp}/launches",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT / "agent"),
                                              os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "_launch_recorder", "-q", "-p", "no:randomly",
                               "-n", str(jobs), *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True,
                              check=False)
        seen: dict[str, int] = {}
        for path in glob.glob(f"{tmp}/launches.*"):
            for key, n in json.loads(Path(path).read_text()).items():
                seen[key] = seen.get(key, 0) + n
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if not seen:
        raise RuntimeError(f"no Triton launch recorded (pytest: {summary!r}; stderr: {proc.stderr[-2000:]})")
    return seen, summary


def gpu_configs(launch: dict[str, Any], head_dims: tuple[int, ...], arch: int = 90) -> list[dict[str, Any]]:
    """The launch as a GPU makes it, at each of head_dims for the attention's kernels: the tests' small head dims
    keep the interpreter fast, and the compiler's layouts (and what fails in them) change with the head dim, so the
    configurations are compiled at the dims models use (64 and 128) in their place."""
    if launch["module"].rsplit(".", 1)[-1] not in ("triton_attention", "triton_attention_bwd") \
            or "BLOCK_D" not in launch["constexprs"] or not head_dims:
        return [gpu_config(launch, arch)]
    return [gpu_config({**launch, "constexprs": {**launch["constexprs"], "BLOCK_D": d}}, arch) for d in head_dims]


def gpu_config(launch: dict[str, Any], arch: int = 90) -> dict[str, Any]:
    """The launch as a GPU of compute capability ``arch`` makes it. Under the interpreter the launchers pick other
    tiles and operand modes; each choice below is the GPU side of the function that makes it:
    - kernels/triton_attention: tiles ``gpu_blocks(d, the arch's shared memory per block, the launch's dtype)``
      (64 x 64, 2 stages, on 4 warps in bf16 and fp16 where two programs fit an SM, else 8: ``full`` by the mode
      and kernel; the repair on ``REPAIR_WARPS``; 64 x 32 past head dim 64 on a 99 KB GPU) where the interpreter
      takes 16 x 16 (``block_sizes``);
      ``dot_mode`` 2 (bf16 cast to fp32: the interpreter's tl.dot takes no bf16) is 0 on a GPU, and 3 (TF32 emulated
      by truncation) is 1 (the tensor cores' TF32); ``refs_by_dot`` holds on those tiles only from BY_DOT_MIN_ROWS
      rows, where the interpreter takes it on every tile;
    - kernels/triton_attention_bwd: INTERPRET off; tiles, stages and the passes' warps ``gpu_tiles(d, the arch's
      shared memory per block)`` (32 x 32 on 3 stages where they fit: the interpreter's tiles); BY_DOT as
      ``by_dot`` picks it on a GPU for the pass, dtype and head dim;
    - kernels/triton_gemm_kernels: the tiles of ``triton_gemm_check._blocks`` for a CUDA device, ``_dot_flags``'s
      operand modes for CUDA tensors (fp32 products only where the operands' dtypes differ), and the operand pass's
      CAST 3 (bf16 rounded on the bits under the interpreter) as 1 (the GPU's conversion).
    Any other kernel is launched alike on both."""
    from attnchecker.kernels import triton_attention as ta
    from attnchecker.kernels import triton_gemm_check as tgc

    module = launch["module"].rsplit(".", 1)[-1]
    consts = dict(launch["constexprs"])
    options = dict(launch["options"])
    if module == "triton_attention":
        import torch

        signature = launch.get("signature", {})
        operand = {"*bf16": torch.bfloat16, "*fp16": torch.float16}.get(signature.get("Q", signature.get("K")),
                                                                         torch.float32)
        # The full checks' tiles for _kv_tiles (made for them only) and for a first pass of mode 2; tier 1's for
        # _trip_given and mode 0 and 1 (gpu_blocks' full).
        full = launch["kernel"] == "_kv_tiles" or consts.get("MODE") == 2
        blk = ta.gpu_blocks(consts.get("BLOCK_D", 64), SHARED_MEMORY_PER_BLOCK.get(arch), operand, full=full)
        consts.update({k: v for k, v in (("BLOCK_M", blk.m), ("BLOCK_N", blk.n)) if k in consts})
        if "DOT" in consts:
            consts["DOT"] = {2: 0, 3: 1}.get(consts["DOT"], consts["DOT"])
        if "BY_DOT" in consts:
            consts["BY_DOT"] = bool(consts["BY_DOT"]) and blk.m >= ta.BY_DOT_MIN_ROWS
        options["num_warps"] = ta.REPAIR_WARPS if consts.get("REPAIR") else blk.warps
        if launch["kernel"] == "_attention":
            options["num_stages"] = blk.stages
    elif module == "triton_attention_bwd":
        import torch

        from attnchecker.kernels import triton_attention_bwd as tab

        operand = {"*bf16": torch.bfloat16, "*fp16": torch.float16}.get(launch["signature"].get("Q"), torch.float32)
        tile = tab.gpu_tiles(consts.get("BLOCK_D", 64), SHARED_MEMORY_PER_BLOCK.get(arch), operand)
        consts.update({k: tile.block for k in ("BLOCK_M", "BLOCK_N") if k in consts})
        if "INTERPRET" in consts:
            consts["INTERPRET"] = False
        if "BY_DOT" in consts:
            # The interpreter takes every tensor-core form (bits 1 and 3); a GPU those ``by_dot`` picks for the
            # pass at this head dim.
            picked = tab.by_dot(operand, consts.get("BLOCK_D", 64))
            consts["BY_DOT"] = picked[launch["kernel"] != "_query_pass"] if consts["BY_DOT"] else 0
        if launch["kernel"] in ("_query_pass", "_key_pass"):
            options["num_stages"] = tile.stages
            options["num_warps"] = tab.pass_warps(tile, launch["kernel"], tab.CHECKS[consts.get("CHECK", 0)],
                                                  consts.get("BY_DOT", 0))
    elif module == "triton_gemm_kernels":
        import torch

        blk = tgc._blocks(torch.device("cuda"))
        scan = launch["kernel"] in ("trip_pass", "trip_pass_pair")
        operand = {"*fp32": torch.float32}.get(launch["signature"].get("x_ptr"), torch.bfloat16)
        br, bc = blk.operand_tiles(operand)
        sizes = {"BM": blk.rows, "BN": blk.cols, "BR": br, "BC": bc,
                 "BK": blk.recompute_k if scan else blk.k, "RBN": blk.recompute_cols}
        consts.update({k: v for k, v in sizes.items() if k in consts})
        if consts.get("CAST") == 3:  # bf16 rounded on the bits: the interpreter's form; a GPU converts natively
            consts["CAST"] = 1
        # Each GEMM's operand mode as a GPU takes it (trip_pass_pair: the second GEMM's with its own names).
        for a_arg, b_arg, dot, ieee in (("a_ptr", "b_ptr", "DOT_FP32", "IEEE"),
                                        ("a2_ptr", "b2_ptr", "DOT_FP32_2", "IEEE2")):
            a, b = launch["signature"].get(a_arg), launch["signature"].get(b_arg)
            if dot in consts and a is not None and b is not None:
                consts[dot] = a != b
                consts[ieee] = a != b or a == "*fp32"
    return {**launch, "constexprs": consts, "options": options}


SHARED_MEMORY_PER_BLOCK = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
"""The most shared memory one block may use, opted in, per compute capability (bytes): a kernel that asks for more
compiles and then fails at its first launch ("out of resource: shared memory")."""

def only_filter(spec: str) -> dict[str, Any]:
    """``--only``'s ``KEY=VALUE,...`` as {key: value}, each value read as JSON where it is JSON (true, 2) and as a
    string where not (a kernel's name)."""
    wanted: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"KEY=VALUE pairs separated by commas, got {item!r} "
                                             "(e.g. --only kernel=_attention,REPAIR=true)")
        try:
            wanted[key.strip()] = json.loads(value.strip())
        except json.JSONDecodeError:
            wanted[key.strip()] = value.strip()
    return wanted


def matches(config: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether the GPU configuration has every ``--only`` value (``kernel`` its name, other keys its constexprs)."""
    missing = object()  # a constexpr the kernel does not have matches no value
    return all((config["kernel"] if key == "kernel" else config["constexprs"].get(key, missing)) == value
               for key, value in wanted.items())


DIAGNOSTICS = 5
"""Error lines of a failed compile kept in its row."""


@contextlib.contextmanager
def fd2_into(path: Path) -> Iterator[None]:
    """The process's fd 2 written into ``path`` for the block. MLIR's passes print their diagnostics there, below
    Python's sys.stderr; the exception Triton raises says only "PassManager::run failed"."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "wb") as sink:
            os.dup2(sink.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def diagnostics(message: str, stderr: str) -> list[str]:
    """The error lines of a failed compile, the compiler's own (from ``stderr``) before the exception's, at most
    DIAGNOSTICS, each cut at 300 characters; the exception's first line where neither holds one."""
    lines = [line.strip() for line in (stderr + "\n" + message).splitlines()]
    errors = list(dict.fromkeys(line[:300] for line in lines if "error:" in line))
    # Not the first line of stderr: a compile also prints Python's warnings there.
    return errors[:DIAGNOSTICS] or [next((line.strip()[:300] for line in message.splitlines() if line.strip()), "")]


def compile_one(config: dict[str, Any], arch: int) -> dict[str, Any]:
    """Compile one configuration for sm_<arch>: its row of the report (ok, seconds, registers, spill stack; where it
    failed, the compiler's error lines: ``diagnostics``)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT / "bench"))
    import triton_resources

    fn = getattr(importlib.import_module(config["module"]), config["kernel"])
    signature: dict[str, Any] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    for i, name in enumerate(fn.arg_names):
        kind = config["signature"].get(name) if name not in config["constexprs"] else None
        if name in config["constexprs"] or kind is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = config["constexprs"].get(name)
        else:
            signature[name] = tuple(kind) if isinstance(kind, list) else kind
    t0 = time.perf_counter()
    # The constexprs do not say the operands' dtype: the first pointer parameter's element type does (q for the
    # attention's kernels, the checked output for the GEMM checks').
    pointer = next((signature[n] for n in fn.arg_names if str(signature[n]).startswith("*")), None)
    row: dict[str, Any] = {"kernel": config["kernel"], "constexprs": config["constexprs"],
                           "options": config["options"], "launches": config["launches"],
                           "operand_dtype": None if pointer is None else str(pointer)[1:]}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "stderr"
        try:
            with fd2_into(log):
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                          target=GPUTarget("cuda", arch, 32),
                                          options={"num_warps": config["options"].get("num_warps", 4),
                                                   "num_stages": config["options"].get("num_stages", 3)})
        except Exception as exc:  # the compiler's error is the finding: kept, and the next configuration compiled
            errors = diagnostics(str(exc), log.read_text(errors="replace"))
            return {**row, "ok": False, "seconds": round(time.perf_counter() - t0, 1),
                    "error": f"{type(exc).__name__}: {errors[0]}", "diagnostics": errors}
    row = {**row, "seconds": round(time.perf_counter() - t0, 1), "smem": compiled.metadata.shared,
           **triton_resources.resources(compiled.asm["cubin"])}
    limit = SHARED_MEMORY_PER_BLOCK.get(arch)
    if limit is not None and row["smem"] > limit:
        error = f"needs {row['smem']} B of shared memory, sm_{arch} gives a block at most {limit} B"
        return {**row, "ok": False, "error": f"OutOfResources: {error}", "diagnostics": [error]}
    return {**row, "ok": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest workers, then compile processes")
    parser.add_argument("--head-dims", default="64,128",
                        help="the attention kernels' head dims to compile at (comma-separated; empty: the tests' own)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--only", type=only_filter, default={},
                        help="compile only the configurations with these values: KEY=VALUE,... (kernel=NAME or a "
                             "constexpr, e.g. kernel=_attention,REPAIR=true)")
    args, pytest_args = parser.parse_known_args()
    t0 = time.perf_counter()
    seen, summary = record(pytest_args or list(TESTS), args.jobs)
    print(f"recorded {sum(seen.values())} launches, {len(seen)} configurations under the interpreter ({summary})",
          flush=True)
    os.environ.pop("TRITON_INTERPRET", None)  # this process compiles: its kernels must not be built interpreted
    sys.path.insert(0, str(ROOT / "agent"))
    configs: dict[str, dict[str, Any]] = {}
    head_dims = tuple(int(d) for d in args.head_dims.split(",") if d.strip())
    # The agent's kernels only: a test's own helper kernel is not something a GPU run of the agent launches.
    agent = {k: n for k, n in seen.items() if json.loads(k)["module"].startswith("attnchecker.")}
    print(f"{len(seen) - len(agent)} configurations of the tests' own kernels left out", flush=True)
    for key, n in agent.items():
        for config in gpu_configs(json.loads(key), head_dims, args.arch):
            gpu_key = json.dumps(config, sort_keys=True)
            configs.setdefault(gpu_key, {**config, "launches": 0})["launches"] += n
    chosen = {k: c for k, c in configs.items() if matches(c, args.only)}
    if args.only:
        print(f"--only: {len(chosen)} of {len(configs)} configurations", flush=True)
        if not chosen:
            raise SystemExit(f"--only {args.only} matches none of the {len(configs)} configurations recorded")
    left_out = len(configs) - len(chosen)
    configs = chosen
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(compile_one, configs.values(), [args.arch] * len(configs)))
    failed = [r for r in rows if not r["ok"]]
    by_kernel: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], []).append(r)
    print(f"\n{'kernel':22s} {'configs':>7s} {'failed':>6s} {'registers':>9s} {'max spill':>9s} {'max smem':>9s}")
    for kernel, rs in sorted(by_kernel.items()):
        ok = [r for r in rs if r["ok"]]
        regs = max((r["reg"] for r in ok), default=0)
        spill = max((r["stack"] for r in ok), default=0)
        smem = max((r.get("smem", 0) for r in rs), default=0)
        print(f"{kernel:22s} {len(rs):7d} {len(rs) - len(ok):6d} {regs:9d} {spill:7d} B {smem // 1024:6d} KB")
    for r in failed:
        print(f"\nFAILED {r['kernel']} {json.dumps(r['constexprs'], sort_keys=True)} {r['options']}\n  "
              + "\n  ".join(r["diagnostics"]))
    print(f"\n{len(rows)} configurations for sm_{args.arch}, {len(failed)} failed "
          f"({time.perf_counter() - t0:.0f} s)")
    if args.out is not None:
        import triton

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"arch": f"sm_{args.arch}", "triton": triton.__version__,
                                        "pytest_args": pytest_args or list(TESTS), "pytest": summary,
                                        "head_dims": list(head_dims),
                                        "tests_own_kernels_left_out": len(seen) - len(agent),
                                        "only": args.only, "left_out_by_only": left_out,
                                        "configurations": len(rows), "failed": len(failed), "rows": rows},
                                       indent=1, sort_keys=True) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
