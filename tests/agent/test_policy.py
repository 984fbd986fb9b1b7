"""Policy: validation of every wire field, the wire round trip, presets."""
from __future__ import annotations

import pickle

import pytest

from attnchecker.errors import AttnCheckerError
from attnchecker.policy import Policy, PolicyError

WIRE_EXAMPLE = {
    "version": 4, "mode": "correct", "period": 1, "op_periods": {"scores": 4}, "adaptive": True,
    "min_period": 1, "max_period": 8, "tolerance": "roundoff", "tolerance_factor": 1.0,
    "on_uncorrectable": "log", "source_repair": True, "overhead_budget": 0.05, "tripwire": True,
    "updated_at": "2026-11-29T15:32:40.123Z", "updated_by": "alice",
}


def test_policy_from_wire_round_trips_the_documented_example():
    p = Policy.from_wire(WIRE_EXAMPLE)
    assert p.version == 4 and p.op_periods == {"scores": 4}
    wire = p.to_wire()
    assert wire == {k: v for k, v in WIRE_EXAMPLE.items() if k not in ("updated_at", "updated_by")}
    assert Policy.from_wire(wire) == p


def test_policy_defaults_are_the_documented_ones():
    p = Policy()
    assert (p.version, p.mode, p.period, dict(p.op_periods), p.adaptive) == (0, "correct", 1, {}, True)
    assert (p.min_period, p.max_period, p.tolerance, p.tolerance_factor) == (1, 8, "roundoff", 1.0)
    assert (p.on_uncorrectable, p.source_repair, p.overhead_budget) == ("log", True, 0.05)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"version": -1}, "policy.version"),
        ({"mode": "fix"}, "policy.mode"),
        ({"period": 0}, "policy.period"),
        ({"period": 1.0}, "policy.period"),
        ({"period": True}, "policy.period"),
        ({"op_periods": {"attn": 2}}, "policy.op_periods"),
        ({"op_periods": {"q": 0}}, "policy.op_periods.q"),
        ({"op_periods": {"q": False}}, "policy.op_periods.q"),
        ({"op_periods": [("q", 2)]}, "policy.op_periods"),
        ({"adaptive": 1}, "policy.adaptive"),
        ({"min_period": 0}, "policy.min_period"),
        ({"max_period": 0}, "policy.max_period"),
        ({"min_period": 9, "max_period": 8}, "policy.min_period"),
        ({"tolerance": "loose"}, "policy.tolerance"),
        ({"tolerance_factor": 0}, "policy.tolerance_factor"),
        ({"tolerance_factor": float("inf")}, "policy.tolerance_factor"),
        ({"tolerance_factor": "1"}, "policy.tolerance_factor"),
        ({"on_uncorrectable": "ignore"}, "policy.on_uncorrectable"),
        ({"source_repair": "yes"}, "policy.source_repair"),
        ({"overhead_budget": 0}, "policy.overhead_budget"),
        ({"overhead_budget": 1.5}, "policy.overhead_budget"),
        ({"overhead_budget": float("nan")}, "policy.overhead_budget"),
    ],
)
def test_policy_rejects_bad_field_naming_it(changes, field):
    with pytest.raises(PolicyError, match=rf"^{field.replace('.', '[.]')}\b"):
        Policy(**changes)
    # The same rule holds through replace() and from_wire().
    with pytest.raises(PolicyError):
        Policy().replace(**changes)
    with pytest.raises(PolicyError):
        Policy.from_wire(changes)


def test_policy_error_message_says_what_is_allowed():
    with pytest.raises(PolicyError) as e:
        Policy(period=0)
    assert str(e.value) == "policy.period must be an int >= 1, got 0"
    assert isinstance(e.value, ValueError) and isinstance(e.value, AttnCheckerError)


def test_policy_from_wire_rejects_unknown_fields_naming_them():
    with pytest.raises(PolicyError, match="unknown field.*frequency.*periodd"):
        Policy.from_wire({"periodd": 2, "frequency": 3})
    with pytest.raises(PolicyError, match="JSON object"):
        Policy.from_wire([1, 2])  # type: ignore[arg-type]


def test_policy_is_immutable_including_op_periods():
    src = {"q": 2}
    p = Policy(op_periods=src)
    src["q"] = 5
    assert p.op_periods["q"] == 2
    with pytest.raises(TypeError):
        p.op_periods["q"] = 3  # type: ignore[index]
    with pytest.raises(AttributeError):
        p.period = 3  # type: ignore[misc]


def test_policy_replace_returns_validated_copy():
    p = Policy(version=3)
    q = p.replace(period=4)
    assert (q.period, q.version, p.period) == (4, 3, 1)


def test_policy_presets():
    full = Policy.full()
    assert (full.period, full.adaptive, dict(full.op_periods)) == (1, False, {})
    paper = Policy.paper()
    assert (paper.tolerance, paper.source_repair, paper.period, paper.adaptive) == ("extreme", False, 1, False)
    assert Policy.paper(mode="detect").mode == "detect"


def test_policy_pickles():
    p = Policy(version=2, op_periods={"out": 3})
    assert pickle.loads(pickle.dumps(p)) == p


def test_the_engine_uses_the_policy_vocabulary_not_a_copy():
    from attnchecker import policy
    from attnchecker.checks import context

    assert (context.OPS, context.MODES, context.TOLERANCES) == (policy.OPS, policy.MODES, policy.TOLERANCES)
    assert context.OPS is policy.OPS and context.MODES is policy.MODES and context.TOLERANCES is policy.TOLERANCES
    assert context.TIERS is policy.TIERS


def test_tripwire_is_on_by_default_and_a_bool():
    assert Policy().tripwire is True
    assert Policy.from_wire({}).tripwire is True  # a collector from before the tiers sends no such field
    assert Policy(tripwire=False).to_wire()["tripwire"] is False
    with pytest.raises(PolicyError, match="policy.tripwire must be a bool"):
        Policy(tripwire=1)
