"""Issue 10, item 4: the last net at the optimizer. A non-finite gradient (a fault outside the protected GEMMs: here an
MLP GEMM, corrupted below autograd) never reaches the weights: the step is skipped (on_uncorrectable log and
skip_step) or raises (raise), every period snaps to min_period, and a tier-"optimizer" detection is recorded."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnchecker
from attnchecker import Policy, UncorrectableFault

sys.path.insert(0, str(Path(__file__).parent))
import model_zoo as mz

ARCH = "nanogpt"
QUIET = Policy(period=4, max_period=4)


class MlpFault(TorchDispatchMode):
    """NaN into the first addmm whose output is the MLP's hidden width (4 × n_embd): no protected op has it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.done = width, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not self.done and func is torch.ops.aten.addmm.default and out.shape[-1] == self.width:
            out.view(-1)[3] = float("nan")
            self.done = True
        return out


def _train(policy: Policy, fault_step: int = 2, steps: int = 4) -> tuple[attnchecker.Guard, list[torch.Tensor]]:
    model = mz.build(ARCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attnchecker.protect(model, optimizer=opt, policy=policy)
    snapshots = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        if step == fault_step:
            with MlpFault(4 * 64):
                loss = mz.loss_of(ARCH, model, mz.batch(ARCH, step))
        else:
            loss = mz.loss_of(ARCH, model, mz.batch(ARCH, step))
        loss.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        snapshots.append(before)
    return guard, snapshots


@pytest.mark.parametrize("action", ["log", "skip_step"])
def test_non_finite_gradient_skips_the_step_and_snaps_every_period(action: str) -> None:
    guard, snapshots = _train(QUIET.replace(on_uncorrectable=action))
    model = guard.model
    assert all(torch.isfinite(p).all() for p in model.parameters())
    (det,) = [d for d in guard.detections if d.tier == "optimizer"]
    assert (det.op, det.step, det.action, det.kind) == ("grad", 2, "uncorrectable", "nan")
    report = guard.report()
    assert report.skipped_steps == 1
    assert report.tier_catches["optimizer"] == 1
    assert report.tier_checks["optimizer"] == 4  # one per optimizer step
    assert report.uncorrectable == 0  # not a protected op's fault: not in the per-op counts
    # The skipped step changed no weight: the parameters before step 3 are those before step 2.
    for a, b in zip(snapshots[2], snapshots[3], strict=True):
        assert torch.equal(a, b)
    # Every op was snapped to min_period at step 2's boundary (and stays there after one quiet full check).
    assert set(guard.periods.values()) == {1}
    guard.close()


def test_raise_raises_at_the_optimizer_step() -> None:
    with pytest.raises(UncorrectableFault, match="non-finite gradient"):
        _train(QUIET.replace(on_uncorrectable="raise"))


def test_without_the_tripwire_the_optimizer_steps_on_nan() -> None:
    """What the net prevents: the same fault with tripwire=False writes NaN into the weights."""
    guard, _ = _train(QUIET.replace(tripwire=False))
    assert not all(torch.isfinite(p).all() for p in guard.model.parameters())
    assert guard.report().tier_checks["optimizer"] == 0
    guard.close()



def _one_step_with(first: float, bad: float | None = None) -> attnchecker.Guard:
    """One optimizer step of a protected model whose first parameter's gradient is all ``first``; the second's is
    ones, or (with ``bad``) all 1e20 with ``bad`` as its last element."""
    model = mz.build(ARCH)
    p0, p1 = list(model.parameters())[:2]
    opt = torch.optim.SGD([p0, p1], lr=0.0)
    guard = attnchecker.protect(model, optimizer=opt, policy=QUIET)
    p0.grad = torch.full_like(p0, first)
    if bad is None:
        p1.grad = torch.ones_like(p1)
    else:
        p1.grad = torch.full_like(p1, 1e20)
        p1.grad.view(-1)[-1] = bad
    opt.step()
    return guard


@pytest.mark.parametrize("value", [1e20, -3e38])
def test_huge_finite_gradients_pass_the_net(value: float) -> None:
    """A norm that overflows is not a fault: elements past ~1e19 square past fp32's range, and a diverging run computes
    such gradients. Only an INF or NaN element stops the step."""
    guard = _one_step_with(value)
    assert [d for d in guard.detections if d.tier == "optimizer"] == []
    assert guard.report().skipped_steps == 0
    guard.close()


@pytest.mark.parametrize(("bad", "kind"), [(float("inf"), "inf"), (float("-inf"), "inf"), (float("nan"), "nan")])
def test_one_non_finite_element_among_huge_ones_is_caught(bad: float, kind: str) -> None:
    """The INF or NaN sits in the second gradient, behind a first whose norm overflows too: the net looks at the
    elements, not only at the norms."""
    guard = _one_step_with(1e20, bad)
    (det,) = [d for d in guard.detections if d.tier == "optimizer"]
    assert (det.kind, det.action) == (kind, "uncorrectable")
    guard.close()
