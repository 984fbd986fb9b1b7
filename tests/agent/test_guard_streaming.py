"""The guard's streaming side without a collector: arguments, the collector's policy at step boundaries, the stats
intervals it hands to the transport, and the overhead the scheduler sees. (Against a real collector: tests/e2e.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker import Policy
from attnchecker.transport import RemotePolicy


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                                 num_layers=2, enable_nested_tensor=False)


def _step(model: nn.Module, guard: attnchecker.Guard) -> None:
    model(torch.randn(2, 8, 16)).sum().backward()
    guard.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"token": "t"}, "needs collector="),
        ({"spool_dir": "/tmp/x"}, "needs collector="),
        ({"collector": "ftp://host"}, "http"),
        ({"collector": "offline", "stats_interval_steps": 0}, "stats_interval_steps"),
        ({"collector": "offline", "stats_interval_s": -1}, "stats_interval_s"),
        ({"collector": "offline", "transport_options": {"batch_size": 0}}, "batch_size"),
    ],
)
def test_bad_streaming_arguments_raise_and_leave_the_model_alone(kwargs: dict, match: str, tmp_path: Path) -> None:
    model = _model()
    if kwargs.get("collector") == "offline":
        kwargs = {"spool_dir": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=match):
        attnchecker.protect(model, **kwargs)
    assert not attnchecker.is_protected(model)


def test_without_a_collector_nothing_streams() -> None:
    model = _model()
    with attnchecker.protect(model) as guard:
        _step(model, guard)
        assert guard.transport is None and guard.intervals == []
        assert dict(guard.periods) == dict.fromkeys(("q", "k", "v", "scores", "context", "out"), 1)


def _registration(guard: attnchecker.Guard) -> dict:
    return json.loads(guard.transport.run_body)


def test_an_explicit_policy_goes_into_the_registration_only_when_given(tmp_path: Path) -> None:
    model = _model()
    given = Policy(period=3, mode="detect", op_periods={"scores": 2})
    guard = attnchecker.protect(model, policy=given, collector="offline", spool_dir=tmp_path / "a", run="given")
    body = _registration(guard)
    guard.close()
    assert body["policy"] == {k: v for k, v in given.to_wire().items() if k != "version"}
    # A mapping counts as given too.
    guard = attnchecker.protect(model, policy={"period": 2}, collector="offline", spool_dir=tmp_path / "b", run="m")
    body = _registration(guard)
    guard.close()
    assert body["policy"]["period"] == 2 and "version" not in body["policy"]
    # Defaulted: a new run gets the collector's default, so nothing is sent.
    guard = attnchecker.protect(model, collector="offline", spool_dir=tmp_path / "c", run="defaulted")
    body = _registration(guard)
    guard.close()
    assert "policy" not in body
    assert body["config"]["policy"]["period"] == 1  # still described in the config


def test_the_collectors_policy_is_applied_at_the_next_step_boundary(tmp_path: Path) -> None:
    model = _model()
    guard = attnchecker.protect(model, policy=Policy.full(), collector="offline", spool_dir=tmp_path,
                                run="offline-policy", stats_interval_steps=100)
    _step(model, guard)
    remote = Policy(version=3, period=2, adaptive=False)
    guard.transport._latest = RemotePolicy(remote)
    assert guard.policy.version == 0  # not before the boundary
    _step(model, guard)
    assert guard.policy is remote and set(guard.periods.values()) == {2}
    # The interval goes out at the boundary where the version changed, reporting it as applied.
    (body,) = guard.intervals
    assert (body["step_start"], body["step_end"], body["applied_policy_version"]) == (0, 1, 3)
    assert {o["period"] for o in body["ops"]} == {2}

    # set_policy() pending at the same boundary as a new collector version wins there; the next version replaces it.
    guard.set_policy(Policy.full(version=0))
    guard.transport._latest = RemotePolicy(Policy(version=4))
    _step(model, guard)
    assert guard.policy.version == 0
    guard.transport._latest = RemotePolicy(Policy(version=5))
    _step(model, guard)
    assert guard.policy.version == 5
    guard.close()
    stats = [json.loads(line)["body"] for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()
             if json.loads(line)["kind"] == "stats"]
    assert [b["applied_policy_version"] for b in stats] == [3, 0, 5]
    assert sum(b["steps"] for b in stats) == 4


def test_the_suspect_device_policy_is_applied_at_a_boundary_and_reported_with_its_scope(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What the collector's answer for a rank on a suspect device looks like to the guard (the sender's RemotePolicy,
    scope "device"): applied at the next boundary, reported with its scope, and said out loud; back to the run's
    policy when the suspicion is lifted. Against a real collector: tests/e2e/test_fleet.py."""
    model = _model()
    guard = attnchecker.protect(model, collector="offline", spool_dir=tmp_path, run="suspect", rank=1,
                                stats_interval_steps=100)
    guard.transport._latest = RemotePolicy(Policy(version=2, period=4))
    _step(model, guard)
    guard.transport._latest = RemotePolicy(Policy.full(version=1), scope="device")
    with caplog.at_level("WARNING", logger="attnchecker"):
        _step(model, guard)
    assert guard.policy.version == 1 and set(guard.periods.values()) == {1}
    assert "rank 1's device" in caplog.text and "suspect-device policy v1" in caplog.text
    guard.transport._latest = RemotePolicy(Policy(version=2, period=4))
    _step(model, guard)
    assert guard.policy.version == 2
    guard.close()
    stats = [json.loads(line)["body"] for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()
             if json.loads(line)["kind"] == "stats"]
    # Each change of policy sends its interval at once; only the device policy's names its scope.
    assert [(b["applied_policy_version"], b.get("applied_policy_scope")) for b in stats] == [
        (2, None), (1, "device"), (2, None)]


