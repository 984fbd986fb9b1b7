"""Values that used to be stored and then break reads or overflow totals: each is a 422 naming the field, nothing is
stored, and every read keeps working afterwards (SQLite and PostgreSQL)."""

import base64
import json
from typing import Any

import pytest
from server_helpers import Api, make_batch, make_event, make_stats, table_counts
from sqlalchemy import text

from attnchecker_server.db import make_engine


def _reads_still_work(api: Api, run_id: str | None = None) -> None:
    viewer = api.headers("viewer")
    assert api.client.get("/api/v1/runs", headers=viewer).status_code == 200
    assert api.client.get("/metrics", headers=viewer).status_code == 200
    if run_id is not None:
        assert api.client.get(f"/api/v1/runs/{run_id}", headers=viewer).status_code == 200
        assert api.client.get(f"/api/v1/runs/{run_id}/events", headers=viewer).status_code == 200


def _assert_422(response: Any, field: str) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert isinstance(body["detail"], list), body  # the documented 422 shape, whatever raised it
    assert field in body["message"], body


def _post_json(api: Api, path: str, body: Any) -> Any:
    # json.dumps escapes lone surrogates as "\\udfff", as any JSON client may send them (httpx refuses to encode them).
    headers = {**api.headers("agent"), "Content-Type": "application/json"}
    return api.client.post(path, content=json.dumps(body).encode(), headers=headers)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "deep", "config": _nested(300)}, "config"),
        ({"name": "deep", "config": _nested(33)}, "config"),
        ({"name": "lone", "config": {"k": "\udfff"}}, "config"),
        ({"name": "lone", "config": {"\ud800": 1}}, "config"),
        ({"name": "lone", "config": {"list": ["ok", ["\udc00"]]}}, "config"),
        ({"name": "big", "config": {"blob": "x" * (70 * 1024)}}, "config"),
        ({"name": "run-\udfff"}, "name"),
        ({"name": "ok", "model": "m\ud83d"}, "model"),
    ],
    ids=["depth-300", "depth-33", "surrogate-value", "surrogate-key", "surrogate-nested", "too-big", "name", "model"],
)
def test_registration_values_that_would_break_reads_are_422(api: Api, body: dict[str, Any], field: str) -> None:
    before = table_counts(api.settings)
    _assert_422(_post_json(api, "/api/v1/runs", body), field)
    assert table_counts(api.settings) == before
    _reads_still_work(api)


def test_registration_config_within_bounds_is_stored_as_sent(api: Api) -> None:
    config = {"deep": _nested(31), "text": "ünïcode ✓ 😀", "n": [1, 2.5, None, True]}
    run = api.register("fine", config=config)
    got = api.client.get(f"/api/v1/runs/{run['id']}", headers=api.headers("viewer")).json()
    assert got["config"] == config


def test_non_finite_numbers_in_config_are_422(api: Api) -> None:
    body = b'{"name": "nan", "config": {"lr": NaN, "clip": Infinity}}'
    headers = {**api.headers("agent"), "Content-Type": "application/json"}
    _assert_422(api.client.post("/api/v1/runs", content=body, headers=headers), "config")
    _reads_still_work(api)


def test_a_body_nested_past_the_parser_is_a_client_error(api: Api) -> None:
    body = b'{"name": "x", "config": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    headers = {**api.headers("agent"), "Content-Type": "application/json"}
    response = api.client.post("/api/v1/runs", content=body, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    _reads_still_work(api)


@pytest.mark.parametrize(
    "ts",
    [
        "0001-01-01T00:00:00+01:00",  # converting to UTC underflows year 1
        "9999-12-31T23:30:00-01:00",  # and overflows year 9999
        "1999-12-31T23:59:59Z",
        "2200-01-01T00:00:00Z",
    ],
)
def test_event_times_outside_2000_to_2200_are_422(api: Api, ts: str) -> None:
    run_id = api.register()["id"]
    before = table_counts(api.settings)
    batch = make_batch([make_event(step=1), make_event(step=2, ts=ts)])
    response = api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=batch, headers=api.headers("agent"))
    _assert_422(response, "events.1.ts")
    assert table_counts(api.settings) == before
    _reads_still_work(api, run_id)


