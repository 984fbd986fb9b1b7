"""Spool files earlier transports left in this transport's spool directory: the same run before a restart, or
earlier runs that ended while the collector was down. The sender thread uploads them once the collector answers, a
time slice per round, so nothing waits for a manual ``attnchecker sync``.

Safe with any number of transports and ``sync`` runs on one directory: a file is taken only with its writer's owner
lock (that writer closed or died, see spool.py) and its own file lock, so it is never uploaded while a live transport
owns it, nor by two uploaders at once, and what was uploaded is deleted or cut from the file before the locks go.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from .client import CollectorClient, Reply
from .replay import PAUSED, ReplaySummary, replay_file
from .spool import claim_writer, list_files, writer_of

log = logging.getLogger(__name__)


def _outage(r: Reply) -> bool:
    """The collector is down or overloaded (retry the whole thing later), as opposed to refusing this file."""
    return r.status is None or r.status >= 500 or r.status in (408, 429)


class Leftovers:
    """Sender thread only. :meth:`rescan` after each (re)connect; :meth:`upload_some` each round while
    :attr:`due`."""

    def __init__(self, spool_dir: Path, own_prefix: str) -> None:
        self.dir = spool_dir
        self.own_prefix = own_prefix
        self.events = 0
        """Events uploaded from earlier transports' files (not this transport's ``sent``)."""
        self.files = 0
        self._queue: list[Path] = []
        self._given_up: set[Path] = set()
        self._run_ids: dict[str, str] = {}

    @property
    def due(self) -> bool:
        return bool(self._queue)

    def rescan(self) -> int:
        """Queue the directory's files that are not this transport's own, oldest first. Returns how many."""
        self._queue = [p for p in list_files(self.dir)
                       if writer_of(p) != self.own_prefix and p not in self._given_up]
        return len(self._queue)

    def upload_some(self, client: CollectorClient, slice_s: float,
                    budget: Callable[[], float | None] = lambda: None) -> Reply | None:
        """Upload for about ``slice_s`` seconds (at least one record), so new events never wait long behind a big
        backlog. Returns the reply when the collector is down (keep the rest for after the outage), else None."""
        end = time.monotonic() + slice_s

        def stop() -> bool:
            return time.monotonic() >= end

        while self._queue and not stop():
            path = self._queue[0]
            summary = ReplaySummary()
            with claim_writer(self.dir, writer_of(path)) as free:
                failed = replay_file(client, path, self._run_ids, summary, budget_s=budget, stop=stop) if free else None
            self.events += summary.events
            if summary.events or summary.rejected:
                log.info("uploaded %d event(s) an earlier transport left in %s (%d rejected by the collector)",
                         summary.events, path, summary.rejected)
            if failed is PAUSED:
                return None
            self._queue.pop(0)
            if failed is None:
                if free and not path.exists():
                    self.files += 1
                continue  # uploaded, or owned by a live transport (it uploads its files itself)
            if _outage(failed):
                self._queue.insert(0, path)
                return failed
            # 401/403 (another token's run), 404, 413: this agent cannot deliver the file; `sync` with the right
            # token can. Leave it on disk and go on with the others.
            self._given_up.add(path)
            log.warning("cannot upload %s, an earlier transport's spool file: %s; left for `attnchecker sync %s`",
                        path, failed.error or f"HTTP {failed.status}", self.dir)
        return None
