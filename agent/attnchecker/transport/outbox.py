"""What the training thread shares with the sender thread: two bounded queues, and the records the sender has taken
off them but not yet sent (which ``close()`` may have to spool itself). The only other shared thing is the policy
slot, one attribute the sender replaces whole (``Transport.latest_policy``).

The training thread only ever calls :meth:`Outbox.put_event` / :meth:`Outbox.put_stats` (a ``put_nowait``: a full
queue drops and counts, never waits). Everything else runs on the sender thread, or in ``close()`` when the sender
missed its deadline; that is what ``lock`` is for.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .client import encode
from .config import TransportConfig

log = logging.getLogger(__name__)

WAKE = object()
"""Put on the event queue to wake the sender now (flush, close) instead of at its next timeout."""


class Outbox:
    def __init__(self, config: TransportConfig, warn_once: Callable[..., None]) -> None:
        self.batch_size = config.batch_size
        self.max_batch_bytes = config.max_batch_bytes
        self.flush_interval_s = float(config.flush_interval_s)
        self._warn_once = warn_once
        self.events: queue.Queue[Any] = queue.Queue(maxsize=config.queue_max)
        self.stats: queue.Queue[bytes] = queue.Queue(maxsize=config.stats_queue_max)
        self.closed = False
        # One writing thread each, so `+=` never races.
        self.dropped_full = 0  # training thread: queue full, or emitted after close
        self.dropped_unencodable = 0  # sender thread (or close()), under `lock`
        self.last_step: int | None = None  # sender thread: the largest step seen (the finish record's default)

        # Taken off the queues, not yet sent. Guarded by `lock`, held only for list operations (never across I/O;
        # the training thread's put never takes it).
        self.lock = threading.Lock()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._pending_since = 0.0
        self._stats_pending: list[bytes] = []

    # --- the training thread ------------------------------------------------------------------------------------

    def put_event(self, event: Any) -> None:
        if self.closed:
            self.dropped_full += 1
            return
        try:
            self.events.put_nowait(event)
        except queue.Full:
            self.dropped_full += 1

    def put_stats(self, encoded: bytes) -> bool:
        try:
            self.stats.put_nowait(encoded)
        except queue.Full:
            return False
        return True

    def wake(self) -> None:
        try:
            self.events.put_nowait(WAKE)
        except queue.Full:
            pass  # a full queue wakes the sender anyway

    # --- the sender thread --------------------------------------------------------------------------------------

    def collect(self, timeout_s: float, *, drain_all: bool = False) -> None:
        """Move events from the queue into the pending batch, waiting up to ``timeout_s`` for the first. Stops at a
        full batch unless ``drain_all``: the rest waits in the queue, which is what bounds memory."""
        try:
            item = self.events.get(timeout=timeout_s) if timeout_s > 0 else self.events.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not WAKE:
                b = self.encode_event(item)
                if b is not None:
                    with self.lock:
                        if not self._pending:
                            self._pending_since = time.monotonic()
                        self._pending.append(b)
                        self._pending_bytes += len(b) + 1
            if not drain_all and (len(self._pending) >= self.batch_size or self._pending_bytes >= self.max_batch_bytes):
                return
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                return

    def encode_event(self, item: Any) -> bytes | None:
        try:
            wire = item if isinstance(item, Mapping) else item.to_wire()
            b = encode(wire)
        except Exception as e:  # a bad record must not take the others down with it
            with self.lock:  # close() may encode too, when the sender missed its deadline
                self.dropped_unencodable += 1
            self._warn_once("event-encode", "event not JSON-serialisable (INF/NaN must be strings), dropped: %s", e)
            return None
        self._see_step(wire.get("step"))
        return b

    def _see_step(self, step: Any) -> None:
        if isinstance(step, int) and (self.last_step is None or step > self.last_step):
            self.last_step = step

    def drain_stats(self) -> None:
        while True:
            try:
                b = self.stats.get_nowait()
            except queue.Empty:
                return
            try:
                self._see_step(json.loads(b).get("step_end"))
            except ValueError:
                pass
            with self.lock:
                self._stats_pending.append(b)

    def next_batch_at(self) -> float | None:
        """When the oldest pending event makes its batch due by age (monotonic time), or None when none is pending."""
        return self._pending_since + self.flush_interval_s if self._pending else None

    def batch_due(self, flushing: bool) -> bool:
        if not self._pending:
            return False
        return (flushing or len(self._pending) >= self.batch_size or self._pending_bytes >= self.max_batch_bytes
                or time.monotonic() - self._pending_since >= self.flush_interval_s)

    def take_batch(self) -> list[bytes]:
        with self.lock:
            n, size = 0, 0
            while n < len(self._pending) and n < self.batch_size and (n == 0 or size < self.max_batch_bytes):
                size += len(self._pending[n]) + 1
                n += 1
            chunk, self._pending = self._pending[:n], self._pending[n:]
            self._pending_bytes -= size
            if self._pending:
                self._pending_since = time.monotonic()
            return chunk

    def take_stats(self) -> bytes | None:
        with self.lock:
            return self._stats_pending.pop(0) if self._stats_pending else None

    def empty(self) -> bool:
        return self.events.empty() and not self._pending and not self._stats_pending

    def take_all(self) -> tuple[list[bytes], list[bytes]]:
        """Everything not in flight, encoded: (events, stats). Safe from the sender and from ``close()``."""
        items = []
        while True:
            try:
                item = self.events.get_nowait()
            except queue.Empty:
                break
            if item is not WAKE:
                items.append(item)
        encoded = [b for b in map(self.encode_event, items) if b is not None]
        with self.lock:
            events, self._pending, self._pending_bytes = self._pending + encoded, [], 0
            stats, self._stats_pending = self._stats_pending, []
        return events, stats
