"""attnchecker.inject: seeded, deterministic fault injection and its ground truth."""
from __future__ import annotations

import math

import pytest
import torch

from attnchecker.attention.pipeline import protected_linear
from attnchecker.inject import Fault, FaultPlan, Injector, bitflip


def zeros_plus(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).view(shape) / 100 + 0.25


def test_same_seed_same_location_other_seed_elsewhere() -> None:
    hits = []
    for seed in (5, 5, 6):
        out = zeros_plus((3, 4, 11, 13))
        inj = Injector([Fault(op="scores", layer=1, step=2, kind="nan", seed=seed)])
        inj.apply(out, op="scores", layer=1, step=2)
        rec = inj.injected[0]
        hits.append((rec.batch, rec.head, rec.rows, rec.cols))
        assert int(out.isnan().sum()) == 1
        assert bool(out[rec.batch, rec.head, rec.rows[0], rec.cols[0]].isnan())
    assert hits[0] == hits[1] != hits[2]


def test_fault_fires_only_at_its_op_layer_and_step() -> None:
    inj = Injector(FaultPlan([Fault(op="k", layer=1, step=3, kind="inf")]))
    out = zeros_plus((2, 5, 6))
    for op, layer, step in (("q", 1, 3), ("k", 0, 3), ("k", 1, 2)):
        inj.apply(out, op=op, layer=layer, step=step)
    assert torch.isfinite(out).all() and inj.injected == []
    inj.apply(out, op="k", layer=1, step=3)
    assert int(out.isinf().sum()) == 1


def test_transient_fault_fires_once_persistent_every_time() -> None:
    transient = Injector([Fault(op="v", layer=0, step=0, kind="neg_inf")])
    persistent = Injector([Fault(op="v", layer=0, step=0, kind="neg_inf", persistent=True)])
    for attempt in (0, 1):
        for inj in (transient, persistent):
            out = zeros_plus((1, 4, 4))
            inj.apply(out, op="v", layer=0, step=0, attempt=attempt)
    assert [r.attempt for r in transient.injected] == [0]
    assert [r.attempt for r in persistent.injected] == [0, 1]
    assert persistent.injected[0].rows == persistent.injected[1].rows
    # fires(): what the next computation would see, asked without consuming it (the engine picks a path with it).
    assert not transient.fires(op="v", layer=0, step=0) and persistent.fires(op="v", layer=0, step=0)
    fresh = Injector([Fault(op="v", layer=0, step=0, kind="nan")])
    assert fresh.fires(op="v", layer=0, step=0) and fresh.fires(op="v", layer=0, step=0)
    assert not fresh.fires(op="v", layer=1, step=0) and not fresh.fires(op="q", layer=0, step=0)


def test_explicit_location_and_ground_truth_values() -> None:
    out = zeros_plus((2, 3, 5, 7))
    original = float(out[1, 2, 4, 6])
    inj = Injector([Fault(op="context", layer=0, step=0, kind="near_inf", value=3e15, batch=1, head=2, row=4, col=6)])
    inj.apply(out, op="context", layer=0, step=0)
    rec = inj.injected[0]
    assert (rec.batch, rec.head, rec.row, rec.col) == (1, 2, 4, 6)
    assert rec.original == pytest.approx(original) and rec.value == pytest.approx(3e15)
    assert float(out[1, 2, 4, 6]) == pytest.approx(3e15)


@pytest.mark.parametrize("axis", ["row", "col"])
def test_one_dimensional_fault_spans_a_whole_row_or_column(axis: str) -> None:
    out = zeros_plus((2, 6, 9))
    inj = Injector([Fault(op="out", layer=0, step=0, kind="inf", pattern="1d", axis=axis, seed=3)])
    inj.apply(out, op="out", layer=0, step=0)
    rec = inj.injected[0]
    bad = out[rec.batch].isinf()
    if axis == "row":
        assert rec.cols == tuple(range(9)) and bad[rec.rows[0]].all() and int(bad.sum()) == 9
    else:
        assert rec.rows == tuple(range(6)) and bad[:, rec.cols[0]].all() and int(bad.sum()) == 6


