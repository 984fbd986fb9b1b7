"""Shared fixtures for the agent tests: hypothesis profiles, seeded tensors, a LayerContext factory."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

if not torch.cuda.is_available():
    # Triton's interpreter runs the Triton kernels on CPU tensors (the GEMM checks' tests, the attention backward's). It
    # must be asked for before triton is first imported, which importing attnchecker does (through torch._dynamo).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from attnchecker.checks.context import CheckConfig, LayerContext, OpStats, Runtime
from attnchecker.events import Detection

# Example counts are set per test (the CPU budget differs a lot between a pure checksum test and a whole layer).
settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

class Recorder:
    """The runtime's on_detection sink: keeps every record."""

    def __init__(self) -> None:
        self.detections: list[Detection] = []

    def __call__(self, det: Detection) -> None:
        self.detections.append(det)

    def by_op(self, op: str) -> list[Detection]:
        return [d for d in self.detections if d.op == op]


@pytest.fixture(scope="session")
def make_ctx() -> Callable[..., tuple[LayerContext, Recorder]]:
    """make_ctx(faults=None, layer=0, step=0, **CheckConfig fields) -> (ctx, recorder); stats in ctx.runtime.stats.
    A stateless factory (session scope), so hypothesis tests can use it: every call builds a fresh runtime."""

    def build(faults: Any = None, *, layer: int = 0, step: int = 0, **config: Any) -> tuple[LayerContext, Recorder]:
        from attnchecker.inject import FaultPlan, Injector

        injector = None
        if faults is not None:
            injector = faults if isinstance(faults, Injector) else Injector(FaultPlan(list(faults)))
        recorder = Recorder()
        runtime = Runtime(step=step, config=CheckConfig(**config), injector=injector, on_detection=recorder,
                          stats=OpStats())
        return LayerContext(layer=layer, runtime=runtime), recorder

    return build



@pytest.fixture
def kernel_everywhere(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """kernel_everywhere(): from then on in the test, every check reads its matrices through the one-pass kernel
    (attnchecker.kernels.fused_pass), which the zoo's small models are otherwise below the size for (gemm.check.ONE_PASS_MIN,
    checks.product._ONE_PASS_MIN*). Skips where the kernel cannot be built (no C compiler)."""

    def lower() -> None:
        from attnchecker.checks import product as product_check
        from attnchecker.gemm import check as gemm_check
        from attnchecker.kernels import fused_pass

        if not fused_pass.available():
            pytest.skip("no C compiler: the kernel cannot be built here")
        for module, name in ((gemm_check, "ONE_PASS_MIN"), (product_check, "_ONE_PASS_MIN"),
                             (product_check, "_ONE_PASS_MIN_SQ")):
            monkeypatch.setattr(module, name, 0)

    return lower


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Triton kernel launches by kernel name (a collections.Counter), counted where the interpreter runs a grid
    (GridExecutor). Skips where kernels are not interpreted (a GPU launches them)."""
    import collections

    from attnchecker.kernels import triton_attention

    if not triton_attention.interpreting():
        pytest.skip("counts the interpreter's launches")
    import triton.runtime.interpreter as interpreter

    counter: collections.Counter[str] = collections.Counter()
    run = interpreter.GridExecutor.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return counter
