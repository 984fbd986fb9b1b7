"""The wire contract (docs/wire.md): every payload the agent sends validates against the collector's pydantic schemas.

The payloads come from a real guard: a tiny model trains with injected faults chosen so that every kind, pattern and
action of the vocabulary occurs, streaming with ``collector="offline"``, so each request body the transport would
send lands in the spool byte for byte (registration, event batches, stats intervals, finish). The agent and the
server never import each other; only this test sees both.
"""
from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import attnchecker
from attnchecker import Fault, FaultPlan, Policy

schemas = pytest.importorskip("attnchecker_server.schemas")

SCHEMA_OF = {
    "run": schemas.RunRegisterIn,
    "events": schemas.EventBatchIn,
    "stats": schemas.StatsIn,
    "finish": schemas.RunFinishIn,
}
STEPS = 11
DETECT_FROM = 10  # mode "detect" from this step (the last: a fault left in place spoils the weights)
FAULTS = [
    Fault(op="scores", layer=0, step=0, kind="inf"),
    Fault(op="q", layer=1, step=1, kind="neg_inf"),
    Fault(op="context", layer=0, step=2, kind="nan"),
    Fault(op="out", layer=1, step=3, kind="near_inf"),
    Fault(op="k", layer=0, step=4, kind="add", value=10.0),  # a finite error far above round-off: "silent"
    Fault(op="scores", layer=1, step=5, kind="inf", pattern="1d", axis="row"),
    Fault(op="scores", layer=0, step=6, kind="nan", pattern="2d"),  # recomputed
    # Still wrong after recompute; the policy skips that optimizer step, so the weights stay clean.
    Fault(op="v", layer=1, step=7, kind="inf", pattern="2d", persistent=True),
    Fault(op="out", layer=0, step=8, kind="bitflip"),
    Fault(op="scores", layer=1, step=DETECT_FROM, kind="inf"),
]


class _Attn(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.reshape(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(64, 32), _Attn(), _Attn(), nn.Linear(32, 64)).train()


@pytest.fixture(scope="module")
def spooled(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], attnchecker.Guard]:
    spool = tmp_path_factory.mktemp("spool")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    policy = Policy.full(on_uncorrectable="skip_step")
    guard = attnchecker.protect(model, policy=policy, optimizer=opt, run="contract-run", collector="offline",
                                spool_dir=spool, faults=FaultPlan(FAULTS), stats_interval_steps=3)
    for step in range(STEPS):
        if step == DETECT_FROM - 1:
            guard.set_policy(policy.replace(mode="detect"))  # applied at this step's boundary
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model(torch.zeros(1, 16, dtype=torch.long))  # a forward after the last step: folded into the final interval
    guard.close(flush_timeout_s=5.0)
    lines = [line for f in sorted(Path(spool).glob("*.jsonl")) for line in f.read_text().splitlines()]
    return [json.loads(line) for line in lines], guard


def _kinds(records: list[dict], kind: str) -> list[dict]:
    return [r["body"] for r in records if r["kind"] == kind]


def test_every_spooled_request_body_validates_against_the_collector_schema(spooled) -> None:
    records, _ = spooled
    assert {r["kind"] for r in records} == set(SCHEMA_OF)
    for r in records:
        # As the collector parses it: from the JSON text.
        SCHEMA_OF[r["kind"]].model_validate_json(json.dumps(r["body"]))


def test_registration_describes_the_run(spooled) -> None:
    records, _ = spooled
    run = schemas.RunRegisterIn.model_validate_json(json.dumps(_kinds(records, "run")[0]))
    assert run.name == "contract-run" and run.model == "Sequential" and run.rank == 0 and run.world_size == 1
    assert run.host and run.agent_version
    assert run.config["layers"] == 2 and run.config["policy"]["period"] == 1
    # Who the rank is (runtime/identity.py): a CPU rank is its machine, named as the collector accepts it.
    assert run.device is not None and run.device.kind == "cpu" and run.device.uuid.startswith("CPU-")
    assert run.device.hostname == run.host
    # protect() was given policy=: it goes as the new run's starting policy, every field as PUT takes it.
    assert run.policy is not None
    assert run.policy.model_dump(mode="json") == {
        k: v for k, v in Policy.full(on_uncorrectable="skip_step").to_wire().items() if k != "version"
    }
    finish = [schemas.RunFinishIn.model_validate(b) for b in _kinds(records, "finish")]
    assert [(f.rank, f.last_step) for f in finish] == [(0, STEPS)]  # the forward after the last step counts


