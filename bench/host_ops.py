"""What one protected training step asks of the host on the GPU route, counted on a CPU: the aten ops it dispatches
(on CUDA each one outside a view is a kernel launch or more, and a few microseconds of the host's time), the Triton
kernels it launches, and the calls that make the host wait for the device (syncs), against the unprotected step.

Where a step is launch-bound (a small model on a GPU: docs/performance.md §8, §9), these counts, not FLOPs, are what
protection costs, and they do not depend on the GPU or on the model's width: one count here is what every GPU run
would launch. The step is bench/gpu_suite.py's (its models at their dry-run sizes, its variants, each attached once
and warmed up), on the route a CUDA step takes: the Triton attention (ATTNCHECKER_ATTENTION=triton), the GEMM checks'
Triton path (ATTNCHECKER_GEMM=triton), the attention backward off the CPU-only kernel, every Triton kernel run by
Triton's interpreter. The default variants are counted on a step between full checks (what 7 steps in 8 run); their
checked steps check what the full variants do.

    python bench/host_ops.py [--models gpt2_small,llama_7b] [--seq 64] [--tiny] [--only-host-us]
                             [--out docs/perf/host_ops.json]

It also times what one GEMM check call costs the host besides its launches (``host_us_per_call``: the kernels
replaced by launches that do nothing, against one aten op): a time, of this machine's CPU, not a count.

Counts are exact and deterministic (one run says it all). Ops are the profiler's leaf aten ops (nothing under them
but allocations) outside the Triton kernels' interpreted bodies, a foreach op (``torch._foreach_norm``:
the optimizer net's gradient norms) counted as one op, as every other op that launches a kernel or more on CUDA:
there a list of one dtype takes the fused multi-tensor kernel (a launch per 110 tensors or so), its partial norms'
reduction and a memset, where the CPU falls back to one norm per tensor, and to a copy of each bf16 gradient in fp32
before it. "By source" attributes torch calls (TorchFunctionMode: one per torch function or method call, which may
dispatch several aten ops) to the innermost attnchecker module that made them.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("ATTNCHECKER_ATTENTION", "triton")
os.environ.setdefault("ATTNCHECKER_GEMM", "triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

_common.setup_path()

import gpu_suite
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

VIEWS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "select", "slice", "unsqueeze", "squeeze",
    "as_strided", "alias", "detach", "reshape", "split", "unbind", "split_with_sizes", "chunk", "narrow",
    "_reshape_alias", "diagonal", "unflatten", "flatten", "lift_fresh", "resolve_conj", "resolve_neg", "view_as",
    "expand_as", "contiguous", "result_type", "empty", "empty_strided", "empty_like", "is_nonzero",
})
"""Ops that launch no kernel on CUDA: views and metadata, and allocations (the caching allocator's, host-side)."""
ALLOCS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"})
"""Allocations: an op with nothing but these under it runs its own kernel."""
SYNCS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.cpu,
                   torch.Tensor.numpy, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
                   torch.Tensor.nonzero})
"""Calls that wait for a device tensor's value (tests/agent/sync_counter.py's list)."""
STEPS = ("baseline", "full", "default_tier1", "all_full", "all_default_tier1")
"""gpu_suite's variants; the default ones on a step between full checks (Guard.tripwire_only_this_step). A default
step with every op due checks what ``full`` does."""
_KERNEL_EVENT = "attnchecker.bench.triton_kernel"


