"""The Guard's run-time behaviour: step boundaries, the scheduler, policy modes, on_uncorrectable, the detection log."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

import attnchecker
from attnchecker import Fault, FaultPlan, Policy, UncorrectableFault

# The model zoo lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_zoo import batch, build, loss_of, train

ARCH = "nanogpt"
LAYERS = 2
# A persistent 2-D block of NaN in the scores: recomputing reproduces it, so it cannot be corrected.
UNCORRECTABLE = Fault(op="scores", layer=0, step=0, kind="nan", pattern="2d", persistent=True)


def _forward(model: torch.nn.Module, step: int = 0) -> torch.Tensor:
    return loss_of(ARCH, model, batch(ARCH, step))


def test_optimizer_hook_marks_steps_and_scheduler_picks_ops() -> None:
    model = build(ARCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with attnchecker.protect(model, optimizer=opt, policy=Policy(period=2, adaptive=False)) as guard:
        train_steps = 4
        for step in range(train_steps):
            opt.zero_grad()
            _forward(model, step).backward()
            opt.step()  # the guard's post-hook calls guard.step()
        assert guard.step_count == train_steps
        report = guard.report()
    # Period 2: steps 0 and 2 are checked, 1 and 3 are not.
    assert report.steps == train_steps
    assert dict(report.checks) == dict.fromkeys(("q", "k", "v", "scores", "context", "out"), 2 * LAYERS)


def test_default_adaptive_policy_checks_less_when_quiet() -> None:
    model = build(ARCH)
    with attnchecker.protect(model) as guard:
        train(ARCH, model, 20, on_step=guard.step)
        checks = guard.report().checks
    assert 0 < checks["scores"] < 20 * LAYERS


def test_mode_off_injects_but_checks_nothing() -> None:
    model = build(ARCH)
    plan = FaultPlan([Fault(op="out", layer=1, step=0, kind="inf")])
    with attnchecker.protect(model, policy=Policy.full(mode="off"), faults=plan) as guard:
        loss = _forward(model)
        assert len(guard.injector.injected) == 1
        assert sum(guard.report().checks.values()) == 0
    assert not torch.isfinite(loss)


def test_detect_mode_reports_without_correcting() -> None:
    model = build(ARCH)
    plan = FaultPlan([Fault(op="out", layer=1, step=0, kind="inf")])
    with attnchecker.protect(model, policy=Policy.full(mode="detect"), faults=plan) as guard:
        loss = _forward(model)
        (det,) = guard.detections
        counts = guard.report().by_op()["out"]
    assert (det.op, det.layer, det.kind, det.action) == ("out", 1, "inf", "detected")
    assert (counts.detected, counts.corrected) == (1, 0)
    assert not torch.isfinite(loss)


def test_uncorrectable_log_warns_and_training_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    model = build(ARCH)
    with attnchecker.protect(model, policy=Policy.full(), faults=FaultPlan([UNCORRECTABLE])) as guard:
        with caplog.at_level(logging.WARNING, logger="attnchecker"):
            _forward(model)
        assert guard.report().uncorrectable == 1
    assert any("uncorrectable" in r.getMessage() and "on_uncorrectable=log" in r.getMessage() for r in caplog.records)


def test_uncorrectable_raise_raises_from_the_forward() -> None:
    model = build(ARCH)
    policy = Policy.full(on_uncorrectable="raise")
    with attnchecker.protect(model, policy=policy, faults=FaultPlan([UNCORRECTABLE])) as guard:
        with pytest.raises(UncorrectableFault, match="layer 0 op scores") as e:
            _forward(model)
        assert [d.action for d in e.value.detections] == ["uncorrectable"]
        assert isinstance(e.value, attnchecker.AttnCheckerError)
        # The transient state is reset: the next step runs normally.
        guard.step()
        assert torch.isfinite(_forward(model, 1))


def test_uncorrectable_skip_step_skips_only_the_next_optimizer_step() -> None:
    model = build(ARCH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    policy = Policy.full(on_uncorrectable="skip_step")
    with attnchecker.protect(model, optimizer=opt, policy=policy, faults=FaultPlan([UNCORRECTABLE])) as guard:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _forward(model, 0).backward()
        opt.step()
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "step 0 should be skipped"
        assert guard.report().skipped_steps == 1
        opt.zero_grad()
        _forward(model, 1).backward()
        opt.step()
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters()), "step 1 should update"
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert guard.report().skipped_steps == 1


def test_detections_are_stamped_and_bounded() -> None:
    model = build(ARCH)
    plan = FaultPlan([Fault(op=op, layer=0, step=0, kind="inf") for op in ("q", "k", "v", "out")])
    policy = Policy.full(version=5)
    with attnchecker.protect(model, policy=policy, faults=plan, rank=3, max_detections=2) as guard:
        _forward(model)
        dets = guard.detections
        report = guard.report()
    assert report.detected == 4
    assert [d.op for d in dets] == ["v", "out"]  # the most recent two
    assert all((d.rank, d.policy_version, d.step) == (3, 5, 0) for d in dets)
    wire = json.loads(json.dumps(report.as_dict()))
    assert wire["detected"] == wire["corrected"] == 4
    assert wire["faults"]["q"]["inf"] == {"detected": 1, "corrected": 1, "uncorrectable": 0}


def test_guard_records_what_it_protects() -> None:
    model = build(ARCH)
    with attnchecker.protect(model, run="exp-42") as guard:
        assert guard.run == "exp-42"
        assert [(s.layer, s.name, s.integration) for s in guard.sites] == [
            (0, "h.0.attn", "sdpa"),
            (1, "h.1.attn", "sdpa"),
        ]
        assert "layers=2" in repr(guard)
    assert "closed" in repr(guard)
