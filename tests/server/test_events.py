"""events:batch (idempotency, atomicity, limits) and the events query (filters, cursor)."""

import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from server_helpers import Api, make_api, make_batch, make_event, new_id, table_counts

from attnchecker_server.main import create_app


def _post(api: Api, run_id: str, body: Any, **kwargs: Any) -> Any:
    return api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=body, headers=api.headers("agent"), **kwargs)


def _stored_ids(api: Api, run_id: str) -> list[str]:
    response = api.client.get(f"/api/v1/runs/{run_id}/events?limit=1000", headers=api.headers("viewer"))
    assert response.status_code == 200, response.text
    return [event["id"] for event in response.json()["data"]]


def test_events_batch_stores_events_once_when_posted_twice(api: Api) -> None:
    run_id = api.register()["id"]
    batch = make_batch(n=4)
    first, second = _post(api, run_id, batch), _post(api, run_id, batch)
    assert first.status_code == second.status_code == 200
    assert first.json() == {"batch_id": batch["batch_id"], "accepted": 4, "duplicates": 0}
    assert second.json() == {"batch_id": batch["batch_id"], "accepted": 0, "duplicates": 4}
    assert sorted(_stored_ids(api, run_id)) == sorted(e["id"] for e in batch["events"])


def test_events_batch_skips_event_ids_seen_in_another_batch(api: Api) -> None:
    run_id = api.register()["id"]
    old = make_event(step=1)
    _post(api, run_id, make_batch([old]))
    response = _post(api, run_id, make_batch([old, make_event(step=2)]))
    assert response.json()["accepted"] == 1
    assert response.json()["duplicates"] == 1
    assert len(_stored_ids(api, run_id)) == 2


def test_events_batch_concurrent_duplicates_store_each_event_once(api: Api) -> None:
    run_id = api.register()["id"]
    batch = make_batch(n=50)
    results: list[dict[str, int]] = []
    barrier = threading.Barrier(8)

    def post() -> None:
        barrier.wait()
        response = _post(api, run_id, batch)
        assert response.status_code == 200, response.text
        results.append(response.json())

    threads = [threading.Thread(target=post) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == 8
    assert sum(r["accepted"] for r in results) == 50
    assert sum(r["duplicates"] for r in results) == 7 * 50
    assert sorted(_stored_ids(api, run_id)) == sorted(e["id"] for e in batch["events"])


def test_events_batch_concurrent_overlapping_batches_store_each_event_once(api: Api) -> None:
    # Same events under 8 batch ids, half of them in reverse order: only the event-id conflict protects here, and
    # PostgreSQL must not deadlock on rows locked in opposite orders.
    run_id = api.register()["id"]
    events = [make_event(step=i) for i in range(30)]
    barrier = threading.Barrier(8)
    accepted: list[int] = []

    def post(reverse: bool) -> None:
        barrier.wait()
        response = _post(api, run_id, make_batch(events[::-1] if reverse else events))
        assert response.status_code == 200, response.text
        accepted.append(response.json()["accepted"])

    threads = [threading.Thread(target=post, args=(i % 2 == 1,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(accepted) == 8
    assert sum(accepted) == 30
    assert len(_stored_ids(api, run_id)) == 30


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"op": "attn"}, "op"),
        ({"kind": "overflow"}, "kind"),
        ({"pattern": "3d"}, "pattern"),
        ({"action": "ignored"}, "action"),
        ({"ts": "2026-11-29T15:32:40"}, "ts"),
        ({"bound": -1.0}, "bound"),
        ({"step": "seventeen"}, "step"),
        ({"extra_field": 1}, "extra_field"),
    ],
)
def test_events_batch_with_one_bad_event_stores_nothing(api: Api, change: dict[str, Any], field: str) -> None:
    run_id = api.register()["id"]
    before = table_counts(api.settings)
    batch = make_batch([make_event(step=1), make_event(**{"step": 2, **change})])
    response = _post(api, run_id, batch)
    assert response.status_code == 422, response.text
    assert field in response.json()["message"]
    assert table_counts(api.settings) == before


def test_events_batch_over_event_limit_is_422_and_stores_nothing(make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(max_events_per_batch=5)):
        run_id = api.register()["id"]
        before = table_counts(api.settings)
        response = _post(api, run_id, make_batch(n=6))
        assert response.status_code == 422
        assert "limit is 5" in response.json()["message"]
        assert table_counts(api.settings) == before
        assert _post(api, run_id, make_batch(n=5)).status_code == 200