def test_event_times_at_the_edges_are_stored_in_utc(api: Api) -> None:
    run_id = api.register()["id"]
    early, late = make_event(step=1, ts="2000-01-01T00:30:00+00:30"), make_event(step=2, ts="2199-12-31T23:59:59Z")
    response = api.client.post(
        f"/api/v1/runs/{run_id}/events:batch", json=make_batch([early, late]), headers=api.headers("agent")
    )
    assert response.json()["accepted"] == 2
    events = api.client.get(f"/api/v1/runs/{run_id}/events", headers=api.headers("viewer")).json()["data"]
    assert [e["ts"][:19] for e in events] == ["2000-01-01T00:00:00", "2199-12-31T23:59:59"]


def _cursor(key: list[Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "key",
    [
        [0, "0001-01-01T00:00:00+01:00", "x"],
        [0, "2026-11-29T15:32:40", "x"],  # no zone
        [2**40, "2026-11-29T15:32:40+00:00", "x"],
        [-1, "2026-11-29T15:32:40+00:00", "x"],
        ["1", "2026-11-29T15:32:40+00:00", "x"],
        [1, "2026-11-29T15:32:40+00:00", 7],
        [1, "2026-11-29T15:32:40+00:00", "x" * 37],
        [1, None, "x"],
    ],
)
def test_forged_event_cursors_are_422(api: Api, key: list[Any]) -> None:
    run_id = api.register()["id"]
    response = api.client.get(
        f"/api/v1/runs/{run_id}/events", params={"cursor": _cursor(key)}, headers=api.headers("viewer")
    )
    _assert_422(response, "cursor")
    assert response.json()["detail"][0]["loc"] == ["query", "cursor"]


@pytest.mark.parametrize("key", [["0001-01-01T00:00:00+01:00", "x"], ["2026-11-29T15:32:40+00:00", 5], ["nope", "x"]])
def test_forged_run_cursors_are_422(api: Api, key: list[Any]) -> None:
    _assert_422(api.client.get("/api/v1/runs", params={"cursor": _cursor(key)}, headers=api.headers("viewer")), "cursor")


BIG = 2**53 - 1  # the largest delta one interval may carry
LIMIT = 2**63 - 1  # a run total's column

# (field path in the 422, a stats payload whose one counter is BIG, the stored total it adds to)
COUNTERS = [
    ("faults.detected", {"faults": [{"op": "scores", "kind": "inf", "detected": BIG}]}, "run_fault_counter.detected"),
    ("faults.uncorrectable", {"faults": [{"op": "q", "kind": "nan", "uncorrectable": BIG}]}, "run_fault_counter.uncorrectable"),
    ("ops.checks", {"ops": [{"op": "scores", "checks": BIG}]}, "run_op_counter.checks"),
    ("transport.sent", {"transport": {"sent": BIG}}, "run.events_sent_total"),
    (
        "residual_ratio.counts",
        {"residual_ratio": {"le": [1.0], "counts": [BIG, 0], "sum": 0.0, "count": BIG}},
        "run.residual_count",
    ),
]


def _clean(**fields: Any) -> dict[str, Any]:
    base = make_stats(ops=[], faults=[], residual_ratio=None, transport={}, steps=1)
    base.update(fields)
    return base


def _set_total(api: Api, run_id: str, column: str, value: int) -> None:
    """Brings a stored total near its limit (reaching it by posting would take ~2^10 intervals)."""
    table, name = column.split(".")
    key = "id" if table == "run" else "run_id"
    engine = make_engine(api.settings, pooled=False)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {table} SET {name} = :v WHERE {key} = :r"), {"v": value, "r": run_id})
    engine.dispose()


@pytest.mark.parametrize(("field", "fields", "column"), COUNTERS, ids=[c[0] for c in COUNTERS])
def test_counters_that_would_overflow_a_run_total_are_422_and_the_run_keeps_ingesting(
    api: Api, field: str, fields: dict[str, Any], column: str
) -> None:
    run_id = api.register()["id"]

    def post(body: dict[str, Any]) -> Any:
        return api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent"))

    first = post(_clean(**fields))
    assert first.status_code == 200, first.text
    _set_total(api, run_id, column, LIMIT - 100)
    before_counts = table_counts(api.settings)
    before_run = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()
    _assert_422(post(_clean(**fields)), field)
    _assert_422(post(_clean(**fields)), field)  # and again: still refused, nothing added
    assert table_counts(api.settings) == before_counts
    assert api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json() == before_run
    # The run's metrics do not freeze: an ordinary interval is accepted afterwards.
    assert post(make_stats()).status_code == 200
    _reads_still_work(api, run_id)


def test_a_delta_above_2_to_53_is_422(api: Api) -> None:
    run_id = api.register()["id"]
    body = _clean(faults=[{"op": "scores", "kind": "inf", "detected": BIG + 1}])
    _assert_422(api.client.post(f"/api/v1/runs/{run_id}/stats", json=body, headers=api.headers("agent")), "detected")


def test_totals_may_reach_the_limit_exactly_and_a_replay_there_is_a_duplicate(api: Api) -> None:
    run_id = api.register()["id"]
    url = f"/api/v1/runs/{run_id}/stats"
    first = _clean(faults=[{"op": "scores", "kind": "inf", "detected": 1}])
    last = _clean(faults=[{"op": "q", "kind": "inf", "detected": BIG}])
    assert api.client.post(url, json=first, headers=api.headers("agent")).json()["duplicate"] is False
    _set_total(api, run_id, "run_fault_counter.detected", LIMIT - BIG)
    assert api.client.post(url, json=last, headers=api.headers("agent")).json()["duplicate"] is False
    assert api.client.post(url, json=last, headers=api.headers("agent")).json()["duplicate"] is True
    totals = api.client.get(f"/api/v1/runs/{run_id}", headers=api.headers("viewer")).json()["totals"]
    assert totals["detected"] == LIMIT
    one_more = _clean(faults=[{"op": "k", "kind": "nan", "detected": 1}])
    _assert_422(api.client.post(url, json=one_more, headers=api.headers("agent")), "faults.detected")
    _reads_still_work(api, run_id)


def test_steps_per_interval_above_32_bits_are_422_on_both_backends(api: Api) -> None:
    run_id = api.register()["id"]
    response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=_clean(steps=2**31), headers=api.headers("agent"))
    _assert_422(response, "steps")


