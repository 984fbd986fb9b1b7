"""Device-side check outcomes kept until the step boundary (checks/deferred.py): what a GPU backend leaves instead of
waiting on the device mid-step. The drain reads a whole step's records in one sync, emits the flagged ones' detections
with their own step and tier, and runs before the optimizer steps, so an uncorrectable fault still skips the step."""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import attnchecker
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
    the gradients: the optimizer's pre-step hook reads them all in one host read (the unprotected step makes none),
    and each still acts: a flagged record reports, a non-finite gradient skips the step."""
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