def test_a_measured_step_with_nothing_checked_costs_zero_overhead() -> None:
    model = _model()
    guard = attnchecker.protect(model, policy=Policy(period=4, adaptive=False))
    seen: list[float | None] = []
    for _ in range(3):
        _step(model, guard)
        seen.append(guard.last_overhead_ratio)  # what the scheduler was given for that step
    guard.close()
    assert seen[0] is not None and seen[0] > 0  # step 0 checks every op
    assert seen[1:] == [0.0, 0.0]  # nothing due on steps 1 and 2: measured, and free


def test_close_sends_the_step_in_progress_and_the_finish_record(tmp_path: Path) -> None:
    model = _model()
    guard = attnchecker.protect(model, policy=Policy.full(), collector="offline", spool_dir=tmp_path, run="partial")
    _step(model, guard)
    model(torch.randn(1, 8, 16))  # a forward with no step() after it (evaluation, or a crash before the step)
    guard.close()
    guard.close()  # idempotent
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    (stats,) = [r["body"] for r in records if r["kind"] == "stats"]
    assert (stats["step_start"], stats["step_end"], stats["steps"]) == (0, 1, 1)
    assert {o["op"]: o["checks"] for o in stats["ops"]}["scores"] == 4  # 2 layers x (step 0 + the extra forward)
    assert guard.report().checks["scores"] == 4
    assert [r["body"] for r in records if r["kind"] == "finish"] == [{"rank": 0, "last_step": 1}]


_NEVER_CLOSED = """
import sys, torch
from torch import nn
import attnchecker
torch.manual_seed(0)
model = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True),
                              num_layers=2, enable_nested_tensor=False)
guard = attnchecker.protect(model, policy=attnchecker.Policy.full(), collector="offline", spool_dir=sys.argv[1],
                            run="at-exit")
model(torch.randn(2, 8, 16)).sum().backward()
guard.step()
model(torch.randn(1, 8, 16))  # a step in progress at exit
"""


def test_a_script_that_never_closes_still_sends_its_last_interval_and_finishes_once(tmp_path: Path) -> None:
    # One atexit hook (the RunLink's) closes the guard, which sends the last interval and then closes the transport:
    # the step in progress is in the stats, and the run is finished exactly once.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _NEVER_CLOSED, str(tmp_path)], env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    (stats,) = [r["body"] for r in records if r["kind"] == "stats"]
    assert (stats["step_start"], stats["step_end"], stats["steps"]) == (0, 1, 1)
    assert {o["op"]: o["checks"] for o in stats["ops"]}["scores"] == 4  # 2 layers x (step 0 + the extra forward)
    assert [r["body"] for r in records if r["kind"] == "finish"] == [{"rank": 0, "last_step": 1}]
