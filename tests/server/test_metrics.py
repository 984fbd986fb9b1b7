"""/metrics after a known ingest: values, names/types/labels from docs/wire.md, restarts, bounds, caching."""

import shutil
import subprocess
import threading
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import Api, make_api, make_batch, make_event, make_stats
from sqlalchemy import update

from attnchecker_server.db import make_engine, make_session_factory, session_scope
from attnchecker_server.main import create_app
from attnchecker_server.metrics import METRIC_NAMES, DbCollector
from attnchecker_server.models import Run, utcnow


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def _scrape(client: TestClient, api: Api) -> dict[Any, float]:
    response = client.get("/metrics", headers=api.headers("viewer"))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return _samples(response.text)


def _ingest_known(api: Api) -> str:
    run_id = api.register("exp-42")["id"]
    agent = api.headers("agent")
    events = [make_event(step=i, op="scores", kind="inf") for i in range(3)] + [make_event(step=9, op="q", kind="nan")]
    assert (
        api.client.post(f"/api/v1/runs/{run_id}/events:batch", json=make_batch(events), headers=agent).status_code
        == 200
    )
    for stats in (
        make_stats(),
        make_stats(
            step_start=120,
            step_end=139,
            steps=20,
            step_seconds=1.75,
            check_seconds=0.375,
            ops=[{"op": "scores", "checks": 7, "check_seconds": 0.1, "period": 4}],
            faults=[{"op": "q", "kind": "nan", "detected": 1, "corrected": 1, "uncorrectable": 0}],
            residual_ratio={
                "le": [0.001, 0.01, 0.1, 0.5, 1.0, 10.0, 1000.0],
                "counts": [1, 0, 0, 0, 0, 0, 0, 1],
                "sum": 2000.5,
                "count": 2,
            },
            transport={"sent": 4, "spooled": 0, "dropped": 2},
            applied_policy_version=2,
        ),
    ):
        assert api.client.post(f"/api/v1/runs/{run_id}/stats", json=stats, headers=agent).status_code == 200
    api.client.patch(
        f"/api/v1/runs/{run_id}/policy", json={"period": 2, "overhead_budget": 0.1}, headers=api.headers("operator")
    )
    return run_id


def _assert_known_values(samples: dict[Any, float]) -> None:
    run = "exp-42"
    expected = {
        ("attnchecker_checks_total", (("op", "scores"), ("run", run))): 27,
        ("attnchecker_checks_total", (("op", "q"), ("run", run))): 10,
        ("attnchecker_faults_detected_total", (("kind", "inf"), ("op", "scores"), ("run", run))): 2,
        ("attnchecker_faults_corrected_total", (("kind", "inf"), ("op", "scores"), ("run", run))): 1,
        ("attnchecker_faults_uncorrectable_total", (("kind", "inf"), ("op", "scores"), ("run", run))): 1,
        ("attnchecker_faults_detected_total", (("kind", "nan"), ("op", "q"), ("run", run))): 1,
        ("attnchecker_faults_corrected_total", (("kind", "nan"), ("op", "q"), ("run", run))): 1,
        ("attnchecker_check_seconds_total", (("run", run),)): 0.5,
        ("attnchecker_step_seconds_total", (("run", run),)): 5.0,
        ("attnchecker_steps_total", (("run", run),)): 40,
        ("attnchecker_overhead_budget_ratio", (("run", run),)): 0.1,
        ("attnchecker_policy_requested_version", (("run", run),)): 2,
        ("attnchecker_policy_applied_version", (("run", run),)): 2,
        ("attnchecker_check_period_steps", (("op", "scores"), ("run", run))): 4,
        ("attnchecker_check_period_steps", (("op", "q"), ("run", run))): 2,
        ("attnchecker_run_live", (("run", run),)): 1,
        ("attnchecker_run_last_step", (("run", run),)): 139,
        ("attnchecker_agent_events_sent_total", (("run", run),)): 44,
        ("attnchecker_agent_events_spooled_total", (("run", run),)): 3,
        ("attnchecker_agent_events_dropped_total", (("run", run),)): 3,
        ("attnchecker_checksum_residual_ratio_bucket", (("le", "0.001"), ("run", run))): 6,
        ("attnchecker_checksum_residual_ratio_bucket", (("le", "0.01"), ("run", run))): 15,
        ("attnchecker_checksum_residual_ratio_bucket", (("le", "1000.0"), ("run", run))): 17,
        ("attnchecker_checksum_residual_ratio_bucket", (("le", "+Inf"), ("run", run))): 18,
        ("attnchecker_checksum_residual_ratio_count", (("run", run),)): 18,
        ("attnchecker_checksum_residual_ratio_sum", (("run", run),)): 2001.41,
    }
    for key, value in expected.items():
        assert key in samples, key
        assert abs(samples[key] - value) < 1e-9, (key, samples[key], value)
    last_seen = _value(samples, "attnchecker_run_last_seen_timestamp_seconds", run=run)
    assert last_seen is not None
    assert abs(last_seen - utcnow().timestamp()) < 120


