"""Device-side check outcomes kept until the step boundary (checks/deferred.py): what a GPU backend leaves instead of
waiting on the device mid-step. The drain reads a whole step's records in one sync, emits the flagged ones' detections
with their own step and tier, and runs before the optimizer steps, so an uncorrectable fault still skips the step."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import attnchecker
from attnchecker import Fault, FaultPlan
from attnchecker.abft.repair import MatrixReport
from attnchecker.checks.deferred import defer, drain


class _HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's value on the host (each a sync on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in ("item", "tolist", "__bool__", "cpu", "numpy"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _report(action: str = "corrected", row: int = 3) -> MatrixReport:
    return MatrixReport(index=(0, 1), pattern="0d", row=row, col=2, value=float("inf"), residual=None, bound=1.0,
                        action=action)


def test_a_step_of_records_is_drained_in_one_host_read_and_only_the_flagged_ones_report(make_ctx) -> None:
    ctx, rec = make_ctx(step=7)
    built: list[int] = []

    def reports_of(i: int) -> Any:
        def build() -> list[MatrixReport]:
            built.append(i)
            return [_report(row=i)]
        return build

    for i in range(12):
        defer(ctx, "scores" if i % 2 else "context", torch.tensor(i in (3, 8)), reports_of(i),
              tier="tripwire" if i == 8 else "abft")
    ctx.runtime.step = 8  # the boundary comes after the calls: their detections keep the step they ran in
    with _HostReads() as reads:
        emitted, _ = drain(ctx.runtime.deferred)
    assert reads.n == 1
    assert emitted == 2 and built == [3, 8] and ctx.runtime.deferred == []
    got = [(d.op, d.step, d.row, d.tier, d.action, d.head) for d in rec.detections]
    assert got == [("scores", 7, 3, "abft", "corrected", 1), ("context", 7, 8, "tripwire", "corrected", 1)]
    assert ctx.runtime.stats.faults[("scores", "inf")] == [1, 1, 0]
    with _HostReads() as reads:
        assert drain(ctx.runtime.deferred) == (0, None)
    assert reads.n == 0  # nothing deferred: no sync at all


def test_an_uncorrectable_fault_found_on_the_device_still_skips_the_optimizer_step() -> None:
    """A record left during the forward (as a GPU backend leaves it) with an uncorrectable outcome: the optimizer's
    pre-step hook drains it before the step, and on_uncorrectable="skip_step" keeps the weights."""
    from model_zoo import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(vocab=32, n_embd=16, n_head=2, n_layer=1, block=8).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attnchecker.protect(model, optimizer=opt, policy=attnchecker.Policy(on_uncorrectable="skip_step"))
    try:
        ctx = next(iter(guard._binder.contexts.values()))
        ids = torch.randint(0, 32, (2, 8))
        before = [p.detach().clone() for p in model.parameters()]
        model(ids).sum().backward()
        defer(ctx, "context", torch.tensor(True), lambda: [_report("uncorrectable")])
        opt.step()
        assert [(d.op, d.action) for d in guard.detections] == [("context", "uncorrectable")]
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        model(ids).sum().backward()
        opt.step()  # nothing deferred now: this one steps
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    finally:
        guard.close()


def test_the_optimizers_boundary_reads_the_flags_and_the_gradients_finiteness_at_once() -> None:
    """Records whose flags have two dtypes (as the GEMM checks' and the attention's do) and the last net's check of
    the gradients: the optimizer's pre-step hook reads them all in one host read, and each still acts: a flagged
    record reports, a non-finite gradient skips the step."""
    from model_zoo import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(vocab=32, n_embd=16, n_head=2, n_layer=1, block=8).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = attnchecker.protect(model, optimizer=opt)
    try:
        ctx = next(iter(guard._binder.contexts.values()))
        ids = torch.randint(0, 32, (2, 8))
        for poisoned in (False, True):
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            model(ids).sum().backward()
            if poisoned:
                next(model.parameters()).grad.view(-1)[5] = float("nan")
            defer(ctx, "scores", torch.tensor(poisoned), lambda: [_report()])
            defer(ctx, "context", torch.tensor(0, dtype=torch.int32), lambda: [_report()])
            with _HostReads() as reads:
                opt.step()
            assert reads.n == 1 or poisoned  # a non-finite gradient's own reads are the slow path's
            stepped = not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert stepped is not poisoned
        assert [(d.op, d.tier) for d in guard.detections] == [("scores", "abft"), ("grad", "optimizer")]
    finally:
        guard.close()


def _device_route(monkeypatch: Any) -> None:
    """The route a CUDA model takes, on CPU tensors under Triton's interpreter: the Triton attention and GEMM checks,
    whose outcomes stay on the device, and the attention backward off the CPU-only kernel."""
    from attnchecker.attention.backends import BACKEND_ENV
    from attnchecker.attention.backward import fused
    from attnchecker.gemm import device
    from attnchecker.kernels import triton_gemm_check as tg

    if not (tg.available() and tg.interpreted()):
        pytest.skip("the device route on CPU tensors needs Triton's interpreter")
    monkeypatch.setenv(device.GEMM_ENV, "triton")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setattr(fused, "cpu_kernel", False)


def _nano() -> Any:
    from model_zoo import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(vocab=32, n_embd=32, n_head=2, n_layer=1, block=16).train()


def test_on_the_device_route_report_and_close_read_the_step_in_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault the Triton kernel corrected in a step that has not ended: the detection waits on the device, report()
    counts it (its read is the step's), and close() reads what is left, so a run's last forward (an evaluation after
    the last step) loses nothing."""
    _device_route(monkeypatch)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    for read_by in ("report", "close"):
        model = _nano()
        fault = Fault(op="scores", layer=0, step=0, kind="inf", batch=1, head=0, row=9, col=3)
        guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), faults=FaultPlan([fault]))
        try:
            with torch.no_grad():
                model(ids)
            assert guard.coverage.backend_lines() and all("triton" in line
                                                          for line in guard.coverage.backend_lines())
            assert guard.detections == []  # on the device until something reads it
            if read_by == "report":
                assert guard.report().detected == 1
        finally:
            guard.close()
        assert [(d.op, d.step, d.batch, d.row, d.action) for d in guard.detections] == [
            ("scores", 0, 1, 9, "recomputed")], read_by
        assert guard.report().detected == 1


