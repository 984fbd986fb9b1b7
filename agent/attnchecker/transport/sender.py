"""The agent's connection to the collector: the sender thread behind a :class:`Transport`. The training thread drops
records into its outbox (outbox.py); one daemon thread batches, sends, spools, replays, probes and polls the policy
(docs/transport.md).

Nothing here blocks or raises into the training thread: ``emit_event``/``emit_stats`` are a ``put_nowait`` (a full
queue drops and counts), ``latest_policy`` is one attribute read, and ``close`` returns within its deadline whatever
the network does. Torch-free on purpose.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..policy import Policy, PolicyError
from .backoff import Backoff
from .client import CollectorClient, Reply, encode, events_body, registration_body, send_events
from .config import TransportConfig
from .leftovers import Leftovers
from .outbox import Outbox
from .replay import ReplaySummary, _run_key, replay_file
from .spool import SpoolWriter, list_files

log = logging.getLogger(__name__)

LEFTOVER_SLICE_S = 0.5
"""Seconds per sender round spent on earlier transports' spool files: new events wait at most about this long."""


def _refuses_device(r: Reply) -> bool:
    """A 422 that says the registration's ``device`` field is unknown: a collector older than device identities."""
    detail = r.body.get("detail") if r.status == 422 and isinstance(r.body, dict) else None
    return isinstance(detail, list) and any(
        isinstance(e, dict) and e.get("loc") == ["body", "device"] and e.get("type") == "extra_forbidden"
        for e in detail)


@dataclass(frozen=True, slots=True)
class RemotePolicy:
    """A policy the collector gave this rank, and which one it is: the run's ("run"), or the suspect-device policy
    ("device") while the rank's device is under suspicion. One object, so the training thread reads both at once."""

    policy: Policy
    scope: str = "run"