@pytest.mark.parametrize(
    ("field", "fields"),
    [
        ("step_seconds", {"step_seconds": 1e308}),
        ("ops.check_seconds", {"ops": [{"op": "q", "checks": 1, "check_seconds": 1e308}]}),
        ("residual_ratio.sum", {"residual_ratio": {"le": [1.0], "counts": [1, 0], "sum": 1e308, "count": 1}}),
    ],
)
def test_float_totals_that_would_reach_infinity_are_422(api: Api, field: str, fields: dict[str, Any]) -> None:
    run_id = api.register()["id"]
    url = f"/api/v1/runs/{run_id}/stats"
    assert api.client.post(url, json=_clean(**fields), headers=api.headers("agent")).status_code == 200
    before = table_counts(api.settings)
    _assert_422(api.client.post(url, json=_clean(**fields), headers=api.headers("agent")), field)
    assert table_counts(api.settings) == before
    _reads_still_work(api, run_id)


def test_an_op_listed_twice_in_one_interval_counts_twice_toward_its_total(api: Api) -> None:
    run_id = api.register()["id"]
    huge = {"op": "k", "checks": 1, "check_seconds": 1e308}
    twice = _clean(ops=[huge, huge])
    before = table_counts(api.settings)
    response = api.client.post(f"/api/v1/runs/{run_id}/stats", json=twice, headers=api.headers("agent"))
    _assert_422(response, "ops.check_seconds")
    assert table_counts(api.settings) == before