def test_a_loop_with_no_step_boundary_holds_a_bounded_number_of_outcomes(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """protect(model) and forwards, but neither guard.step() nor an optimizer: on the device route every checked
    call leaves an outcome for a step boundary that never comes. Past MAX_PENDING they are read at once, with one
    warning that says what to call, and a fault among them is reported then."""
    from attnchecker.checks import deferred

    _device_route(monkeypatch)
    monkeypatch.setattr(deferred, "MAX_PENDING", 5)
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    model = _nano()
    fault = Fault(op="scores", layer=0, step=0, kind="inf", batch=0, head=1, row=4, col=2)
    guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), faults=FaultPlan([fault]))
    runtime = guard._runtime
    try:
        held = []
        with caplog.at_level("INFO", logger="attnchecker"), torch.no_grad():
            for _ in range(12):
                model(ids)
                held.append(len(runtime.deferred))
        assert max(held) < 5 and runtime.early_reads >= 2
        warned = [r for r in caplog.records if "wait for a step boundary" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelname == "WARNING" and "guard.step()" in warned[0].getMessage()
        # The first forward's fault, reported by an early read before anything closed.
        assert [(d.op, d.row, d.action) for d in guard.detections] == [("scores", 4, "recomputed")]
    finally:
        guard.close()
    assert len(guard.detections) == 1 and guard.report().checks["scores"] == 12


def test_a_read_that_fails_at_close_is_logged_and_the_model_is_restored(caplog: pytest.LogCaptureFixture) -> None:
    """close() reads the step in progress; a read that raises (as a device error would surface there) is logged
    and the model comes back as it was, its forward the unprotected one."""
    model = _nano().eval()
    ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    guard = attnchecker.protect(model)
    ctx = next(iter(guard._binder.contexts.values()))

    def broken() -> list[MatrixReport]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    defer(ctx, "scores", torch.tensor(True), broken)
    with caplog.at_level("ERROR", logger="attnchecker"):
        guard.close()
    assert guard.closed and any("could not read" in r.getMessage() for r in caplog.records)
    assert guard._runtime.deferred == []
    with torch.no_grad():
        assert torch.equal(model(ids), want)
    attnchecker.protect(model).close()  # a second guard: nothing of the first is left to refuse it
