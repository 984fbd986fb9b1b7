"""The transport against the real collector (uvicorn subprocess on SQLite, from tests/collector_testing.py):
every event exactly once across a collector kill and restart, sync of an offline spool, policy changes over REST,
and a bad event that costs only itself."""
from __future__ import annotations

import socket
import time
import uuid
from types import SimpleNamespace

import httpx
import pytest

from attnchecker.cli.sync import sync_main
from attnchecker.transport import Transport

testing = pytest.importorskip("collector_testing")

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

RUN_INFO = {"model": "TinyGPT", "world_size": 1, "rank": 0, "config": {"lr": 0.001}}


def event(step: int, **extra) -> dict:
    return {"id": str(uuid.uuid4()), "ts": "2026-11-29T15:32:40.123Z", "step": step, "rank": 0, "layer": 1,
            "op": "scores", "pattern": "0d", "kind": "inf", "action": "corrected",
            "location": {"batch": 0, "head": 2, "row": 5, "col": 3}, "value": "inf", "residual": None,
            "bound": 0.0012, "policy_version": 1, **extra}


def stats(step_start: int, step_end: int, faults: int) -> dict:
    return {"rank": 0, "step_start": step_start, "step_end": step_end, "steps": step_end - step_start + 1,
            "applied_policy_version": 1, "step_seconds": 0.2, "check_seconds": 0.01,
            "ops": [{"op": "scores", "checks": 2, "check_seconds": 0.01, "period": 1}],
            "faults": [{"op": "scores", "kind": "inf", "detected": faults, "corrected": faults, "uncorrectable": 0}]}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("collector")
    settings = testing.make_settings("sqlite", d)
    testing.migrate(settings)
    ns = SimpleNamespace(settings=settings, agent=testing.make_token(settings, "agent"),
                         operator=testing.make_token(settings, "operator"), dir=d)
    ns.collector = testing.start_collector(settings, migrate_first=False)
    yield ns
    ns.collector.stop()


def transport(env, name, tmp_path, url=None, **kw) -> Transport:
    kw = {"flush_interval_s": 0.05, "max_backoff_s": 0.3, "poll_interval_s": 0.1, "read_timeout_s": 2.0, **kw}
    return Transport(url or env.collector.url, env.agent, name, spool_dir=tmp_path / "spool", run_info=RUN_INFO,
                     **kw).start()