def test_events_batch_oversized_body_is_413_and_stores_nothing(make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(max_body_bytes=4096)):
        run_id = api.register()["id"]
        before = table_counts(api.settings)
        body = make_batch(n=40)
        assert len(json.dumps(body)) > 4096
        assert _post(api, run_id, body).status_code == 413
        # Chunked (no Content-Length): the limit counts the bytes actually streamed.
        chunks = [json.dumps(body).encode()[i : i + 1000] for i in range(0, len(json.dumps(body)), 1000)]
        response = api.client.post(
            f"/api/v1/runs/{run_id}/events:batch",
            content=iter(chunks),
            headers={**api.headers("agent"), "content-type": "application/json"},
        )
        assert response.status_code == 413
        assert "larger than 4096 bytes" in response.json()["detail"]
        assert table_counts(api.settings) == before


def test_events_batch_unknown_run_is_404(api: Api) -> None:
    response = _post(api, new_id(), make_batch())
    assert response.status_code == 404
    assert "register" in response.json()["detail"]


def test_events_query_filters(api: Api) -> None:
    run_id = api.register()["id"]
    events = [
        make_event(step=1, op="q", kind="nan", layer=0, rank=0, action="corrected"),
        make_event(step=5, op="scores", kind="inf", layer=1, rank=1, action="recomputed"),
        make_event(step=9, op="scores", kind="silent", layer=1, rank=0, action="uncorrectable"),
    ]
    _post(api, run_id, make_batch(events))

    def steps(query: str) -> list[int]:
        response = api.client.get(f"/api/v1/runs/{run_id}/events?{query}", headers=api.headers("viewer"))
        assert response.status_code == 200, response.text
        return [e["step"] for e in response.json()["data"]]

    assert steps("") == [1, 5, 9]
    assert steps("op=scores") == [5, 9]
    assert steps("kind=nan") == [1]
    assert steps("layer=1&rank=0") == [9]
    assert steps("action=recomputed") == [5]
    assert steps("step_min=2&step_max=9") == [5, 9]
    bad = api.client.get(f"/api/v1/runs/{run_id}/events?op=attn", headers=api.headers("viewer"))
    assert bad.status_code == 422
    assert "op" in bad.json()["message"]


def test_events_query_returns_the_event_as_sent(api: Api) -> None:
    run_id = api.register()["id"]
    event = make_event(step=3, value="-inf", residual=12.5, location={"batch": 1, "head": None, "row": 2, "col": 3})
    _post(api, run_id, make_batch([event]))
    [stored] = api.client.get(f"/api/v1/runs/{run_id}/events", headers=api.headers("viewer")).json()["data"]
    assert stored["ts"].startswith("2026-11-29T15:32:40.123")
    for key in (
        "id",
        "step",
        "rank",
        "layer",
        "op",
        "pattern",
        "kind",
        "action",
        "location",
        "value",
        "residual",
        "bound",
        "policy_version",
    ):
        assert stored[key] == event[key], key


def test_events_query_cursor_pages_in_step_ts_id_order(api: Api) -> None:
    run_id = api.register()["id"]
    events = [make_event(step=i % 4, ts=f"2026-11-29T15:32:4{i % 3}.000Z") for i in range(11)]
    _post(api, run_id, make_batch(events))
    seen: list[tuple[int, str, str]] = []
    cursor = None
    for _ in range(10):
        query = "limit=3" + (f"&cursor={cursor}" if cursor else "")
        page = api.client.get(f"/api/v1/runs/{run_id}/events?{query}", headers=api.headers("viewer")).json()
        seen += [(e["step"], e["ts"], e["id"]) for e in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 11
    assert seen == sorted(seen)
    bad = api.client.get(f"/api/v1/runs/{run_id}/events?cursor=garbage", headers=api.headers("viewer"))
    assert bad.status_code == 422
    assert "cursor" in bad.json()["message"]
    assert bad.json()["detail"][0]["loc"] == ["query", "cursor"]  # a 422 body has the one documented shape


def test_events_survive_a_new_app_on_the_same_database(api: Api) -> None:
    run_id = api.register()["id"]
    _post(api, run_id, make_batch(n=2))
    with TestClient(create_app(api.settings)) as client:
        response = client.get(f"/api/v1/runs/{run_id}/events", headers=api.headers("viewer"))
    assert len(response.json()["data"]) == 2


def test_event_and_batch_ids_are_unique_per_run_not_global(api: Api) -> None:
    """The same batch (same batch id, same event ids) posted into two runs is stored in both; a repeat in one is not."""
    first, second = api.register("run-a")["id"], api.register("run-b")["id"]
    batch = make_batch(n=3)
    assert _post(api, first, batch).json() == {"batch_id": batch["batch_id"], "accepted": 3, "duplicates": 0}
    assert _post(api, second, batch).json() == {"batch_id": batch["batch_id"], "accepted": 3, "duplicates": 0}
    again = make_batch(batch["events"])  # a new batch id, old event ids: duplicates within the run
    assert _post(api, second, again).json()["duplicates"] == 3
    expected = sorted(e["id"] for e in batch["events"])
    assert sorted(_stored_ids(api, first)) == sorted(_stored_ids(api, second)) == expected