def test_block_fault_is_clipped_to_the_matrix() -> None:
    out = zeros_plus((1, 4, 5))
    inj = Injector([Fault(op="q", layer=0, step=0, kind="nan", pattern="2d", block=(3, 9), row=3, col=4)])
    inj.apply(out, op="q", layer=0, step=0)
    rec = inj.injected[0]
    assert rec.rows == (1, 2, 3) and rec.cols == (0, 1, 2, 3, 4)
    assert int(out.isnan().sum()) == 15


@pytest.mark.parametrize(
    ("dtype", "value", "expected"),
    [
        (torch.float32, 1.0, math.inf),  # bit 30 of an exponent 127 -> 255, mantissa 0: INF
        (torch.float32, 0.5, 0.5 * 2.0**128),  # near-INF
        (torch.float32, 3.0, 3.0 * 2.0**64),  # |v| >= 2: bit 29 -> ×2^64
        (torch.bfloat16, 1.0, math.inf),
        (torch.bfloat16, -3.0, -3.0 * 2.0**64),
        (torch.float16, 1.0, math.inf),
        (torch.float16, 3.0, 3.0 * 2.0**8),
    ],
)
def test_bitflip_flips_the_papers_exponent_bit(dtype: torch.dtype, value: float, expected: float) -> None:
    assert float(bitflip(torch.tensor([value], dtype=dtype))[0]) == expected


def test_bitflip_of_a_one_point_five_is_nan() -> None:
    assert math.isnan(float(bitflip(torch.tensor([1.5]))[0]))


def test_random_plan_is_reproducible_and_sized() -> None:
    kwargs = {"steps": 20, "layers": 3, "kinds": ("inf", "nan"), "patterns": ("0d", "1d")}
    a = FaultPlan.random(per_step=2, seed=7, **kwargs)
    b = FaultPlan.random(per_step=2, seed=7, **kwargs)
    c = FaultPlan.random(per_step=2, seed=8, **kwargs)
    assert a.faults == b.faults != c.faults
    assert len(a.faults) == 40 and {f.step for f in a.faults} == set(range(20))
    rated = FaultPlan.random(rate=0.1, seed=1, **kwargs).faults
    slots = 20 * 3 * 6
    assert 0.04 * slots < len(rated) < 0.2 * slots
    assert {f.kind for f in rated} <= {"inf", "nan"} and {f.pattern for f in rated} <= {"0d", "1d"}


def test_random_plan_needs_exactly_one_of_rate_and_per_step() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        FaultPlan.random(steps=3, layers=1, seed=0)
    with pytest.raises(ValueError, match="exactly one"):
        FaultPlan.random(steps=3, layers=1, rate=0.5, per_step=1, seed=0)


@pytest.mark.parametrize(
    ("field", "value"), [("op", "attn"), ("kind", "zero"), ("pattern", "3d"), ("axis", "diagonal")]
)
def test_fault_rejects_unknown_values(field: str, value: str) -> None:
    kwargs = {"op": "q", "layer": 0, "step": 0, field: value}
    with pytest.raises(ValueError, match=f"fault.{field}"):
        Fault(**kwargs)


def test_injection_reaches_the_output_with_protection_off(make_ctx) -> None:
    x = zeros_plus((2, 5, 8))
    w = torch.eye(8)
    for mode, finite in (("off", False), ("correct", True)):
        ctx, _ = make_ctx(faults=[Fault(op="out", layer=0, step=0, kind="nan", seed=2)], mode=mode)
        y = protected_linear(x, w, None, ctx=ctx, op="out")
        assert bool(torch.isfinite(y).all()) is finite
        assert len(ctx.runtime.injector.injected) == 1
