"""Issue 34, bounded by design: the per-token quota of live runs (429 with Retry-After), /metrics bounded by it and by
the device cap, per-device series labelled as dcgm-exporter labels GPUs, and `prune` deleting old events and
intervals without changing a run's or a device's totals. On SQLite and PostgreSQL."""

from datetime import timedelta
from typing import Any

import pytest
from collector_testing import make_token
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Api, make_api, make_batch, make_event, table_counts
from sqlalchemy import update
from test_devices import DEVICES, post_stats, register_rank

from attnchecker_server.cli import main as cli_main
from attnchecker_server.db import make_engine, make_session_factory, session_scope
from attnchecker_server.models import EventBatch, FaultEvent, Run, StatsInterval, utcnow
from attnchecker_server.services.retention import prune


def _samples(api: Api) -> list[tuple[str, dict[str, str], float]]:
    text = api.client.get("/metrics", headers=api.headers("viewer")).text
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def _age(api: Api, model: Any, days: float, **where: Any) -> None:
    """Moves rows into the past, as if they had been received (or last seen) ``days`` ago."""
    column = "last_seen_at" if model is Run else "received_at"
    engine = make_engine(api.settings, pooled=False)
    with session_scope(make_session_factory(engine)) as session:
        values = {column: utcnow() - timedelta(days=days)}
        if model is Run:
            values["created_at"] = values[column]
        session.execute(update(model).where(*(getattr(model, k) == v for k, v in where.items())).values(**values))
    engine.dispose()


def test_one_agent_token_past_its_quota_of_live_runs_gets_429_and_metrics_stay_bounded(
        make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(max_live_runs_per_token=3, metrics_cache_seconds=0)):
        agent = api.headers("agent")
        ids = [api.register(f"r{i}")["id"] for i in range(3)]
        refused = api.client.post("/api/v1/runs", json={"name": "r3"}, headers=agent)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "60"
        assert "3 live runs" in refused.json()["detail"] and "MAX_LIVE_RUNS_PER_TOKEN" in refused.json()["detail"]
        # Nothing of the refused run was stored, and /metrics knows only the three.
        assert "r3" not in {r["name"] for r in api.client.get("/api/v1/runs", headers=api.headers("viewer")).json()[
            "data"]}
        live = {lab["run"] for name, lab, _ in _samples(api) if name == "attnchecker_run_live"}
        assert live == {"r0", "r1", "r2"}
        # Another rank (the same token) of a live run adds nothing: it is not refused.
        assert api.client.post("/api/v1/runs", json={"name": "r0", "rank": 1}, headers=agent).status_code == 200
        # Finishing a run makes room; bringing a finished run back to life needs room again.
        api.client.post(f"/api/v1/runs/{ids[0]}/finish", json={}, headers=agent)
        assert api.client.post("/api/v1/runs", json={"name": "r3"}, headers=agent).status_code == 201
        assert api.client.post("/api/v1/runs", json={"name": "r0"}, headers=agent).status_code == 429
        # A run silent past run_abandoned_seconds no longer counts, nor shows as live in /metrics.
        _age(api, Run, days=2, id=ids[1])
        assert api.client.post("/api/v1/runs", json={"name": "r4"}, headers=agent).status_code == 201
        live = {lab["run"] for name, lab, v in _samples(api) if name == "attnchecker_run_live" and v == 1}
        assert live == {"r2", "r3", "r4"}
        # Operators have no quota; another agent token has its own.
        assert api.client.post("/api/v1/runs", json={"name": "op"}, headers=api.headers("operator")).status_code == 201
        other = {"Authorization": f"Bearer {make_token(api.settings, 'agent', 'other')}"}
        assert api.client.post("/api/v1/runs", json={"name": "o1"}, headers=other).status_code == 201


