"""Issue 14 item 7, against the loopback collector (a real HTTP server on loopback, test_transport_collector.py): a
503 with Retry-After is retried, never dropped; the agent comes back through a /readyz probe long before its backoff
would have let it; a new transport uploads what earlier transports left in the spool directory, never twice and never
while a live transport owns the files."""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from attnchecker.transport import Transport, replay_spool
from attnchecker.transport.client import CollectorClient
from attnchecker.transport.spool import (
    SpoolWriter,
    _lock_now,
    claim,
    list_files,
    read_records,
    rewrite,
)

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transport_collector import TOKEN, LoopbackCollector, collector, dead_url, event, stats  # noqa: F401

pytestmark = pytest.mark.timeout(90)

RUN_INFO = {"model": "TinyGPT", "world_size": 1, "rank": 0}
FAST = {"flush_interval_s": 0.05, "max_backoff_s": 0.2, "probe_interval_s": 0.1, "poll_interval_s": 0.1,
        "read_timeout_s": 0.5, "connect_timeout_s": 0.5}


@pytest.fixture
def make_transport(tmp_path):
    made = []

    def make(url, name="exp-1", **kw):
        kw = {"spool_dir": tmp_path / "spool", "run_info": RUN_INFO, **FAST, **kw}
        t = Transport(url, TOKEN, name, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(deadline_s=2.0)



def offline_run(make_transport, name: str, n: int, **kw) -> list[dict]:
    """A run that never reaches its collector: everything, finish included, stays in the spool."""
    t = make_transport(dead_url(), name, **kw).start()
    sent = [event(step=s) for s in range(n)]
    for e in sent:
        t.emit_event(e)
    t.emit_stats(stats(0, n - 1))
    t.close(deadline_s=2.0)
    assert t.spooled == n
    return sent


def api_requests(c: LoopbackCollector) -> list[tuple[str, int | None]]:
    return [(path, status) for _m, path, status, _h in c.requests if path.startswith("/api/")]


# --- 503 and Retry-After -------------------------------------------------------------------------------------------


def test_client_reads_a_503_with_retry_after_as_retryable(collector):
    collector.mode, collector.retry_after = "fail503", "7"
    client = CollectorClient(collector.url, TOKEN)
    try:
        r = client.register(b'{"name":"x"}')
        assert (r.status, r.transient, r.retry_after_s) == (503, True, 7.0)
        collector.retry_after = "Wed, 21 Oct 2026 07:28:00 GMT"  # the date form: ignored, the backoff decides
        assert client.register(b'{"name":"x"}').retry_after_s is None
    finally:
        client.close()


def test_transport_spools_through_503_and_delivers_everything_once(collector, make_transport):
    t = make_transport(collector.url, batch_size=10).start()
    first = [event(step=0) for _ in range(10)]
    for e in first:
        t.emit_event(e)
    assert t.flush(5)
    collector.mode, collector.retry_after = "fail503", "1"
    during = [event(step=1) for _ in range(25)]
    for e in during:
        t.emit_event(e)
    t.emit_stats(stats(0, 1))
    assert t.flush(5)
    assert t.spooled == 25 and t.dropped == 0
    collector.mode = "ok"
    want = {e["id"] for e in first + during}
    assert collector.wait_for(lambda c: set(c.events) == want and c.stats, 10.0)
    assert collector.duplicates == 0 and t.dropped == 0


def test_retry_after_holds_the_agent_back_until_it_has_passed(collector, make_transport):
    # The collector asks for 60 s: neither the API retry nor the probe may come sooner, whatever the backoff says
    # (up to max_backoff_s, the user's bound on any wait).
    t = make_transport(collector.url, max_backoff_s=600.0).start()
    assert collector.wait_for(lambda c: c.runs, 5.0)
    collector.mode, collector.retry_after = "fail503", "60"
    t.emit_event(event())
    assert collector.wait_for(lambda c: any(s == 503 for _p, s in api_requests(c)), 5.0)
    n = len(collector.requests)
    assert not collector.wait_for(lambda c: len(c.requests) > n, 1.5)  # FAST would have retried ~7 times
    assert t.dropped == 0 and t.spooled == 1


# --- reconnecting --------------------------------------------------------------------------------------------------


def test_agent_returns_through_a_readyz_probe_not_after_its_backoff(collector, make_transport):
    t = make_transport(collector.url, max_backoff_s=600.0, probe_interval_s=0.2).start()
    assert collector.wait_for(lambda c: c.runs, 5.0)
    collector.mode = "fail503"
    t.emit_event(event())
    # Five failed API attempts: the sixth is 4-8 s away (0.5 s doubling, equal jitter). Meanwhile only probes.
    assert collector.wait_for(lambda c: sum(s == 503 for _p, s in api_requests(c)) >= 5, 30.0)
    probes_during = sum(p == "/readyz" for _m, p, _s, _h in collector.requests)
    n = len(collector.requests)
    e = event()
    t.emit_event(e)
    collector.mode = "ok"
    assert collector.wait_for(lambda c: e["id"] in c.events, 3.0)
    after = [p for _m, p, _s, _h in collector.requests[n:]]
    assert after[0] == "/readyz"  # the probe, not the backoff, brought it back
    assert probes_during >= 5
    assert t.dropped == 0 and collector.duplicates == 0


# --- what earlier transports left ----------------------------------------------------------------------------------


def test_a_new_transport_uploads_what_earlier_ones_left_and_finishes_their_runs(collector, make_transport, tmp_path):
    left = offline_run(make_transport, "earlier", 30, batch_size=7)
    left += offline_run(make_transport, "earlier", 5)  # the same run restarted, still offline
    assert len(list_files(tmp_path / "spool")) == 2
    t = make_transport(collector.url, "next").start()
    own = event()
    t.emit_event(own)
    want = {e["id"] for e in left} | {own["id"]}
    assert collector.wait_for(lambda c: set(c.events) == want and len(c.finishes) == 2, 10.0)
    assert collector.finishes == [{"rank": 0, "last_step": 29}, {"rank": 0, "last_step": 4}]
    assert len(collector.stats) == 2 and collector.duplicates == 0
    t.close(deadline_s=5.0)
    assert list_files(tmp_path / "spool") == []
    assert (t.sent, t.leftover_events) == (1, 35)
    assert {r["name"] for r in collector.registrations} == {"earlier", "next"}
    assert not list((tmp_path / "spool").glob(".*.owner"))  # no lock files left behind


def test_leftovers_can_be_left_to_sync(collector, make_transport, tmp_path):
    offline_run(make_transport, "earlier", 3)
    t = make_transport(collector.url, "next", replay_leftovers=False).start()
    t.emit_event(event())
    assert t.flush(5) and collector.wait_for(lambda c: len(c.events) == 1, 5.0)
    assert len(list_files(tmp_path / "spool")) == 1 and [r["name"] for r in collector.registrations] == ["next"]


def test_files_of_a_live_transport_are_left_to_it(collector, make_transport, tmp_path):
    spool = tmp_path / "spool"
    live = SpoolWriter(spool, b'{"name":"live","rank":0,"world_size":1}')
    live.append("events", json.dumps({"batch_id": "b1", "events": [event()]}).encode())
    live.rotate()  # a complete file, but its writer is alive: it replays it itself
    t = make_transport(collector.url, "next").start()
    t.emit_event(event())
    assert t.flush(5) and collector.wait_for(lambda c: len(c.events) == 1, 5.0)
    assert len(list_files(spool)) == 1 and replay_spool(spool, collector.url, TOKEN).skipped == 1
    assert [r["name"] for r in collector.registrations] == ["next"]
    live.close()  # the owner is gone: anyone may upload its files now
    assert replay_spool(spool, collector.url, TOKEN).files == 1
    assert len(collector.events) == 2 and list_files(spool) == []


def test_transports_started_together_upload_each_leftover_once(collector, make_transport, tmp_path):
    left = []
    for i in range(6):
        left += offline_run(make_transport, f"earlier-{i}", 40, batch_size=5)
    ts = [make_transport(collector.url, f"next-{i}") for i in range(3)]
    go = threading.Barrier(len(ts))

    def start(t: Transport) -> None:
        go.wait()
        t.start()

    threads = [threading.Thread(target=start, args=(t,)) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    want = {e["id"] for e in left}
    assert collector.wait_for(lambda c: set(c.events) == want and len(c.finishes) == 6, 20.0)
    for t in ts:
        t.close(deadline_s=5.0)
    assert collector.duplicates == 0  # no batch or event was posted twice
    assert sum(t.leftover_events for t in ts) == len(left)
    assert list_files(tmp_path / "spool") == []


def test_a_claim_never_takes_a_stale_copy_of_a_rewritten_file(tmp_path):
    # An uploader opened the file, then another one (holding the lock) uploaded part of it and rewrote the rest: the
    # first must not upload its stale copy (records sent twice) nor delete the rewritten file (records lost).
    path = tmp_path / "00000000000000000001-abcdef012345-00001.jsonl"
    path.write_bytes(b'{"v":1,"kind":"run","n":0,"body":{"name":"r"}}\n{"v":1,"kind":"stats","n":0,"body":{}}\n')
    with open(path, "rb") as stale:
        rewrite(path, read_records(path)[:1])
        assert not _lock_now(stale, path)
    with claim(path) as mine:
        assert mine
    path.unlink()
    with claim(path) as mine:
        assert not mine