def test_metrics_after_ingest_equal_expected_counts_and_survive_restart(api: Api) -> None:
    _ingest_known(api)
    samples = _scrape(api.client, api)
    _assert_known_values(samples)
    assert _value(samples, "attnchecker_ingest_events_total") == 4
    assert _value(samples, "attnchecker_ingest_requests_total", endpoint="events", status="200") == 1
    assert _value(samples, "attnchecker_ingest_request_duration_seconds_count", endpoint="stats") == 2
    # A fresh process on the same database: run metrics come from SQL, so nothing is lost.
    with TestClient(create_app(api.settings)) as restarted:
        after = _scrape(restarted, api)
    _assert_known_values(after)
    assert _value(after, "attnchecker_ingest_events_total") == 0


def test_metrics_names_types_and_labels_match_the_contract(api: Api) -> None:
    _ingest_known(api)
    response = api.client.get("/metrics", headers=api.headers("viewer"))
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    for name, (kind, labels) in METRIC_NAMES.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        assert base in families, name
        family = families[base]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(labels), (name, sample.labels)
    assert set(families) == {n.removesuffix("_total") if k == "counter" else n for n, (k, _) in METRIC_NAMES.items()}
    for family in families.values():
        for sample in family.samples:
            assert not {"step", "rank", "layer", "id", "event_id"} & set(sample.labels)


def test_metrics_cover_live_and_recent_runs_only(make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(metrics_recent_seconds=600, metrics_cache_seconds=0)):
        live, recent, old = (api.register(name)["id"] for name in ("live", "recent", "old"))
        for run_id in (recent, old):
            api.client.post(f"/api/v1/runs/{run_id}/finish", json={}, headers=api.headers("agent"))
        engine = make_engine(api.settings, pooled=False)
        with session_scope(make_session_factory(engine)) as session:
            session.execute(update(Run).where(Run.id == old).values(last_seen_at=utcnow() - timedelta(hours=2)))
        engine.dispose()
        samples = _scrape(api.client, api)
        assert _value(samples, "attnchecker_run_live", run="live") == 1
        assert _value(samples, "attnchecker_run_live", run="recent") == 0
        assert _value(samples, "attnchecker_run_live", run="old") is None
        assert live