class Transport:
    """One per guard. See the module docstring; the wire format is docs/wire.md, the spool docs/transport.md.

    Args:
        collector_url: base URL (``http://127.0.0.1:8000``); None runs fully offline (everything is spooled for
            ``attnchecker sync``, or for the next transport on the same spool directory).
        token: the agent's bearer token.
        run_name: the run to register or resume.
        spool_dir: where payloads go while the collector is unreachable.
        run_info: the rest of the registration body (model, world_size, rank, host, agent_version, config).
        config: the settings (:class:`TransportConfig`); or give its fields as keyword arguments.
    """

    def __init__(
        self,
        collector_url: str | None,
        token: str | None,
        run_name: str,
        *,
        spool_dir: str | os.PathLike[str],
        run_info: Mapping[str, Any] | None = None,
        config: TransportConfig | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise ValueError("Transport takes config= or its fields as keyword arguments, not both")
        self.config = config if config is not None else TransportConfig.from_options(options)
        self.run_body, info = registration_body(run_name, run_info)
        # For a collector from before device identities, which refuses the field (docs/streaming.md).
        self._run_body_without_device = (encode({k: v for k, v in info.items() if k != "device"})
                                         if "device" in info else None)
        cfg = self.config
        self.collector_url = collector_url
        self.token = token
        self.run_name = run_name
        self.rank: int = info["rank"]
        self.spool_dir = Path(spool_dir)
        self.batch_size = cfg.batch_size
        self.read_timeout_s = float(cfg.read_timeout_s)

        # Shared with the training thread: the outbox, the policy slot, the flags and the counters below.
        self._outbox = Outbox(cfg, self._warn_once)
        self._latest: RemotePolicy | None = None
        self._stop = threading.Event()
        self._flush_req = threading.Event()
        self._flush_done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._deadline = float("inf")
        # `+=` is not atomic across threads: each counter has one writing thread, or is updated under _lock where
        # close() may write it too (spooled, _dropped_sender).
        self._lock = threading.Lock()
        self._sent = 0
        self._spooled = 0
        self._dropped_sender = 0  # rejected by the collector, spool full
        self._last_counts = (0, 0, 0)
        self._final_last_step: int | None = None
        self._finish_spooled = False

        # Sender thread only.
        self._spool = SpoolWriter(self.spool_dir, self.run_body, max_total_bytes=cfg.max_spool_bytes)
        self._leftovers = Leftovers(self.spool_dir, self._spool.prefix) if cfg.replay_leftovers else None
        self._backoff = Backoff(max_s=float(cfg.max_backoff_s))
        self._run_id: str | None = None
        self._register_rejected = False
        self._etag: str | None = None
        self._retry_at = 0.0
        self._probe_at = 0.0
        self._next_poll_at = 0.0
        self._outage: str | None = None
        self._spool_dirty = False
        self._leftovers_scanned = False
        self._warned: set[str] = set()

    # --- the training thread ------------------------------------------------------------------------------------

    def start(self, *, at_exit: bool = True) -> Transport:
        """Start the sender thread (idempotent). Touches no network itself: registration happens on the thread.
        ``at_exit``: close at interpreter exit; False when the owner's own hook closes it (a guard's RunLink)."""
        with self._start_lock:
            if self._thread is None and not self._outbox.closed:
                leftovers = list_files(self.spool_dir)
                if leftovers and self._leftovers is not None and self.collector_url:
                    log.info("%d spool file(s) from earlier transports in %s: uploading them once the collector "
                             "answers", len(leftovers), self.spool_dir)
                elif leftovers:
                    log.info("%d spool file(s) from earlier runs in %s: upload them with `attnchecker sync %s`",
                             len(leftovers), self.spool_dir, self.spool_dir)
                self._thread = threading.Thread(target=self._run, name="attnchecker-sender", daemon=True)
                self._thread.start()
                if at_exit:
                    atexit.register(self._atexit_close)
        return self

    def emit_event(self, event: Any) -> None:
        """Queue one event: a wire dict (``Detection.to_wire()``) or any object with ``to_wire()``, which is then
        called on the sender thread. The transport owns it from here: do not mutate it. Never blocks."""
        self._outbox.put_event(event)

    def emit_stats(self, stats: Mapping[str, Any]) -> None:
        """Queue one interval's stats (docs/wire.md). ``interval_id`` and ``transport`` (this transport's counter
        deltas, see ``take_deltas``) are filled in when missing. Never blocks."""
        if self._outbox.closed:
            return
        body = dict(stats)
        body.setdefault("interval_id", str(uuid.uuid4()))
        if "transport" not in body:
            body["transport"] = self.take_deltas()
        try:
            encoded = encode(body)
        except (TypeError, ValueError) as e:
            self._warn_once("stats-encode", "stats payload not JSON-serialisable, dropped: %s", e)
            return
        if not self._outbox.put_stats(encoded):
            self._warn_once("stats-full", "stats queue full (collector slow or down for long): stats dropped")

    def latest_policy(self) -> Policy | None:
        """The newest policy the collector gave (registration or poll), or None. One attribute read: call it at
        step boundaries and apply the policy when its version differs from the applied one."""
        latest = self._latest
        return latest.policy if latest is not None else None

    def latest_remote(self) -> RemotePolicy | None:
        """The newest policy with its scope (``RemotePolicy``), or None; one attribute read, like ``latest_policy``."""
        return self._latest

    @property
    def sent(self) -> int:
        """Events the collector answered 2xx for (live or replayed)."""
        return self._sent

    @property
    def spooled(self) -> int:
        """Events written to the spool (some of them later replayed, and counted in ``sent`` too)."""
        return self._spooled

    @property
    def dropped(self) -> int:
        """Events lost: queue full, transport closed, not encodable, rejected by the collector, or spool full."""
        return self._outbox.dropped_full + self._outbox.dropped_unencodable + self._dropped_sender

    @property
    def leftover_events(self) -> int:
        """Events this transport uploaded from spool files that earlier transports left (not in ``sent``)."""
        return self._leftovers.events if self._leftovers is not None else 0

    @property
    def run_id(self) -> str | None:
        return self._run_id

    def take_deltas(self) -> dict[str, int]:
        """Counter changes since the previous call: the ``transport`` object of a stats payload. Call from one
        thread (the training thread, at step boundaries)."""
        now = (self.sent, self.spooled, self.dropped)
        last, self._last_counts = self._last_counts, now
        return {"sent": now[0] - last[0], "spooled": now[1] - last[1], "dropped": now[2] - last[2]}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything emitted so far is sent or spooled. For tests and demos, not for every step.
        Returns False on timeout (the records are not lost; they go out later)."""
        if self._thread is None or not self._thread.is_alive():
            return False
        self._flush_done.clear()
        self._flush_req.set()
        self._outbox.wake()
        return self._flush_done.wait(timeout_s)

    def close(self, deadline_s: float = 5.0, *, last_step: int | None = None) -> None:
        """Send what is queued and tell the collector the run finished, within ``deadline_s``; whatever cannot go
        by then is spooled. Never hangs. ``last_step`` goes into the finish record (default: the largest step
        seen in the events and stats)."""
        if self._outbox.closed:
            return
        self._final_last_step = last_step
        start = time.monotonic()
        # The sender aims a little before the deadline, so that spooling what is left still fits in it.
        self._deadline = start + max(0.0, deadline_s - min(0.5, 0.2 * deadline_s))
        if self._thread is None:
            self.start()
        self._outbox.closed = True
        atexit.unregister(self._atexit_close)
        self._stop.set()
        self._outbox.wake()
        assert self._thread is not None
        self._thread.join(max(0.0, start + deadline_s - time.monotonic()))
        if self._thread.is_alive():
            # It is stuck in a request that started before close(). Spool everything not in flight from here; the
            # sender spools its in-flight request itself when that times out.
            log.warning("attnchecker sender did not finish within %.1fs; spooling from the caller", deadline_s)
            self._spool_rest()

    def _atexit_close(self) -> None:
        self.close()

    # --- the sender thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        client = None
        if self.collector_url:
            client = CollectorClient(self.collector_url, self.token, connect_timeout_s=self.config.connect_timeout_s,
                                     read_timeout_s=self.config.read_timeout_s)
        try:
            while True:
                try:
                    if self._iterate(client):
                        return
                except Exception:
                    # The sender must outlive any bug of its own: log, back off, keep the data.
                    log.exception("attnchecker sender error; spooling and retrying later")
                    self._retry_at = time.monotonic() + self._backoff.next_delay()
                    if self._stop.is_set():
                        self._spool_rest()
                        return
        finally:
            self._spool.close()
            if client is not None:
                client.close()

    def _iterate(self, client: CollectorClient | None) -> bool:
        """One round: collect, then send or spool. True when the transport is closed and done."""
        stopping = self._stop.is_set()
        self._outbox.collect(0.0 if stopping else self._wait_s(client), drain_all=stopping)
        self._outbox.drain_stats()
        if stopping:
            self._final(client)
            return True
        flushing = self._flush_req.is_set()
        if client is not None and not self._register_rejected and self._try_now(client):
            self._online(client, flushing)
        else:
            self._offline(flushing)
        if flushing and self._outbox.empty():
            self._flush_req.clear()
            self._flush_done.set()
        return False

    def _try_now(self, client: CollectorClient, budget: Callable[[], float | None] = lambda: None) -> bool:
        """Whether to use the API this round: the backoff is over, or a ``/readyz`` probe (due while backing off)
        says the collector is back. The probe is what brings the agent back within about ``probe_interval_s`` of
        the collector, instead of up to ``max_backoff_s``."""
        now = time.monotonic()
        if now >= self._retry_at:
            return True
        if now < self._probe_at:
            return False
        b = budget()
        r = client.ready(budget_s=self.config.connect_timeout_s if b is None else min(self.config.connect_timeout_s, b))
        self._probe_at = time.monotonic() + max(self._backoff.probe_delay(self.config.probe_interval_s),
                                                min(r.retry_after_s or 0.0, self.config.max_backoff_s))
        if r.status != 200:
            return False
        self._retry_at = 0.0
        return True

    def _wait_s(self, client: CollectorClient | None) -> float:
        now = time.monotonic()
        wake = now + 1.0
        batch_at = self._outbox.next_batch_at()
        if batch_at is not None:
            wake = min(wake, batch_at)
        if client is not None and not self._register_rejected:
            retry = self._retry_at if now >= self._retry_at else min(self._retry_at, self._probe_at)
            wake = min(wake, max(retry, self._next_poll_at if self._run_id else now))
            if self._leftovers is not None and self._leftovers.due and now >= self._retry_at:
                wake = now
        return min(1.0, max(0.0, wake - now))

    # --- online / offline ---------------------------------------------------------------------------------------

    def _online(
        self, client: CollectorClient, flushing: bool, budget: Callable[[], float | None] = lambda: None
    ) -> bool:
        """Register, replay the spool, send stats and due batches, poll the policy, upload leftovers. False when the
        collector failed us (then we are in backoff and what was due is spooled)."""
        failed = self._online_steps(client, flushing, budget)
        if failed is not None:
            self._went_offline(failed)
            self._offline(flushing)
            return False
        if self._outage is not None:
            log.info("collector %s reachable again", self.collector_url)
            self._outage = None
            if self._leftovers is not None:
                self._leftovers.rescan()  # files other transports left during the outage
        self._backoff.reset()
        return True

    def _online_steps(
        self, client: CollectorClient, flushing: bool, budget: Callable[[], float | None]
    ) -> Reply | None:
        if self._run_id is None:
            r = client.register(self.run_body, budget_s=budget())
            if self._run_body_without_device is not None and _refuses_device(r):
                self._warn_once("old-collector", "collector %s predates device identities: this rank registers "
                                "without its device (its faults stay unattributed); upgrade the collector",
                                self.collector_url)
                self.run_body, self._run_body_without_device = self._run_body_without_device, None
                r = client.register(self.run_body, budget_s=budget())
            if not r.ok:
                if not r.transient and not r.too_large:
                    self._register_rejected = True
                    log.error("collector rejected the run registration; spooling everything: %s", r.error)
                return r
            body = r.body if isinstance(r.body, dict) else {}
            if "id" not in body:
                return Reply(r.status, error="registration answer had no run id")
            self._run_id = str(body["id"])
            self._set_policy(body.get("policy"), r.etag, body.get("policy_scope"))
            self._note_device(body.get("device"))
            self._next_poll_at = time.monotonic() + self.config.poll_interval_s
            if self._leftovers is not None and not self._leftovers_scanned:
                self._leftovers_scanned = True
                self._leftovers.rescan()
        if self._spool_dirty:
            r2 = self._replay_own(client, budget)
            if r2 is not None:
                return r2
        while (stats := self._outbox.take_stats()) is not None:
            r = client.post("stats", self._run_id, stats, budget_s=budget())
            if r.transient:
                self._spool_append("stats", stats, 0)
                return self._run_missing(r)
            if not r.ok:
                self._warn_once("stats-rejected", "collector rejected a stats payload, dropped: %s", r.error)
        while self._outbox.batch_due(flushing):
            failed = self._send_events(client, self._outbox.take_batch(), budget)
            if failed is not None:
                return failed
        if time.monotonic() >= self._next_poll_at and not self._stop.is_set():
            polled = client.get_policy(self._run_id, self._etag, rank=self.rank, budget_s=budget())
            self._next_poll_at = time.monotonic() + self.config.poll_interval_s
            if polled.transient:
                return self._run_missing(polled)
            if polled.ok:
                self._set_policy(polled.body, polled.etag, polled.policy_scope)
            elif polled.status != 304:
                self._warn_once("poll", "policy poll failed: %s", polled.error)
        if self._leftovers is not None and self._leftovers.due and not self._stop.is_set():
            # After this round's own data, and a slice at a time: a big backlog never holds new events for long.
            return self._leftovers.upload_some(client, LEFTOVER_SLICE_S, budget)
        return None

    def _run_missing(self, r: Reply) -> Reply:
        if r.status == 404:
            self._run_id = None  # the collector lost the run (a wiped database): register again on the next try
        return r

    def _send_events(
        self, client: CollectorClient, chunk: list[bytes], budget: Callable[[], float | None]
    ) -> Reply | None:
        assert self._run_id is not None
        out = send_events(client, self._run_id, chunk, budget_s=budget)
        self._sent += out.sent
        if out.rejected:
            self._count_dropped(out.rejected)
            log.error("collector rejected %d events, dropped: %s", out.rejected, "; ".join(out.errors)[:500])
        if out.failed is None:
            return None
        # Spool the failed request's very body: if the collector stored it before the connection broke, the
        # replay's batch id and event ids make it a duplicate there, not a second copy.
        for body, n in out.unsent:
            self._spool_append("events", body, n)
        return self._run_missing(out.failed)

    def _replay_own(self, client: CollectorClient, budget: Callable[[], float | None]) -> Reply | None:
        assert self._run_id is not None
        self._spool.rotate()
        run_ids = {_run_key(json.loads(self.run_body)): self._run_id}
        for path in self._spool.own_files():
            summary = ReplaySummary()
            failed = replay_file(client, path, run_ids, summary, budget_s=budget)
            self._sent += summary.events
            self._count_dropped(summary.rejected)
            self._spool.forget(summary.bytes_deleted)
            if failed is not None:
                return self._run_missing(failed)
        self._spool_dirty = False
        return None

    def _went_offline(self, r: Reply) -> None:
        # A Retry-After (503 while the collector's database is down, 429) is the earliest the collector wants us
        # back; the probe honours it too (see _try_now).
        hint = min(r.retry_after_s or 0.0, self.config.max_backoff_s)
        now = time.monotonic()
        self._retry_at = now + max(self._backoff.next_delay(), hint)
        self._probe_at = now + max(self._backoff.probe_delay(self.config.probe_interval_s), hint)
        if self._stop.is_set():
            log.info("collector %s: close deadline reached (%s); spooling the rest to %s", self.collector_url,
                     r.error or f"HTTP {r.status}", self.spool_dir)
        elif self._outage is None:
            self._outage = r.error or f"HTTP {r.status}"
            log.warning("collector %s unreachable (%s); spooling to %s, retrying with backoff",
                        self.collector_url, self._outage, self.spool_dir)

    def _offline(self, flushing: bool) -> None:
        while (stats := self._outbox.take_stats()) is not None:
            self._spool_append("stats", stats, 0)
        while self._outbox.batch_due(flushing):
            self._spool_events(self._outbox.take_batch())

    def _spool_events(self, chunk: list[bytes]) -> None:
        self._spool_append("events", events_body(chunk), len(chunk))

    def _spool_append(self, kind: str, body: bytes, n: int) -> None:
        try:
            ok = self._spool.append(kind, body, n=n)
        except OSError as e:
            ok = False
            self._warn_once("spool-io", "cannot write the spool in %s: %s", self.spool_dir, e)
        with self._lock:  # close() may spool too, when the sender missed its deadline
            if ok:
                self._spooled += n
                self._spool_dirty = True
            else:
                self._dropped_sender += n
        if not ok:
            self._warn_once("spool-full", "spool %s full or unwritable: records dropped", self.spool_dir)

    def _count_dropped(self, n: int) -> None:
        with self._lock:  # close() may drop too, when the sender missed its deadline
            self._dropped_sender += n

    def _spool_rest(self) -> None:
        """Spool everything not in flight, and the finish record once. Safe from the sender and from close()."""
        pending, stats = self._outbox.take_all()
        with self._lock:
            write_finish, self._finish_spooled = not self._finish_spooled, True
        for b in stats:
            self._spool_append("stats", b, 0)
        for i in range(0, len(pending), self.batch_size):
            self._spool_events(pending[i:i + self.batch_size])
        if write_finish:
            self._spool_append("finish", self._finish_body(), 0)

    def _finish_body(self) -> bytes:
        last = self._final_last_step if self._final_last_step is not None else self._outbox.last_step
        return encode({"rank": self.rank, "last_step": last})

    def _final(self, client: CollectorClient | None) -> None:
        """At close: try to deliver everything before the deadline, then spool what is left (finish included)."""
        def budget() -> float:
            return self._deadline - time.monotonic()

        # Known down (in backoff, and a quick probe says still down) or no time left: do not spend the deadline on
        # the network. The probe is forced: a collector back since the last probe still gets the finish.
        self._probe_at = 0.0
        if (client is None or self._register_rejected or budget() < 0.05 or not self._try_now(client, budget)
                or not self._online(client, True, budget)):
            self._spool_rest()
            return
        if budget() >= 0.05 and self._run_id is not None:
            r = client.post("finish", self._run_id, self._finish_body(), budget_s=budget())
            if r.ok or not (r.transient or r.too_large):
                return
        self._spool_rest()

    def _set_policy(self, data: Any, etag: str | None, scope: Any = None) -> None:
        if not isinstance(data, dict):
            return
        try:
            policy = Policy.from_wire(data)
        except PolicyError as e:
            self._warn_once(f"policy-{data.get('version')}", "collector sent a policy the agent cannot use: %s", e)
            return
        scope = "device" if scope == "device" else "run"  # a collector from before devices says nothing: the run's
        self._etag = etag or (f'"{policy.version}"' if scope == "run" else f'"device-{policy.version}"')
        current = self._latest
        if current is None or current.scope != scope or current.policy != policy:
            # One reference assignment: atomic for the training thread's read.
            self._latest = RemotePolicy(policy, scope)

    def _note_device(self, device: Any) -> None:
        """The registration's word on this rank's device: an operator's suspicion is said once, loudly."""
        if isinstance(device, dict) and device.get("status") in ("suspect", "quarantined"):
            self._warn_once(
                "device-status", "the collector lists this rank's device %s as %s (%s): it follows the "
                "suspect-device policy", device.get("uuid"), device.get("status"), device.get("reason") or "no reason")

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
