"""A guard's state across a checkpoint: ``Guard.state_dict()`` saved with the model and optimizer, and
``load_state_dict`` in the resumed run, which then goes on where the saved one stopped (the step numbers its events and
stats carry, and the adaptive schedule: a run resumed in a quiet period stays quiet). Through torch.save with
``weights_only`` and torch.distributed.checkpoint; torchtitan's checkpointer and the Trainer callbacks are tested
with their integrations (test_integrations_torchtitan.py, test_integrations_callbacks.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from model_zoo import batch, build, loss_of

import attnchecker
from attnchecker import GuardStateError, Policy


def train(guard: attnchecker.Guard, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int
          ) -> list[tuple[int, frozenset[str]]]:
    """``steps`` SGD steps of GPT-2 on one batch: (step number, ops checked in full) of each."""
    seen = []
    for _ in range(steps):
        seen.append((guard.step_count, guard.check_config.checked_ops))
        opt.zero_grad(set_to_none=True)
        loss_of("gpt2", model, batch("gpt2", 0)).backward()
        opt.step()
    return seen


def protected(policy: Policy | None = None) -> tuple[attnchecker.Guard, torch.nn.Module, torch.optim.Optimizer]:
    model = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every step the same function
    return attnchecker.protect(model, optimizer=opt, scope="all", policy=policy), model, opt


def saved_after(steps: int, policy: Policy | None = None) -> dict[str, Any]:
    """The state of a guard (scope "all", ``policy``) after ``steps`` steps."""
    guard, model, opt = protected(policy)
    try:
        train(guard, model, opt, steps)
        return guard.state_dict()
    finally:
        guard.close()


def test_a_resumed_run_goes_on_with_the_saved_step_numbers_and_schedule(tmp_path: Path) -> None:
    """The default policy, 10 steps (past its first quiet step), saved through torch.save and loaded with
    weights_only (torch's default since 2.6); the run that kept going and the resumed one then check the same ops on
    the same step numbers for 12 steps, through the schedule's next doubling. Resumed without the state, the run
    starts at step 0 and checks every op in full."""
    guard, model, opt = protected()
    try:
        train(guard, model, opt, 10)
        torch.save(guard.state_dict(), tmp_path / "guard.pt")
        kept_going = train(guard, model, opt, 12)
    finally:
        guard.close()
    assert any(not ops for _, ops in kept_going), "the schedule never relaxed: nothing to compare"

    state = torch.load(tmp_path / "guard.pt", weights_only=True)
    resumed, model, opt = protected()
    try:
        assert resumed.step_count == 0 and resumed.check_config.checked_ops == frozenset(attnchecker.policy.OPS)
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state
        assert train(resumed, model, opt, 12) == kept_going
        assert resumed.detections == []
    finally:
        resumed.close()


def test_a_fault_after_the_resume_is_reported_at_the_run_s_step(tmp_path: Path) -> None:
    """An INF in a checked product on the resumed run's first step: corrected, and its event names step 10, not 0;
    the stats intervals streamed (offline, to the spool) cover steps 10 and 11."""
    state = saved_after(10, Policy.full())
    model = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    resumed = attnchecker.protect(model, optimizer=opt, scope="all", policy=Policy.full(), collector="offline",
                                  spool_dir=tmp_path, run="resumed", stats_interval_steps=1)
    try:
        resumed.load_state_dict(state)
        resumed.injector = attnchecker.FaultPlan([attnchecker.Fault(step=10, layer=0, op="scores", kind="inf")])
        train(resumed, model, opt, 2)
        assert [(d.step, d.op, d.action) for d in resumed.detections] == [(10, "scores", "corrected")]
        assert [(iv["step_start"], iv["step_end"]) for iv in resumed.intervals] == [(10, 10), (11, 11)]
    finally:
        resumed.close()


def test_torch_distributed_checkpoint_saves_and_loads_the_guard(tmp_path: Path) -> None:
    """The guard is Stateful: torch.distributed.checkpoint (torchtitan's CheckpointManager: its ``states``) saves it
    beside the model and loads it into the resumed run's guard (one process, no process group)."""
    import torch.distributed.checkpoint as dcp

    guard, model, opt = protected()
    try:
        train(guard, model, opt, 9)
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"attnchecker": guard}, checkpoint_id=tmp_path / "ckpt")
        saved = guard.state_dict()
    finally:
        guard.close()
    resumed, _, _ = protected()
    try:
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"attnchecker": resumed}, checkpoint_id=tmp_path / "ckpt")
        assert resumed.state_dict() == saved and resumed.step_count == 9
    finally:
        resumed.close()


def test_the_resumed_run_s_policy_bounds_the_saved_periods() -> None:
    """Saved under the default policy after its periods doubled, loaded under max_period=1: every op checked every
    step (the resumed run's policy governs; docs/adaptive.md, "Resuming")."""
    state = saved_after(10)
    assert max(row["period"] for row in state["schedule"]["ops"].values()) > 1
    resumed, model, opt = protected(Policy(max_period=1))
    try:
        resumed.load_state_dict(state)
        assert set(resumed.periods.values()) == {1}
        assert [ops for _, ops in train(resumed, model, opt, 2)] == [frozenset(attnchecker.policy.OPS)] * 2
    finally:
        resumed.close()


def _bad_states(good: dict[str, Any]) -> list[tuple[Any, str]]:
    def edit(path: tuple[str, ...], value: Any) -> dict[str, Any]:
        state = json.loads(json.dumps(good))
        at = state
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = value
        return state

    ops = ("schedule", "ops", "out")
    return [
        ([1, 2], "format"),
        (edit(("format",), 2), "format 2"),
        (edit(("step",), -1), "step must be an int >= 0"),
        (edit(("step",), True), "step must be an int >= 0"),
        (edit(("schedule",), None), "'ops' mapping"),
        (edit(("schedule", "ops", "proj"), good["schedule"]["ops"]["q"]), "unknown op"),
        (edit((*ops, "period"), 0), "op 'out': period"),
        (edit((*ops, "last_checked"), good["step"]), "op 'out': last_checked"),
        (edit((*ops, "quiet"), -3), "op 'out': quiet"),
        (edit((*ops, "hot"), "no"), "op 'out': hot"),
        (edit(("schedule", "overhead"), [float("nan")]), "overhead"),
        (edit(("schedule", "overhead"), [0.1] * 32), "overhead"),
    ]


def test_a_state_that_is_not_one_is_refused_and_the_guard_keeps_its_own() -> None:
    """Each field wrong in turn: GuardStateError naming it, and the guard's state as it was (nothing half-taken; the
    bad op is the last one, after five good ones). Inside a step and on a closed guard, refused with what to do."""
    good = saved_after(10)
    guard, _, _ = protected()
    guard.close()
    with pytest.raises(GuardStateError, match="closed guard"):
        guard.load_state_dict(good)
    fresh, model, opt = protected()
    try:
        before = fresh.state_dict()
        for bad, says in _bad_states(good):
            with pytest.raises(GuardStateError, match=says):
                fresh.load_state_dict(bad)
            assert fresh.state_dict() == before, says
            assert fresh.check_config.checked_ops == frozenset(attnchecker.policy.OPS)
        loss_of("gpt2", model, batch("gpt2", 0)).backward()
        with pytest.raises(GuardStateError, match="inside a step"):
            fresh.load_state_dict(good)
        assert fresh.state_dict() == before
    finally:
        fresh.close()