def test_device_series_carry_dcgm_labels_and_are_bounded_by_the_recent_devices(make_test_settings: Any) -> None:
    settings = make_test_settings(metrics_cache_seconds=0, metrics_max_devices=3)
    for api in make_api(settings):
        run_id = register_rank(api, "job", 0, "GPU-0", world_size=5, hostname="node-a")["id"]
        for rank in range(1, 5):
            register_rank(api, "job", rank, f"GPU-{rank}", world_size=5, hostname="node-b")
        post_stats(api, run_id, rank=0, checks=40, faults=3, uncorrectable=1, kind="nan")
        api.client.patch(f"{DEVICES}/GPU-0", json={"status": "suspect", "reason": "r"}, headers=api.headers("operator"))
        samples = _samples(api)
        exported = {lab["UUID"] for name, lab, _ in samples if name == "attnchecker_device_checks_total"}
        assert len(exported) == 3  # the cap, most recently seen first: GPU-0 reported last
        assert "GPU-0" in exported
        omitted = [v for name, _, v in samples if name == "attnchecker_metrics_devices_omitted"]
        assert omitted == [2]
        mine = {(name, tuple(sorted(lab.items()))): v for name, lab, v in samples if lab.get("UUID") == "GPU-0"}
        base = (("Hostname", "node-a"), ("UUID", "GPU-0"))
        assert mine[("attnchecker_device_checks_total", base)] == 80
        assert mine[("attnchecker_device_faults_total", (*base[:1], *base[1:], ("action", "corrected"),
                                                         ("kind", "nan")))] == 2
        faults = {(dict(k[1])["action"]): v for k, v in mine.items() if k[0] == "attnchecker_device_faults_total"}
        assert faults == {"corrected": 2, "uncorrectable": 1, "detected": 0}
        assert mine[("attnchecker_device_suspect", base)] == 0  # one device, one run: nothing to compare with
        assert mine[("attnchecker_device_status", (*base, ("status", "suspect")))] == 1
        # Devices not seen within metrics_device_recent_seconds leave /metrics.
        engine = make_engine(api.settings, pooled=False)
        from attnchecker_server.models import Device
        with session_scope(make_session_factory(engine)) as session:
            session.execute(update(Device).values(last_seen_at=utcnow() - timedelta(days=3)))
        engine.dispose()
        assert not [1 for name, _, _ in _samples(api) if name == "attnchecker_device_checks_total"]


def _totals(api: Api) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    viewer = api.headers("viewer")
    runs = sorted(api.client.get("/api/v1/runs", headers=viewer).json()["data"], key=lambda r: r["name"])
    devices = sorted(api.client.get(DEVICES, headers=viewer).json()["items"], key=lambda d: d["uuid"])
    return ([{k: r[k] for k in ("name", "totals", "last_step", "applied_policy_version")} for r in runs],
            [{k: d[k] for k in ("uuid", "totals", "faults", "suspicion")} for d in devices])


def test_prune_deletes_old_events_and_intervals_and_keeps_every_total(
        api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    agent = api.headers("agent")
    for name, days in (("old", 400), ("straddling", 200), ("new", 0)):
        run_id = register_rank(api, name, 0, "GPU-a")["id"]
        register_rank(api, name, 1, "GPU-b")
        for rank in (0, 1):
            post_stats(api, run_id, rank=rank, checks=100, faults=2 + rank)
            api.client.post(f"/api/v1/runs/{run_id}/events:batch",
                            json=make_batch([make_event(step=s, rank=rank) for s in range(3)]), headers=agent)
        for model in (FaultEvent, StatsInterval, EventBatch, Run):
            if days:
                _age(api, model, days, **({"id": run_id} if model is Run else {"run_id": run_id}))
        if name == "straddling":  # and newer rows in the same run
            post_stats(api, run_id, rank=0, checks=5, faults=1)
            api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=make_batch([make_event(step=9)]),
                            headers=agent)
    before, counts = _totals(api), table_counts(api.settings)
    sessions = make_session_factory(make_engine(api.settings, pooled=False))
    dry = prune(sessions, older_than=timedelta(days=90), dry_run=True)
    assert dry.deleted == {"fault_event": 12, "stats_interval": 4, "event_batch": 4}
    assert table_counts(api.settings) == counts

    # The command an operator runs, in batches of 5 rows.
    monkeypatch.setenv("ATTNCHECKER_DATABASE_URL", api.settings.effective_database_url)
    assert cli_main(["prune", "--older-than", "90d", "--batch-size", "5"]) == 0
    assert "deleted 12 fault_event, 4 stats_interval, 4 event_batch received before" in capsys.readouterr().out
    after = table_counts(api.settings)
    assert (after["fault_event"], after["stats_interval"], after["event_batch"]) == (
        counts["fault_event"] - 12, counts["stats_interval"] - 4, counts["event_batch"] - 4)
    assert _totals(api) == before
    # The newest run keeps its events; the straddling run keeps what arrived since.
    viewer = api.headers("viewer")
    by_name = {r["name"]: r["id"] for r in api.client.get("/api/v1/runs", headers=viewer).json()["data"]}
    assert len(api.client.get(f"/api/v1/runs/{by_name['new']}/events", headers=viewer).json()["data"]) == 6
    assert [e["step"] for e in api.client.get(f"/api/v1/runs/{by_name['straddling']}/events",
                                              headers=viewer).json()["data"]] == [9]
    # Again: nothing left to delete.
    assert prune(sessions, older_than=timedelta(days=90)).deleted == dict.fromkeys(dry.deleted, 0)
    with pytest.raises(ValueError, match="at least 1 day"):
        prune(sessions, older_than=timedelta(hours=12))