class _Kernels:
    """Counts Triton launches by kernel, and marks the interpreter's run of each so its own torch calls are not
    counted as the step's (on a GPU they are device code)."""

    def __init__(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.by_kernel: collections.Counter[str] = collections.Counter()
        self.depth = 0
        run = InterpretedFunction.run
        kernels = self

        def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
            if not kwargs.get("warmup"):
                kernels.by_kernel[fn.fn.__name__] += 1
            kernels.depth += 1
            try:
                with torch.profiler.record_function(_KERNEL_EVENT):
                    return run(fn, *args, **kwargs)
            finally:
                kernels.depth -= 1

        InterpretedFunction.run = counted


class _Calls(TorchFunctionMode):
    """Torch calls outside the kernels: syncs by name, and every call by the innermost attnchecker module on the
    stack (its path under agent/attnchecker/)."""

    def __init__(self, kernels: _Kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.syncs: collections.Counter[str] = collections.Counter()
        self.by_source: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.kernels.depth:
            name = getattr(func, "__name__", str(func))
            if func in SYNCS:
                self.syncs[name] += 1
            if name not in VIEWS:
                ours = [f.filename.split("/attnchecker/", 1)[1] for f in traceback.extract_stack()[:-1]
                        if "/attnchecker/" in f.filename and "/site-packages/torch" not in f.filename]
                self.by_source[ours[-1] if ours else "(the model, autograd, the optimizer)"] += 1
        return func(*args, **(kwargs or {}))


def _foreach(event: Any) -> bool:
    return bool(event.name.startswith("aten::_foreach_"))


def _below(event: Any, outer: Callable[[Any], bool]) -> bool:
    """Whether an event that encloses this one (its parent, or theirs) is ``outer``."""
    event = event.cpu_parent
    while event is not None:
        if outer(event):
            return True
        event = event.cpu_parent
    return False


def _in_kernel(event: Any) -> bool:
    return bool(event.name == _KERNEL_EVENT)


def count_step(step: Callable[[], None], kernels: _Kernels) -> dict[str, Any]:
    """One step's counts (its job warmed up before)."""
    kernels.by_kernel.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof, _Calls(kernels) as calls:
        step()
    ops: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        # A foreach op counts as one, what runs under it not: on the CPU its fallback runs one op per tensor (and a
        # dtype's copy of each), where CUDA's fused multi-tensor kernel takes the whole list.
        # A leaf: no aten op under it but allocations (``__rshift__`` runs its kernel after an ``empty``; a view
        # such as ``numpy_T`` has its ``permute`` under it, itself a view).
        leaf = _foreach(e) or not any(c.name.startswith("aten::") and c.name[len("aten::"):] not in ALLOCS
                                      for c in e.cpu_children)
        if e.name.startswith("aten::") and leaf and not _below(e, _in_kernel) and not _below(e, _foreach):
            ops[e.name[len("aten::"):]] += 1
    launching = {k: n for k, n in ops.items() if k not in VIEWS}
    return {"aten_ops_launching": sum(launching.values()), "aten_ops_views_and_allocs": sum(ops.values())
            - sum(launching.values()), "triton_launches": sum(kernels.by_kernel.values()),
            "syncs": sum(calls.syncs.values()), "syncs_by_call": dict(calls.syncs),
            "triton_by_kernel": dict(sorted(kernels.by_kernel.items())),
            "foreach_ops": {k: n for k, n in sorted(launching.items()) if k.startswith("_foreach_")},
            "top_ops": dict(collections.Counter(launching).most_common(12)),
            "torch_calls_by_source": dict(calls.by_source.most_common(12))}


def run_model(kind: str, seq: int) -> dict[str, Any]:
    from attnchecker.attention.backward import fused

    fused.cpu_kernel = False  # the CPU-only backward kernel is not on a GPU's route
    kernels = _Kernels()
    base = gpu_suite._model(kind, gpu_suite.DRY_SHAPES[kind], seq, 256)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    rows: dict[str, Any] = {}
    for name in STEPS:
        variant = name.removesuffix("_tier1")
        job = gpu_suite._Job(variant, base, "cpu", torch.bfloat16)
        try:
            def step(job: Any = job, name: str = name) -> None:
                if job.guard is not None and name.endswith("_tier1"):
                    job.guard.tripwire_only_this_step()
                job.step(ids)

            for _ in range(3):
                step()
            rows[name] = count_step(step, kernels)
        finally:
            job.close()
    base_row = rows["baseline"]
    for row in rows.values():
        row["over_baseline"] = {k: row[k] - base_row[k] for k in ("aten_ops_launching", "triton_launches", "syncs")}
    return {"model": kind, "seq": seq, "shape": gpu_suite.DRY_SHAPES[kind], "layers": gpu_suite.LAYERS,
            "steps": rows}


def host_us_per_call(calls: int) -> dict[str, float]:
    """What one GEMM check call costs the host on the Triton path besides its launches: gemm/device.py's tier-1 call
    (trip_gemms) and full check (check_gemms) of one 256 x 256 bf16 product inside a guard's context, their kernels
    replaced by launches that do nothing (on a GPU Triton's own launcher adds its time per launch), against one aten
    add of the same operands. Median microseconds over ``calls`` calls of each."""
    import statistics
    import time

    from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
    from attnchecker.gemm import device
    from attnchecker.kernels import triton_gemm_check as tg

    def no_launch(*_args: Any, **_kwargs: Any) -> None:
        return None

    class _NoLaunch:
        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return no_launch

    class _NoKernels:
        def __getattr__(self, name: str) -> _NoLaunch:
            return _NoLaunch()

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    c = a @ b
    runtime = Runtime(step=0, config=CheckConfig(), injector=None, on_detection=lambda *_: None, stats=OpStats())
    ctx = LayerContext(layer=0, runtime=runtime)
    gemm = [("linear", c, a, b, None)]
    calls_of: dict[str, Callable[[], object]] = {
        "gemm_tier1": lambda: device.trip_gemms(ctx, gemm),
        "gemm_full_check": lambda: device.check_gemms(ctx, gemm),
        "aten_add": lambda: torch.add(a, b),
    }
    kernels, tg._kernels = tg._kernels, _NoKernels  # type: ignore[assignment]
    try:
        got = {}
        for name, call in calls_of.items():
            call()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                call()
                times.append(time.perf_counter() - t0)
                runtime.deferred.clear()
            got[name] = statistics.median(times) * 1e6
        return got
    finally:
        tg._kernels = kernels  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2_small,llama_7b")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="GPT-2 alone at T = 32 (the smoke test)")
    parser.add_argument("--only-host-us", action="store_true",
                        help="time the host's cost per GEMM check call alone (host_us_per_call), no model steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.seq = "gpt2_small", 32
    from attnchecker.kernels import triton_gemm_check as tg

    if not (tg.available() and tg.interpreted()):
        raise SystemExit("bench/host_ops.py needs triton installed and TRITON_INTERPRET=1 before triton is imported")
    results = []
    for kind in [] if args.only_host_us else args.models.split(","):
        got = run_model(kind, args.seq)
        results.append(got)
        lines = [[name, r["aten_ops_launching"], r["over_baseline"]["aten_ops_launching"], r["triton_launches"],
                  r["syncs"], r["aten_ops_views_and_allocs"]] for name, r in got["steps"].items()]
        print(f"\n{kind}, {gpu_suite.LAYERS} layers, T={args.seq}: per step")
        print(_common.table(lines, ["step", "aten ops (launching)", "over baseline", "Triton launches", "syncs",
                                    "views/allocs"]))
    host_us = host_us_per_call(200 if args.tiny else 3000)
    print(f"\nhost time per call, launches left out (us): {host_us}")
    path = _common.write_result("host_ops", {"models": results, "host_us_per_call": host_us, "environment": {
        k: os.environ[k] for k in ("TRITON_INTERPRET", "ATTNCHECKER_ATTENTION", "ATTNCHECKER_GEMM")}}, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
