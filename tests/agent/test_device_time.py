"""checks/device_time.py: a check's time where its work runs. On the CPU the host's clock (what these tests can run);
a CUDA check's device time, between two events, added at the step boundary (the events themselves: test_triton_gpu.py
on a GPU). ``Recorded`` stands in for a CUDA event here: an event that has been recorded and reports the time
between itself and another, which is all ``settle`` asks of one."""
from __future__ import annotations

import time

import pytest
import torch
from model_zoo import build

import attnchecker
from attnchecker.checks.context import LayerContext, OpStats, Runtime
from attnchecker.checks.device_time import Clock, DeviceSpan, settle


class Recorded:
    """A recorded event at ``ms`` milliseconds on the device's clock."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def elapsed_time(self, end: Recorded) -> float:
        return end.ms - self.ms


def test_on_the_cpu_a_clock_is_the_host_s_and_leaves_nothing_for_the_step_boundary() -> None:
    ctx = LayerContext(layer=0, runtime=Runtime(stats=OpStats()))
    clock = Clock(torch.device("cpu"))
    time.sleep(0.002)
    assert clock.seconds(ctx, ["scores"]) >= 0.002
    assert ctx.runtime.device_spans == []


def test_settle_adds_each_span_to_its_ops_or_to_tier_one_and_empties_the_list() -> None:
    """A full check's span is shared evenly by its ops (one check each); a span without ops is tier 1's time. Each
    end event is waited for (free after the flags' read), and the spans are gone after."""
    stats = OpStats()
    stats.check_seconds["linear_dx"] = 0.5
    runtime = Runtime(stats=stats)
    ends = [Recorded(30.0), Recorded(110.0), Recorded(14.0)]
    runtime.device_spans += [DeviceSpan(Recorded(10.0), ends[0], ("linear_dx", "linear_dw")),
                             DeviceSpan(Recorded(100.0), ends[1], ("scores",)),
                             DeviceSpan(Recorded(12.0), ends[2], ())]
    assert settle(runtime) == pytest.approx(0.032)
    assert stats.check_seconds["linear_dx"] == pytest.approx(0.51)
    assert stats.check_seconds["linear_dw"] == pytest.approx(0.01)
    assert stats.check_seconds["scores"] == pytest.approx(0.01)
    assert stats.trip_seconds == pytest.approx(0.002)
    assert runtime.device_spans == [] and all(e.waited for e in ends)


def test_the_guard_settles_device_time_into_the_step_it_ends() -> None:
    """Guard.step() reads the step's device spans after draining its flags, before it hands the step's stats to the
    schedule: the overhead ratio the adaptive budget sees holds the device's time."""
    model = build("nanogpt")
    with attnchecker.protect(model, policy=attnchecker.Policy.full()) as guard:
        runtime = guard._runtime
        runtime.device_spans.append(DeviceSpan(Recorded(0.0), Recorded(5_000.0), ("scores",)))
        time.sleep(0.01)
        guard.step()
        assert runtime.device_spans == []
        # 5 s of device time in a step of some milliseconds: the ratio the schedule sees is that of the device.
        assert guard.last_overhead_ratio is not None and guard.last_overhead_ratio > 1.0