def api(env, method, path, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {env.operator}", **kw.pop("headers", {})}
    return httpx.request(method, env.collector.url + "/api/v1" + path, headers=headers, timeout=10, **kw)


def stored_event_ids(env, run_id) -> list[str]:
    ids, cursor = [], None
    while True:
        params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = api(env, "GET", f"/runs/{run_id}/events", params=params).json()
        ids += [e["id"] for e in page["data"]]
        cursor = page.get("next_cursor")
        if not cursor:
            return ids


def dead_url() -> str:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def wait_until(predicate, timeout_s=15.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_real_collector_stores_every_event_once_and_finishes_the_run(env, tmp_path):
    t = transport(env, "real-basic", tmp_path, batch_size=500)
    sent = [event(step=s // 100) for s in range(1200)]
    for e in sent:
        t.emit_event(e)
    t.emit_stats(stats(0, 11, 1200))
    t.close(deadline_s=10.0)
    assert t.sent == 1200 and t.dropped == 0 and t.spooled == 0
    ids = stored_event_ids(env, t.run_id)
    assert len(ids) == len(set(ids)) == 1200 and set(ids) == {e["id"] for e in sent}
    run = api(env, "GET", f"/runs/{t.run_id}").json()
    assert run["status"] == "finished" and run["last_step"] == 11


def test_real_collector_killed_mid_run_loses_and_duplicates_nothing(env, tmp_path):
    settings = testing.make_settings("sqlite", tmp_path / "db")
    (tmp_path / "db").mkdir()
    testing.migrate(settings)
    token = testing.make_token(settings, "agent")
    c = testing.start_collector(settings, migrate_first=False)
    try:
        t = Transport(c.url, token, "killed", spool_dir=tmp_path / "spool", run_info=RUN_INFO, flush_interval_s=0.05,
                      max_backoff_s=0.3, poll_interval_s=0.1)
        t.start()
        sent, step_s = [], []
        for step in range(30):
            if step == 10:
                c.process.kill()  # SIGKILL: no graceful shutdown
                c.process.wait()
            if step == 20:
                c = testing.start_collector(settings, port=c.port, migrate_first=False)
            t0 = time.perf_counter()
            for _ in range(20):
                e = event(step)
                sent.append(e)
                t.emit_event(e)
            t.emit_stats(stats(step, step, 20))
            step_s.append(time.perf_counter() - t0)
            time.sleep(0.05)  # the "training step"
        # No step waited for the outage: a step that did would take at least a connect timeout (1 s); the bound is
        # a generous factor of the median, floored well below that, because this machine is shared.
        median = sorted(step_s)[len(step_s) // 2]
        assert max(step_s) < max(50 * median, 0.25)
        assert t.spooled > 0
        ns = SimpleNamespace(collector=c, operator=testing.make_token(settings, "operator"))
        want = {e["id"] for e in sent}
        assert wait_until(lambda: len(stored_event_ids(ns, t.run_id)) >= len(want))
        t.close(deadline_s=10.0)
        ids = stored_event_ids(ns, t.run_id)
        assert len(ids) == len(set(ids)) and set(ids) == want  # 0 lost, 0 duplicated
        assert t.dropped == 0
    finally:
        c.stop()


def test_real_collector_sync_uploads_an_offline_spool_exactly_once(env, tmp_path, capsys):
    t = Transport(dead_url(), env.agent, "real-offline", spool_dir=tmp_path / "spool", run_info=RUN_INFO,
                  connect_timeout_s=0.2, flush_interval_s=0.05).start()
    sent = [event(step=s) for s in range(25)]
    for e in sent:
        t.emit_event(e)
    t.emit_stats(stats(0, 24, 25))
    t.close(deadline_s=3.0)
    assert t.spooled == 25
    argv = [str(tmp_path / "spool"), "--collector", env.collector.url, "--token", env.agent]
    assert sync_main(argv) == 0
    capsys.readouterr()
    runs = api(env, "GET", "/runs", params={"limit": 200}).json()["data"]
    (run,) = [r for r in runs if r["name"] == "real-offline"]
    assert run["status"] == "finished" and run["last_step"] == 24 and run["model"] == "TinyGPT"
    assert sorted(stored_event_ids(env, run["id"])) == sorted(e["id"] for e in sent)
    assert sync_main(argv) == 0  # nothing left: uploads nothing
    assert '"requests": 0' in capsys.readouterr().out
    assert len(stored_event_ids(env, run["id"])) == 25


def test_real_collector_policy_change_reaches_latest_policy(env, tmp_path):
    t = transport(env, "real-policy", tmp_path)
    try:
        assert wait_until(lambda: t.latest_policy() is not None)
        v = t.latest_policy().version
        r = api(env, "PATCH", f"/runs/{t.run_id}/policy", json={"period": 4, "op_periods": {"scores": 2}},
                headers={"If-Match": f'"{v}"'})
        assert r.status_code == 200, r.text
        assert wait_until(lambda: t.latest_policy().version == r.json()["version"], 5.0)
        p = t.latest_policy()
        assert (p.period, dict(p.op_periods)) == (4, {"scores": 2})
    finally:
        t.close(deadline_s=5.0)


def test_real_collector_invalid_event_costs_only_itself(env, tmp_path):
    t = transport(env, "real-invalid", tmp_path, batch_size=10)
    good = [event(step=1) for _ in range(9)]
    for e in good[:4]:
        t.emit_event(e)
    t.emit_event(event(step=1, op="attention"))  # not in the op vocabulary: a 422 for its batch
    for e in good[4:]:
        t.emit_event(e)
    assert t.flush(10)
    assert sorted(stored_event_ids(env, t.run_id)) == sorted(e["id"] for e in good)
    assert t.dropped == 1 and t.sent == 9
    t.close(deadline_s=5.0)