def test_events_cover_the_whole_vocabulary(spooled) -> None:
    records, guard = spooled
    events = [e for b in _kinds(records, "events") for e in schemas.EventBatchIn.model_validate(b).events]
    # The optimizer net's detections (tier "optimizer", op "grad") stay local: the event vocabulary is the six ops,
    # and the stats carry their count (optimizer_catches).
    sent = [d for d in guard.detections if d.tier != "optimizer"]
    assert sorted(e.id for e in events) == sorted(d.id for d in sent)
    for name in ("Kind", "Pattern", "Action"):
        vocabulary = set(typing.get_args(getattr(schemas, name)))
        seen = {getattr(e, name.lower()) for e in events}
        assert seen == vocabulary, f"{name}: the scenario never produced {sorted(vocabulary - seen)}"
    assert {e.op for e in events} == set(schemas.OPS)
    assert all(e.ts.tzinfo is not None and e.policy_version == 0 for e in events)


def test_stats_intervals_agree_with_the_events(spooled) -> None:
    records, guard = spooled
    intervals = [schemas.StatsIn.model_validate(b) for b in _kinds(records, "stats")]
    assert len({i.interval_id for i in intervals}) == len(intervals)
    assert sum(i.steps for i in intervals) == STEPS
    assert intervals[0].step_start == 0 and intervals[-1].step_end == STEPS
    events = [e for b in _kinds(records, "events") for e in b["events"]]
    assert sum(f.detected for i in intervals for f in i.faults) == len(events)
    assert sum(f.uncorrectable for i in intervals for f in i.faults) == sum(
        e["action"] == "uncorrectable" for e in events)
    assert sum(f.corrected for i in intervals for f in i.faults) == sum(
        e["action"] in ("corrected", "recomputed") for e in events)
    report = guard.report()
    for op in schemas.OPS:
        assert sum(o.checks for i in intervals for o in i.ops if o.op == op) == report.checks[op]
    # Per tier: the ops' counts add up to the guard's; each sent event was caught by the tripwire or by ABFT.
    assert sum(o.tripwire_checks for i in intervals for o in i.ops) == report.tier_checks["tripwire"]
    assert sum(o.abft_catches + o.tripwire_catches for i in intervals for o in i.ops) == len(events)
    assert sum(i.optimizer_checks for i in intervals) == report.tier_checks["optimizer"] > 0
    assert sum(i.optimizer_catches for i in intervals) == report.tier_catches["optimizer"]
    # Every interval had clean checks, and the residual histogram travelled (finite) with each.
    assert all(i.residual_ratio is not None and i.residual_ratio.count > 0 for i in intervals)
    assert sum(i.transport.spooled for i in intervals) <= len(events)


def test_a_registration_policy_of_every_field_validates(tmp_path: Path) -> None:
    """A policy with no field at its default, from protect(policy=...) to the registration body the server parses."""
    policy = Policy(mode="detect", period=3, op_periods={"scores": 2, "out": 5}, adaptive=False, min_period=2,
                    max_period=12, tolerance="extreme", tolerance_factor=2, on_uncorrectable="raise",
                    source_repair=False, overhead_budget=0.2, tripwire=False)
    model = _model()
    guard = attnchecker.protect(model, policy=policy, run="contract-policy", collector="offline", spool_dir=tmp_path)
    guard.close(flush_timeout_s=5.0)
    lines = [json.loads(line) for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    (body,) = _kinds(lines, "run")
    run = schemas.RunRegisterIn.model_validate_json(json.dumps(body))
    assert run.policy is not None
    expected = {k: v for k, v in policy.to_wire().items() if k != "version"}
    assert run.policy.model_dump(mode="json") == expected


def test_an_interval_under_the_suspect_device_policy_validates() -> None:
    """The only interval field an agent sends to a collector that knows devices: the scope of the applied version."""
    from attnchecker.checks.context import OpStats
    from attnchecker.runtime.streaming import IntervalStats

    sent: list[dict] = []
    interval = IntervalStats(sent.append, rank=3, interval_steps=1)
    interval.add(0, OpStats(), 0.1)
    interval.maybe_send(applied_policy_version=2, periods=dict.fromkeys(attnchecker.policy.OPS, 1),
                        applied_policy_scope="device")
    stats = schemas.StatsIn.model_validate_json(json.dumps({**sent[0], "interval_id": "00000000-0000-4000-8000-1"}))
    assert (stats.applied_policy_version, stats.applied_policy_scope) == (2, "device")
