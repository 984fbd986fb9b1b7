"""The transport against a real HTTP collector on loopback: batching, never blocking, dropping, spooling, replay
exactly once, close within its deadline, policy polling with ETag."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnchecker.cli.sync import sync_main
from attnchecker.policy import Policy
from attnchecker.transport import Transport, replay_spool
from attnchecker.transport.spool import SpoolWriter, list_files, read_records

# The loopback collector lives next to this file; make it importable under either pytest import mode.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_transport_collector import (  # noqa: F401 (collector is a fixture)
    TOKEN,
    LoopbackCollector,
    collector,
    dead_url,
    event,
    stats,
)

pytestmark = pytest.mark.timeout(60)

RUN_INFO = {"model": "TinyGPT", "world_size": 1, "rank": 0, "config": {"lr": 1e-3}}


@pytest.fixture
def make_transport(tmp_path):
    made = []

    def make(url, **kw):
        kw.setdefault("spool_dir", tmp_path / "spool")
        kw.setdefault("run_info", RUN_INFO)
        kw.setdefault("flush_interval_s", 0.05)
        kw.setdefault("max_backoff_s", 0.2)
        kw.setdefault("poll_interval_s", 0.1)
        kw.setdefault("read_timeout_s", 0.5)
        kw.setdefault("connect_timeout_s", 0.5)
        t = Transport(url, TOKEN, kw.pop("run_name", "exp-1"), **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(deadline_s=2.0)



def test_transport_sends_batches_stats_and_finish(collector, make_transport):
    t = make_transport(collector.url, batch_size=100).start()
    sent = [event(step=s) for s in range(250)]
    for e in sent:
        t.emit_event(e)
    t.emit_stats(stats(0, 9))
    assert t.flush(10)
    assert collector.event_ids() == {e["id"] for e in sent}
    assert len(collector.batches) >= 3  # 100 per batch at most
    assert t.sent == 250 and t.spooled == 0 and t.dropped == 0
    t.close(deadline_s=3.0)
    assert collector.registrations[0]["name"] == "exp-1" and collector.registrations[0]["model"] == "TinyGPT"
    (st,) = collector.stats.values()
    assert st["transport"] == {"sent": 0, "spooled": 0, "dropped": 0}  # deltas before anything was sent
    assert collector.finishes == [{"rank": 0, "last_step": 249}]
    assert list_files(t.spool_dir) == []


def test_transport_batches_by_time(collector, make_transport):
    t = make_transport(collector.url, batch_size=500, flush_interval_s=0.1).start()
    t.emit_event(event())
    assert collector.wait_for(lambda c: len(c.events) == 1, 5.0)  # one event, no flush(): the timer sent it


def test_transport_accepts_objects_with_to_wire(collector, make_transport):
    class Record:
        def __init__(self):
            self.wire = event(step=7)

        def to_wire(self):
            return self.wire

    t = make_transport(collector.url).start()
    r = Record()
    t.emit_event(r)
    assert t.flush(5)
    assert collector.event_ids() == {r.wire["id"]}


def test_transport_drops_unencodable_event_alone(collector, make_transport):
    t = make_transport(collector.url).start()
    good = event()
    t.emit_event(event(residual=float("nan")))
    t.emit_event(good)
    assert t.flush(5)
    assert collector.event_ids() == {good["id"]} and t.dropped == 1


def _emit_timed(t: Transport, n: int) -> list[float]:
    times = []
    for i in range(n):
        e = event(step=i)
        t0 = time.perf_counter()
        t.emit_event(e)
        times.append(time.perf_counter() - t0)
    return times


@pytest.mark.parametrize("outage", ["refused", "hang", "fail503"])
def test_transport_emit_never_waits_for_the_network(collector, make_transport, outage):
    healthy = make_transport(collector.url, run_name="healthy").start()
    baseline = _emit_timed(healthy, 3000)
    healthy.flush(5)
    if outage == "refused":
        url = dead_url()
    else:
        collector.mode = outage
        url = collector.url
    t = make_transport(url, run_name=outage, batch_size=50).start()
    times = _emit_timed(t, 3000)
    # An emit that waited on the network would take about a timeout (0.5 s here); a GIL hand-off to the sender is
    # far less. Relative bounds only: this machine is shared.
    assert max(times) < t.read_timeout_s / 2
    assert statistics.median(times) < 10 * statistics.median(baseline) + 20e-6


def test_transport_queue_full_drops_and_counts(collector, make_transport):
    collector.mode = "hang"
    t = make_transport(collector.url, queue_max=100, batch_size=10).start()
    assert collector.wait_for(lambda c: len(c.requests) >= 1, 5.0)  # the sender is stuck in registration
    for i in range(1000):
        t.emit_event(event(step=i))
    assert t.dropped >= 1000 - 100 - 10
    t.close(deadline_s=2.0)
    # Nothing disappears unaccounted: every emitted event was sent, spooled or counted as dropped.
    assert t.sent + t.spooled + t.dropped == 1000
    assert t.take_deltas()["dropped"] == t.dropped


def _spooled_event_ids(spool_dir: Path) -> list[str]:
    ids = []
    for p in list_files(spool_dir):
        for rec in read_records(p):
            if rec["kind"] == "events":
                ids += [e["id"] for e in rec["body"]["events"]]
    return ids


def test_transport_spools_while_down_and_replays_exactly_once(collector, make_transport):
    t = make_transport(collector.url, batch_size=20).start()
    first = [event(step=0) for _ in range(30)]
    for e in first:
        t.emit_event(e)
    assert t.flush(5)
    collector.stop()
    during = [event(step=1) for _ in range(50)]
    for e in during:
        t.emit_event(e)
    assert t.flush(5)
    assert t.spooled == 50
    assert sorted(_spooled_event_ids(t.spool_dir)) == sorted(e["id"] for e in during)
    t.emit_stats(stats(0, 1))
    collector.start()  # same port
    want = {e["id"] for e in first + during}
    assert collector.wait_for(lambda c: set(c.events) == want and c.stats, 10.0)
    assert t.flush(5)
    assert collector.duplicates == 0
    assert list_files(t.spool_dir) == []  # deleted only after the 2xx
    assert t.sent == 80


def test_transport_retry_of_a_stored_batch_does_not_duplicate(collector, make_transport):
    collector.mode = "store_then_hang_once"  # the collector stores the first batch, the answer never comes
    t = make_transport(collector.url, batch_size=10).start()
    sent = [event(step=s) for s in range(10)]
    for e in sent:
        t.emit_event(e)
    assert collector.wait_for(lambda c: c.mode == "ok" and len(c.events) == 10, 10.0)
    assert collector.wait_for(lambda c: c.duplicates == 10, 10.0)  # the replay, same batch id
    assert collector.event_ids() == {e["id"] for e in sent}
    assert t.flush(5) and list_files(t.spool_dir) == []


def test_transport_close_returns_within_deadline_while_server_hangs(collector, make_transport):
    collector.mode = "hang"
    t = make_transport(collector.url, read_timeout_s=2.0, connect_timeout_s=1.0).start()
    assert collector.wait_for(lambda c: len(c.requests) >= 1, 5.0)
    sent = [event(step=s) for s in range(40)]
    for e in sent:
        t.emit_event(e)
    t0 = time.monotonic()
    t.close(deadline_s=1.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 0.25  # the deadline, with scheduling slack on a shared machine
    assert sorted(_spooled_event_ids(t.spool_dir)) == sorted(e["id"] for e in sent)
    kinds = [rec["kind"] for p in list_files(t.spool_dir) for rec in read_records(p)]
    assert kinds[0] == "run" and kinds[-1] == "finish"


def test_transport_close_is_quick_when_collector_known_down(make_transport):
    t = make_transport(dead_url()).start()
    t.emit_event(event())
    time.sleep(0.2)  # let the sender find the collector down
    t0 = time.monotonic()
    t.close(deadline_s=5.0)
    assert time.monotonic() - t0 < 2.5  # spooled without spending the deadline on retries
    assert t.spooled == 1


def test_transport_close_never_started_spools(make_transport):
    t = make_transport(None)
    t.emit_event(event())
    t.close(deadline_s=1.0)
    assert t.spooled == 1


def test_transport_emit_after_close_is_dropped(make_transport):
    t = make_transport(None).start()
    t.close(deadline_s=1.0)
    t.emit_event(event())
    assert t.dropped == 1


def test_transport_offline_run_then_sync_uploads_exactly_once(collector, make_transport, tmp_path, capsys):
    spool = tmp_path / "offline-spool"
    t = make_transport(dead_url(), spool_dir=spool, batch_size=7).start()
    sent = [event(step=s) for s in range(30)]
    for i, e in enumerate(sent):
        t.emit_event(e)
        if i % 10 == 9:
            t.emit_stats(stats(i - 9, i))
    t.close(deadline_s=2.0)
    assert t.spooled == 30 and t.sent == 0
    assert sorted(_spooled_event_ids(spool)) == sorted(e["id"] for e in sent)

    argv = [str(spool), "--collector", collector.url, "--token", TOKEN]
    assert sync_main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["events"] == 30 and first["duplicates"] == 0 and first["remaining"] == []
    assert collector.event_ids() == {e["id"] for e in sent}
    assert len(collector.stats) == 3
    assert collector.finishes == [{"rank": 0, "last_step": 29}]
    assert collector.registrations[0] == {**RUN_INFO, "name": "exp-1", "host": collector.registrations[0]["host"],
                                          "agent_version": collector.registrations[0]["agent_version"]}
    n_requests = len(collector.requests)
    assert sync_main(argv) == 0  # again: nothing left, nothing sent
    assert json.loads(capsys.readouterr().out)["requests"] == 0
    assert len(collector.requests) == n_requests and len(collector.events) == 30


def test_replay_spool_keeps_files_when_collector_down(make_transport, tmp_path):
    t = make_transport(None, spool_dir=tmp_path / "s")
    t.emit_event(event())
    t.close(deadline_s=1.0)
    summary = replay_spool(tmp_path / "s", dead_url(), TOKEN)
    assert summary.files == 0 and len(summary.remaining) == 1
    assert len(_spooled_event_ids(tmp_path / "s")) == 1


def test_replay_spool_skips_a_file_a_live_writer_holds(collector, tmp_path):
    w = SpoolWriter(tmp_path, b'{"name":"live"}')
    w.append("events", b'{"batch_id":"b","events":[]}')
    summary = replay_spool(tmp_path, collector.url, TOKEN)
    assert summary.skipped == 1 and collector.requests == []
    w.close()
    assert replay_spool(tmp_path, collector.url, TOKEN).files == 1


def test_replay_spool_skips_a_torn_last_line(collector, make_transport, tmp_path):
    t = make_transport(None, spool_dir=tmp_path / "s")
    e = event()
    t.emit_event(e)
    t.close(deadline_s=1.0)
    (path,) = list_files(tmp_path / "s")
    with open(path, "ab") as f:
        f.write(b'{"v":1,"kind":"events","n":3,"body":{"batch_')  # the process died mid-write
    summary = replay_spool(tmp_path / "s", collector.url, TOKEN)
    assert summary.files == 1 and collector.event_ids() == {e["id"]}


def test_transport_splits_a_batch_the_collector_finds_too_large(make_transport):
    c = LoopbackCollector(max_events_per_batch=30).start()
    try:
        t = make_transport(c.url, batch_size=100).start()
        sent = [event() for _ in range(100)]
        for e in sent:
            t.emit_event(e)
        assert t.flush(10)
        assert c.event_ids() == {e["id"] for e in sent} and t.dropped == 0
    finally:
        c.close()


def test_transport_policy_poll_uses_etag_and_updates_latest_policy(collector, make_transport):
    t = make_transport(collector.url, poll_interval_s=0.05).start()
    assert collector.wait_for(lambda c: c.runs, 5.0)
    deadline = time.monotonic() + 5
    while t.latest_policy() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    first = t.latest_policy()
    assert isinstance(first, Policy) and first.version == 1
    assert collector.wait_for(
        lambda c: any(s == 304 and h.get("if-none-match") == '"1"' for _, p, s, h in c.requests if "policy" in p))
    assert t.latest_policy() is first  # a 304 keeps the same object
    collector.set_policy(period=4, op_periods={"scores": 2})
    deadline = time.monotonic() + 5
    while t.latest_policy().version != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    new = t.latest_policy()
    assert (new.version, new.period, dict(new.op_periods)) == (2, 4, {"scores": 2})


def test_transport_ignores_a_policy_it_cannot_use(collector, make_transport, caplog):
    t = make_transport(collector.url, poll_interval_s=0.05).start()
    assert collector.wait_for(lambda c: c.runs, 5.0)
    assert t.flush(5) and t.latest_policy().version == 1
    collector.set_policy(period=0)
    assert collector.wait_for(lambda c: any(s == 200 and "policy" in p for _, p, s, _h in c.requests[-3:]), 5.0)
    assert t.flush(5) and t.latest_policy().version == 1  # the bad version 2 never reaches the training thread


def test_transport_registration_retried_until_collector_up(make_transport):
    c = LoopbackCollector()
    c.mode = "fail503"
    c.start()
    try:
        t = make_transport(c.url).start()
        assert c.wait_for(lambda c: len(c.requests) >= 2, 5.0)  # retried with backoff
        assert t.run_id is None
        c.mode = "ok"
        assert c.wait_for(lambda c: c.runs, 5.0)
        e = event()
        t.emit_event(e)
        assert t.flush(5) and c.event_ids() == {e["id"]}
    finally:
        c.close()


def test_transport_stats_carry_counter_deltas(collector, make_transport):
    t = make_transport(collector.url).start()
    for _ in range(5):
        t.emit_event(event())
    assert t.flush(5)
    t.emit_stats(stats(0, 4))
    t.emit_stats(stats(5, 9))
    assert t.flush(5)
    got = sorted(collector.stats.values(), key=lambda s: s["step_start"])
    assert [s["transport"]["sent"] for s in got] == [5, 0]


def test_transport_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="transport.batch_size"):
        Transport(None, None, "r", spool_dir=tmp_path, batch_size=0)
    with pytest.raises(ValueError, match="transport.run_info"):
        Transport(None, None, "r", spool_dir=tmp_path, run_info={"config": {"x": float("inf")}})


# Load the module without running attnchecker/__init__.py (which imports the torch-based guard): what is checked is
# what this module itself pulls in.
_ISOLATED_IMPORT = """
import importlib.util, sys, types
spec = importlib.util.find_spec("attnchecker")
pkg = types.ModuleType("attnchecker")
pkg.__path__ = list(spec.submodule_search_locations)
sys.modules["attnchecker"] = pkg
import {module}
sys.exit("torch" in sys.modules)
"""


@pytest.mark.parametrize("module", ["attnchecker.transport", "attnchecker.policy"])
def test_module_does_not_import_torch(module):
    # The sender thread parses policies; neither may drag torch into a process that only ships events.
    code = _ISOLATED_IMPORT.format(module=module)
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_a_collector_from_before_device_identities_still_gets_the_run(collector, make_transport, caplog):
    """Agents may be upgraded before their collector: a 422 for the unknown `device` field costs the attribution, not
    the telemetry."""
    collector.knows_devices = False
    info = {**RUN_INFO, "device": {"uuid": "GPU-1", "hostname": "n1", "kind": "cuda"}}
    t = make_transport(collector.url, run_info=info).start()
    t.emit_event(event())
    with caplog.at_level("WARNING"):
        assert t.flush(10)
    assert [("device" in r) for r in collector.registrations] == [True, False]
    assert len(collector.event_ids()) == 1 and t.spooled == 0
    assert "predates device identities" in caplog.text