def test_db_collector_caches_and_refreshes_once(api: Api) -> None:
    api.register()
    now = [1000.0]
    reads = []
    collector = DbCollector(
        make_session_factory(make_engine(api.settings)),
        recent_seconds=3600,
        cache_seconds=2,
        max_runs=10,
        clock=lambda: now[0],
    )
    original = collector._read

    def counting_read() -> Any:
        reads.append(1)
        return original()

    collector._read = counting_read  # type: ignore[method-assign]
    assert list(collector.describe()) == []
    threads = [threading.Thread(target=collector.collect) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(reads) == 1
    now[0] += 1.0
    collector.collect()
    assert len(reads) == 1
    now[0] += 1.5
    collector.collect()
    assert len(reads) == 2


def test_metrics_is_a_plain_route_not_a_redirect(api: Api) -> None:
    response = api.client.get("/metrics", headers=api.headers("viewer"), follow_redirects=False)
    assert response.status_code == 200


def test_metrics_pass_promtool_check_metrics(api: Api) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; `make system-deps`)")
    _ingest_known(api)
    api.client.post("/api/v1/runs/nope/stats", json=make_stats(), headers=api.headers("agent"))  # a 404 series too
    text = api.client.get("/metrics", headers=api.headers("viewer")).text
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_coverage_gauge_from_the_registered_coverage_map(api: Api) -> None:
    coverage = {"protected": 8, "unprotected": 4, "layers": ["0-1 k,v:hook scores,context:transformers"],
                "gaps": ["layers 0-1 q,out: peft LoRA variant Dora (m.layers.0.self_attn, …)"]}
    api.register("lora-run", config={"layers": 2, "coverage": coverage})
    # Free-form config: counts that are not non-negative integers give no sample (and no failed scrape).
    api.register("odd-run", config={"coverage": {"protected": "8", "unprotected": -1}})
    api.register("bool-run", config={"coverage": {"protected": True, "unprotected": [1]}})
    api.register("no-map-run", config={"coverage": "full"})
    samples = _scrape(api.client, api)
    assert _value(samples, "attnchecker_coverage_ops", run="lora-run", state="protected") == 8
    assert _value(samples, "attnchecker_coverage_ops", run="lora-run", state="unprotected") == 4
    assert not [key for key in samples if key[0] == "attnchecker_coverage_ops" and ("run", "lora-run") not in key[1]]


def _set_last_seen(api: Api, ages: dict[str, timedelta]) -> None:
    engine = make_engine(api.settings, pooled=False)
    with session_scope(make_session_factory(engine)) as session:
        for run_id, age in ages.items():
            session.execute(update(Run).where(Run.id == run_id).values(last_seen_at=utcnow() - age))
    engine.dispose()


def test_metrics_cap_never_drops_a_live_run_and_counts_what_it_left_out(make_test_settings: Any) -> None:
    for api in make_api(make_test_settings(metrics_max_runs=3, metrics_cache_seconds=0)):
        # A live run whose agent went quiet an hour ago, then many newer runs: it used to be the first to go.
        quiet = api.register("quiet")["id"]
        finished = {name: api.register(name)["id"] for name in ("f1", "f2", "f3", "f4")}
        for run_id in finished.values():
            api.client.post(f"/api/v1/runs/{run_id}/finish", json={}, headers=api.headers("agent"))
        api.register("busy")
        ages = {run_id: timedelta(minutes=i) for i, run_id in enumerate(finished.values())}
        _set_last_seen(api, {quiet: timedelta(hours=1), **ages})
        samples = _scrape(api.client, api)
        state = {name: _value(samples, "attnchecker_run_live", run=name) for name in ("quiet", "busy", *finished)}
        live = {name for name, value in state.items() if value == 1}
        exported = {name for name, value in state.items() if value is not None}
        assert live == {"quiet", "busy"}
        assert exported == {"quiet", "busy", "f1"}  # the cap of 3 leaves room for the most recent finished run
        assert _value(samples, "attnchecker_metrics_runs_omitted") == 3
        # More live runs than the cap: all of them, no finished ones, all four finished counted as left out.
        for name in ("l1", "l2", "l3"):
            api.register(name)
        samples = _scrape(api.client, api)
        for name in ("quiet", "busy", "l1", "l2", "l3"):
            assert _value(samples, "attnchecker_run_live", run=name) == 1, name
        assert all(_value(samples, "attnchecker_run_live", run=name) is None for name in finished)
        assert _value(samples, "attnchecker_metrics_runs_omitted") == 4



def test_metrics_omitted_is_zero_under_the_cap(api: Api) -> None:
    api.register("only")
    assert _value(_scrape(api.client, api), "attnchecker_metrics_runs_omitted") == 0
