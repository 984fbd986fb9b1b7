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


def _op_samples(client: TestClient, api: Api, run: str) -> dict[tuple[str, str], float]:
    text = client.get("/metrics", headers=api.headers("viewer")).text
    return {(s.name, s.labels["op"]): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.labels.get("run") == run and "op" in s.labels}


def test_whole_step_op_rows_are_summed_and_exported_beside_the_attention_ops(api: Api) -> None:
    """protect(scope="all") sends a row per whole-step op it checked (issue 17): its checks, tier-1 checks and
    catches reach the same counters as the attention ops', and its period is the schedule it follows."""
    run_id = api.register("whole-step")["id"]
    ops = [{"op": "out", "checks": 2, "check_seconds": 0.1, "period": 8, "tripwire_checks": 14},
           {"op": "linear_dw", "checks": 6, "check_seconds": 0.3, "period": 8, "tripwire_checks": 42,
            "tripwire_catches": 1},
           {"op": "grad_probs", "checks": 2, "check_seconds": 0.05, "period": 8, "abft_catches": 1}]
    _post(api, run_id, make_stats(ops=ops))
    _post(api, run_id, make_stats(step_start=200, step_end=215, ops=ops))
    samples = _op_samples(api.client, api, "whole-step")
    assert samples[("attnchecker_checks_total", "linear_dw")] == 12
    assert samples[("attnchecker_check_period_steps", "linear_dw")] == 8
    tiers = _tier_samples(api.client, api)
    assert tiers[("attnchecker_tier_checks_total", "whole-step", "abft", "linear_dw")] == 12
    assert tiers[("attnchecker_tier_checks_total", "whole-step", "tripwire", "linear_dw")] == 84
    assert tiers[("attnchecker_tier_catches_total", "whole-step", "tripwire", "linear_dw")] == 2
    assert tiers[("attnchecker_tier_catches_total", "whole-step", "abft", "grad_probs")] == 2
    run = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()
    assert run["totals"]["checks"] == 2 * (2 + 6 + 2)


def test_an_op_outside_the_vocabulary_is_422_and_names_the_field(api: Api) -> None:
    run_id = api.register("bad-op")["id"]
    body = make_stats(ops=[{"op": "mlp", "checks": 1}])
    response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))
    assert response.status_code == 422
    assert "op" in response.json()["message"]
