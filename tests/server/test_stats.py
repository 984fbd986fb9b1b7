"""Interval statistics: deltas summed, idempotent by interval_id, values (periods, versions) taken at the end."""

from typing import Any

from server_helpers import Api, make_stats, table_counts


def _post(api: Api, run_id: str, body: dict[str, Any]) -> Any:
    return api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))


def test_stats_sums_deltas_and_ignores_replays(api: Api) -> None:
    run_id = api.register()["id"]
    first = make_stats()
    assert _post(api, run_id, first).json() == {"interval_id": first["interval_id"], "duplicate": False}
    assert _post(api, run_id, first).json() == {"interval_id": first["interval_id"], "duplicate": True}
    second = make_stats(
        step_start=120,
        step_end=139,
        applied_policy_version=2,
        ops=[{"op": "scores", "checks": 5, "check_seconds": 0.5, "period": 4}],
    )
    assert _post(api, run_id, second).json()["duplicate"] is False
    run = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()
    assert run["totals"] == {"checks": 35, "detected": 4, "corrected": 2, "uncorrectable": 2}
    assert run["applied_policy_version"] == 2
    assert run["last_step"] == 139


def test_stats_invalid_is_422_and_stores_nothing(api: Api) -> None:
    run_id = api.register()["id"]
    before = table_counts(api.settings)
    bad_hist = make_stats(residual_ratio={"le": [0.1, 1.0], "counts": [1, 2], "sum": 0.3, "count": 3})
    response = _post(api, run_id, bad_hist)
    assert response.status_code == 422
    assert "residual_ratio" in response.json()["message"]
    bad_op = make_stats(faults=[{"op": "attn", "kind": "inf", "detected": 1}])
    response = _post(api, run_id, bad_op)
    assert response.status_code == 422
    assert "faults.0.op" in response.json()["message"]
    backwards = make_stats(step_start=10, step_end=5)
    assert _post(api, run_id, backwards).status_code == 422
    assert table_counts(api.settings) == before


def test_stats_interval_ids_are_unique_per_run_not_global(api: Api) -> None:
    first, second = api.register("run-a")["id"], api.register("run-b")["id"]
    stats = make_stats()
    for run_id in (first, second):
        response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=stats, headers=api.headers("agent"))
        assert response.json() == {"interval_id": stats["interval_id"], "duplicate": False}
    replay = api.client.post(f"/api/v1/runs/{second}/stats", json=stats, headers=api.headers("agent"))
    assert replay.json()["duplicate"] is True
    for run_id in (first, second):
        totals = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()["totals"]
        assert totals["checks"] == 30
