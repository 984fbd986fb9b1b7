"""Issue 10: per-tier checks and catches in the stats payload are summed per run and exported as
attnchecker_tier_checks_total / attnchecker_tier_catches_total{run, tier, op}; an agent from before the tiers (no
such fields) still validates."""

from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Api, make_stats


def _tier_samples(client: TestClient, api: Api) -> dict[tuple[str, str, str, str], float]:
    text = client.get("/metrics", headers=api.headers("viewer")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("attnchecker_tier_"):
                out[(s.name, s.labels["run"], s.labels["tier"], s.labels["op"])] = s.value
    return out


def _post(api: Api, run_id: str, body: dict[str, Any]) -> None:
    response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))
    assert response.status_code == 200, response.text


def test_tier_counts_are_summed_and_exported(api: Api) -> None:
    run_id = api.register("tiers")["id"]
    ops = [{"op": "scores", "checks": 2, "check_seconds": 0.1, "period": 8, "tripwire_checks": 14,
            "tripwire_catches": 1, "abft_catches": 0},
           {"op": "q", "checks": 2, "check_seconds": 0.1, "period": 8, "tripwire_checks": 14,
            "tripwire_catches": 0, "abft_catches": 1}]
    _post(api, run_id, make_stats(ops=ops, optimizer_checks=16, optimizer_catches=1, tripwire_seconds=0.01))
    _post(api, run_id, make_stats(step_start=200, step_end=215, ops=ops, optimizer_checks=16))
    samples = _tier_samples(api.client, api)
    assert samples[("attnchecker_tier_checks_total", "tiers", "tripwire", "scores")] == 28
    assert samples[("attnchecker_tier_catches_total", "tiers", "tripwire", "scores")] == 2
    assert samples[("attnchecker_tier_checks_total", "tiers", "abft", "q")] == 4
    assert samples[("attnchecker_tier_catches_total", "tiers", "abft", "q")] == 2
    assert samples[("attnchecker_tier_checks_total", "tiers", "optimizer", "grad")] == 32
    assert samples[("attnchecker_tier_catches_total", "tiers", "optimizer", "grad")] == 1


def test_an_agent_without_tiers_still_validates(api: Api) -> None:
    """Before the tiers every check was a full ABFT check: its checks count under tier "abft", nothing else."""
    run_id = api.register("old-agent")["id"]
    _post(api, run_id, make_stats())  # no tier fields at all
    mine = {key[2:]: v for key, v in _tier_samples(api.client, api).items() if key[1] == "old-agent"}
    assert {tier for tier, _ in mine} == {"abft"}
    assert _tier_samples(api.client, api)[("attnchecker_tier_checks_total", "old-agent", "abft", "scores")] == 20


def test_negative_tier_counts_are_422(api: Api) -> None:
    run_id = api.register("bad-tiers")["id"]
    body = make_stats(ops=[{"op": "q", "checks": 1, "tripwire_checks": -1}])
    response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))
    assert response.status_code == 422
    assert "tripwire_checks" in response.json()["message"]
