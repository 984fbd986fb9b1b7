"""What one protected training step costs the host on the GPU route, in time: the microseconds of CPU a step spends
outside its kernels, protected against unprotected, on a model small enough that, on a GPU, the host is what the
step waits for (docs/performance.md §9: a 2-layer GPT-2-width step is launch-bound on an H100 at any length).

bench/host_ops.py counts what such a step dispatches; this times it. The step is the same (bench/gpu_suite.py's
models at their dry-run sizes, its variants attached once, the route a CUDA step takes: the Triton attention, the
GEMM checks' Triton path, the attention backward off the CPU-only kernel). Each variant's launches are first run by
Triton's interpreter once, recording every argument as the launch left it. In the timed steps a launch is replayed
instead: it binds its arguments as Triton's launcher does on a GPU (the signature's binder and the cache key, for an
sm_90 target: that part of a launch's host cost is timed with the step), then writes back what was recorded, which
is not timed. Everything else (the model, autograd, the optimizer, the checks' host code and their aten ops) runs
and is timed as it is, but for the attention forward's guard against numpy's warnings, which only the interpreter
needs. The garbage collector runs before each timed step, not in it.

    python bench/host_time.py [--models gpt2_small,llama_7b] [--seq 32] [--layers 2] [--rounds 30] [--tiny]
                              [--profile all_default_tier1] [--compile] [--out docs/perf/host_time.json]

--layers sets the models' depth (gpu_suite's 2 by default): two depths tell a step's host time per layer from
what it spends once a step (the optimizer's hooks, the step boundary, the LM head). --profile times one variant's
replayed steps by function (SECTIONS): each one's own time, less the sections it calls; the wrappers' own few
microseconds a call land in their callers', and the vendor's attention ops (what the unprotected step runs) in
``attention.vendor.forward`` and ``_KernelBackward.backward``. --compile puts every variant's model through
torch.compile (Inductor, here the CPU's) after protect(): the unprotected step's host time is then a compiled
graph's, the checks' their opaque ops' (attnchecker/compiled/).

What it leaves out: on CUDA every aten op outside a view is also a launch (a few microseconds of the driver's),
where here it runs its tiny computation on the CPU; and Triton's C launcher (the driver call) after the binding. A
replayed step is checked against its record: the same launches in the same order, a finite loss, no detection.
Variants are timed in rotated order, once per round (bench/_common.interleaved); the figure is the median over
rounds of a step's host time and of its difference from the unprotected step's in the same round, with the spread.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gc
import os
import statistics
import sys
import time
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
import host_ops
import torch

SM90 = ("cuda", 90, 32)
"""The target whose binder a replayed launch runs (an H100's): the binding does not depend on the GPU's model."""


class Replayer:
    """Takes over Triton's interpreted launches: ``run`` interprets them, ``record`` interprets them and keeps every
    argument as each left it, ``replay`` binds the arguments as a GPU launch would and writes back what was
    recorded."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.interpreter import InterpretedFunction

        from attnchecker.kernels import triton_attention

        self.backend = make_backend(GPUTarget(*SM90))
        self.binders: dict[Any, tuple[Callable[..., Any], dict[Any, Any]]] = {}
        self.mode = "run"
        self.log: list[tuple[str, list[torch.Tensor]]] = []
        self.at = 0
        self.untimed_s = 0.0
        """Seconds of the replays' writes (and the binders' first build) this step: taken out of its time."""
        self.bind_s = 0.0
        self.bind_by_kernel: collections.defaultdict[str, float] = collections.defaultdict(float)
        interpreted = InterpretedFunction.run
        replayer = self

        def launch(fn: Any, *args: Any, **kwargs: Any) -> Any:
            return replayer._launch(interpreted, fn, args, kwargs)

        InterpretedFunction.run = launch
        # The attention forward's guard against numpy's IEEE warnings exists for the interpreter alone; a replayed
        # launch runs nothing it would guard, and a GPU's step does not enter it.
        quietly = triton_attention._ieee_quietly

        def ieee_quietly() -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext() if replayer.mode == "replay" else quietly()

        triton_attention._ieee_quietly = ieee_quietly  # type: ignore[assignment]

    def _binder(self, fn: Any) -> tuple[Callable[..., Any], dict[Any, Any]]:
        from triton.runtime.jit import JITFunction, create_function_from_signature

        got = self.binders.get(fn.fn)
        if got is None:
            jit = JITFunction(fn.fn)
            got = self.binders[fn.fn] = (create_function_from_signature(jit.signature, jit.params, self.backend), {})
        return got

    def _launch(self, interpreted: Callable[..., Any], fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from triton.runtime.jit import compute_cache_key

        if self.mode == "run" or kwargs.get("warmup"):
            return interpreted(fn, *args, **kwargs)
        t0 = time.perf_counter()
        binder, keys = self._binder(fn)
        t1 = time.perf_counter()
        # What JITFunction.run does on a GPU before the driver's launch: bind, specialise, look the kernel up.
        _, specialization, options = binder(*args, **{k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
        compute_cache_key(keys, specialization, options)
        t2 = time.perf_counter()
        self.bind_s += t2 - t1
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        name = fn.fn.__name__
        self.bind_by_kernel[name] += t2 - t1
        if self.mode == "record":
            out = interpreted(fn, *args, **kwargs)
            self.log.append((name, [t.clone() for t in tensors]))
        else:
            if self.at >= len(self.log) or self.log[self.at][0] != name:
                raise RuntimeError(f"launch {self.at} of the replayed step is {name}, recorded "
                                   f"{self.log[self.at][0] if self.at < len(self.log) else 'nothing'}: this variant's "
                                   f"launches change from step to step, so its step cannot be replayed")
            for t, after in zip(tensors, self.log[self.at][1], strict=True):
                _write(t, after)
            self.at += 1
            out = None
        self.untimed_s += (t1 - t0) + (time.perf_counter() - t2)
        return out


def _write(t: torch.Tensor, after: torch.Tensor) -> None:
    """Every argument as the recorded launch left it: its outputs (a buffer it writes whole may have held the same
    bytes before, by chance of the allocator, so comparing before and after cannot tell them all), and its inputs as
    they were then (the weights among them before the optimizer's updates since: a replayed step times the host, its
    values are the record's). Through ``.data``, as the kernel writes memory, so that autograd sees no in-place change
    of a saved tensor. An argument whose elements overlap (an expanded view) is an input only."""
    if torch._debug_has_internal_overlap(t) == 0:
        t.data.copy_(after)


class _Variant:
    def __init__(self, name: str, base: Any, ids: torch.Tensor, replayer: Replayer, *, compiled: bool = False
                 ) -> None:
        self.name, self.ids, self.replayer = name, ids, replayer
        self.job = gpu_suite._Job(name.removesuffix("_tier1"), base, "cpu", torch.bfloat16)
        if compiled:
            # Protected, then compiled (tests/agent/test_torch_compile_inductor.py): the checks run as opaque ops.
            self.job.model = torch.compile(self.job.model)
        self.log: list[tuple[str, list[torch.Tensor]]] = []
        self.loss = torch.tensor(float("nan"))

    def step(self) -> None:
        """bench/gpu_suite's step; a default variant's on a step between full checks (host_ops.STEPS)."""
        job = self.job
        if job.guard is not None and self.name.endswith("_tier1"):
            job.guard.tripwire_only_this_step()
        job.opt.zero_grad(set_to_none=True)
        loss = job.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        job.opt.step()
        self.loss = loss.detach()  # read in check(), outside the timed step

    def record(self) -> None:
        r = self.replayer
        for _ in range(3):
            self.step()
        r.mode, r.log = "record", []
        try:
            self.step()
        finally:
            r.mode = "run"
        self.log = r.log

    def timed(self) -> tuple[float, float, dict[str, float]]:
        """One replayed step: (host seconds, of which binding Triton's launches, that by kernel)."""
        r = self.replayer
        r.mode, r.log, r.at, r.untimed_s, r.bind_s = "replay", self.log, 0, 0.0, 0.0
        r.bind_by_kernel.clear()
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            self.step()
            seconds = time.perf_counter() - t0 - r.untimed_s
        finally:
            gc.enable()
            r.mode = "run"
        self.check(r.at)
        return seconds, r.bind_s, dict(r.bind_by_kernel)

    def check(self, launched: int) -> None:
        detections = [] if self.job.guard is None else self.job.guard.detections
        if launched != len(self.log) or not torch.isfinite(self.loss) or detections:
            raise RuntimeError(f"{self.name}: the replayed step is not the recorded one ({launched} of {len(self.log)} "
                               f"launches, loss {float(self.loss)}, {len(detections)} detections: {detections[:2]})")


def run_model(kind: str, seq: int, rounds: int, replayer: Replayer, sections: Sections | None,
              profile: str | None, compiled: bool = False) -> dict[str, Any]:
    from attnchecker.attention.backward import fused

    fused.cpu_kernel = False  # the CPU-only backward kernel is not on a GPU's route
    base = gpu_suite._model(kind, gpu_suite.DRY_SHAPES[kind], seq, 256)
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
    variants = {name: _Variant(name, base, ids, replayer, compiled=compiled) for name in host_ops.STEPS}
    try:
        for v in variants.values():
            v.record()
        binding: dict[str, list[float]] = {name: [] for name in variants}
        by_kernel: dict[str, list[dict[str, float]]] = {name: [] for name in variants}

        def timer(v: _Variant) -> Callable[[], float]:
            def timed() -> float:
                seconds, bind, kernels = v.timed()
                binding[v.name].append(bind)
                by_kernel[v.name].append(kernels)
                return seconds
            return timed

        warmup = 2
        samples = _common.interleaved({name: timer(v) for name, v in variants.items()}, rounds=rounds, warmup=warmup)
        base_s = samples["baseline"]
        rows = {name: {"host_us": _us(_common.summary(xs)),
                       "over_baseline_us": _us(_common.summary([x - b for x, b in zip(xs, base_s, strict=True)])),
                       "over_baseline_ratio": _common.ratios(samples, "baseline")[name],
                       "triton_binding_us": _us(_common.summary(binding[name][warmup:])),
                       "triton_launches": len(variants[name].log),
                       "by_kernel": _kernels(variants[name].log, by_kernel[name][warmup:])}
                for name, xs in samples.items()}
        return {"model": kind, "seq": seq, "shape": gpu_suite.DRY_SHAPES[kind], "layers": gpu_suite.LAYERS,
                "rounds": rounds, "compiled": compiled, "steps": rows,
                "profile": sections.profile(variants[profile]) if sections and profile else None}
    finally:
        for v in variants.values():
            v.job.close()


def _kernels(log: list[tuple[str, list[torch.Tensor]]], steps: list[dict[str, float]]
             ) -> dict[str, dict[str, float]]:
    """Per kernel: its launches a step and the median microseconds a step spends binding them."""
    launches = collections.Counter(name for name, _ in log)
    return {name: {"launches": n, "binding_us": statistics.median(s.get(name, 0.0) for s in steps) * 1e6}
            for name, n in sorted(launches.items())}


def _us(s: dict[str, float]) -> dict[str, float]:
    return {k: (v * 1e6 if k != "n" else v) for k, v in s.items()}


SECTIONS = (
    ("attnchecker.integrations._common", "checked_attention"),
    ("attnchecker.attention.backends.triton", "_run"),
    ("attnchecker.attention.vendor", "forward"),
    ("attnchecker.kernels.triton_attention", "forward"),
    ("attnchecker.attention.backends.triton", "_with_grad"),
    ("attnchecker.attention.backends.triton", "_KernelBackward.backward"),
    ("attnchecker.integrations._common", "_check_projection_eagerly"),
    ("attnchecker.attention.pipeline", "check_linear"),
    ("attnchecker.gemm.projection", "_device_gemms"),
    ("attnchecker.gemm.linear", "_CheckedLinear.forward"),
    ("attnchecker.gemm.linear", "_CheckedLinear.backward"),
    ("attnchecker.gemm.device", "_trip"),
    ("attnchecker.gemm.device", "_check"),
    ("attnchecker.kernels.triton_gemm_check", "trip_pass"),
    ("attnchecker.kernels.triton_gemm_check", "trip_pass_pair"),
    ("attnchecker.runtime.response", "FaultResponse.optimizer_pre_hook"),
)
"""The functions ``--profile`` times in a replayed step, each where the code calling it looks it up (a module's or a
class's attribute), so a wrapper set before the guard is attached sees every call."""


class Sections:
    """Each SECTIONS function's own host time in replayed steps: its time less that of the sections it calls and
    of the replays' writes. Wrapped once, before any guard is attached; counting only while ``on``."""

    def __init__(self, replayer: Replayer) -> None:
        import importlib

        self.replayer, self.on = replayer, False
        self.own: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self._inside: list[float] = []
        for module, name in SECTIONS:
            owner: Any = importlib.import_module(module)
            *path, attr = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = self._wrap(fn, f"{module.removeprefix('attnchecker.')}.{name}")
            setattr(owner, attr, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)

    def _wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        sections = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not sections.on:
                return fn(*args, **kwargs)
            r = sections.replayer
            t0, untimed0 = time.perf_counter(), r.untimed_s
            sections._inside.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                below = sections._inside.pop()
                spent = time.perf_counter() - t0 - (r.untimed_s - untimed0)
                sections.own[label] += spent - below
                sections.calls[label] += 1
                if sections._inside:
                    sections._inside[-1] += spent

        return timed

    def profile(self, v: _Variant, steps: int = 20) -> dict[str, Any]:
        """Per section its median own microseconds a step over ``steps`` replayed steps and its calls a step; "rest":
        the step's time outside them (the model, autograd, the optimizer, and our code no section names)."""
        per: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
        totals = []
        self.on = True
        try:
            for _ in range(steps):
                self.own.clear()
                self.calls.clear()
                seconds, _, _ = v.timed()
                totals.append(seconds)
                for label in self.own:
                    per[label].append(self.own[label])
                per["rest"].append(seconds - sum(self.own.values()))
            calls = dict(self.calls)
        finally:
            self.on = False
        rows = {label: {"own_us": statistics.median(xs) * 1e6, "calls": calls.get(label, 0)}
                for label, xs in per.items()}
        return {"variant": v.name, "steps": steps, "step_us": statistics.median(totals) * 1e6,
                "sections": dict(sorted(rows.items(), key=lambda kv: -kv[1]["own_us"]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2_small,llama_7b")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--layers", type=int, default=gpu_suite.LAYERS)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="GPT-2 alone, 3 rounds (the smoke test)")
    parser.add_argument("--profile", default=None, help=f"a variant ({', '.join(host_ops.STEPS)}) whose replayed "
                        "steps are timed by function (SECTIONS), each function's own time")
    parser.add_argument("--compile", action="store_true",
                        help="every variant's model through torch.compile (Inductor) after protect()")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.rounds = "gpt2_small", 3
    from attnchecker.kernels import triton_gemm_check as tg

    if not (tg.available() and tg.interpreted()):
        raise SystemExit("bench/host_time.py needs triton installed and TRITON_INTERPRET=1 before triton is imported")
    if args.profile is not None and args.profile not in host_ops.STEPS:
        raise SystemExit(f"--profile takes one of {', '.join(host_ops.STEPS)}, got {args.profile!r}")
    if args.layers < 1:
        raise SystemExit(f"--layers takes a depth of at least 1, got {args.layers}")
    gpu_suite.LAYERS = args.layers
    torch.set_num_threads(1)  # the host's own thread, as a GPU step's; the CPU's tiny ops gain nothing from more
    replayer = Replayer()
    sections = Sections(replayer) if args.profile else None
    results = []
    for kind in args.models.split(","):
        got = run_model(kind, args.seq, args.rounds, replayer, sections, args.profile, args.compile)
        results.append(got)
        lines = [[name, r["host_us"]["median"], r["over_baseline_us"]["median"],
                  f"[{r['over_baseline_us']['p25']:.0f}, {r['over_baseline_us']['p75']:.0f}]",
                  _common.pct(r["over_baseline_ratio"]["median"]), r["triton_launches"],
                  r["triton_binding_us"]["median"]] for name, r in got["steps"].items()]
        print(f"\n{kind}, {gpu_suite.LAYERS} layers, T={args.seq}: host time per step (us, median of {args.rounds} "
              f"rounds)")
        print(_common.table(lines, ["step", "host us", "over baseline", "[IQR]", "ratio", "Triton launches",
                                    "of which binding"]))
        if got["profile"]:
            prof = got["profile"]
            print(f"\n{prof['variant']}: own host time a step by function (us, median of {prof['steps']} replayed "
                  f"steps; the step {prof['step_us']:.0f} us)")
            print(_common.table([[label, row["own_us"], row["calls"]] for label, row in prof["sections"].items()],
                                ["function", "own us a step", "calls a step"]))
    path = _common.write_result("host_time", {"models": results, "environment": {
        k: os.environ[k] for k in ("TRITON_INTERPRET", "ATTNCHECKER_ATTENTION", "ATTNCHECKER_GEMM")},
        "replay_target": list(SM90)}, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
