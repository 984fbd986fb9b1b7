"""Uploading spooled payloads: automatically by the sender thread (its own files after a reconnect, earlier
transports' files once the collector answers, see leftovers.py), or by hand with ``attnchecker sync DIR``
(:func:`replay_spool`; its command line is attnchecker/cli/sync.py).

Oldest file first, ids preserved, a file deleted only after every record
in it got a 2xx, so running it again uploads nothing and a retried record never duplicates (the collector dedups by
batch id, event id and interval id).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .client import CollectorClient, Reply, encode, send_events
from .spool import claim, claim_writer, list_files, read_records, rewrite, writer_of

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplaySummary:
    files: int = 0
    """Files uploaded completely and deleted."""
    requests: int = 0
    events: int = 0
    """Events in uploaded batches (duplicates included: a batch the collector had already seen still counts)."""
    duplicates: int = 0
    """Events the collector already had (from the 200 responses)."""
    rejected: int = 0
    """Events (or stats/finish records) the collector refused for good (a 4xx that is not about auth, a missing run,
    rate or size); logged and dropped."""
    skipped: int = 0
    """Files a live writer still holds or owns (left for later)."""
    remaining: list[str] = field(default_factory=list)
    """Files left because the collector stopped answering; run again later."""
    errors: list[str] = field(default_factory=list)
    bytes_deleted: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files, "requests": self.requests, "events": self.events, "duplicates": self.duplicates,
            "rejected": self.rejected, "skipped": self.skipped, "remaining": self.remaining, "errors": self.errors,
        }


def _run_key(body: Any) -> str:
    return json.dumps(body, sort_keys=True)


PAUSED = Reply(None, error="paused: the caller's time slice is used up")
"""What :func:`replay_file` returns when ``stop()`` asked it to pause: the file keeps what is left; no failure."""


def replay_file(
    client: CollectorClient,
    path: Path,
    run_ids: dict[str, str],
    summary: ReplaySummary,
    *,
    budget_s: Callable[[], float | None] = lambda: None,
    stop: Callable[[], bool] = lambda: False,
) -> Reply | None:
    """Upload one spool file. Returns None on success (file deleted), else the failing reply (file keeps what is
    left), or :data:`PAUSED` when ``stop()`` turned true between two records (checked after the first one sent).
    ``run_ids`` caches registration per run body, so a run's many files register once."""
    with claim(path) as mine:
        if not mine:
            summary.skipped += 1
            return None
        records = read_records(path)
        run_id: str | None = None
        header: dict[str, Any] | None = None
        sent_any = False
        for i, rec in enumerate(records):
            kind, body = rec["kind"], rec["body"]
            if sent_any and kind != "run" and stop():
                _keep_rest(path, header, records[i:], PAUSED, run_ids)
                return PAUSED
            if kind == "run":
                header = rec
                key = _run_key(body)
                run_id = run_ids.get(key)
                if run_id is None:
                    reply = client.register(encode(body), budget_s=budget_s())
                    summary.requests += 1
                    if not reply.ok or not isinstance(reply.body, dict) or "id" not in reply.body:
                        return reply if not reply.ok else Reply(reply.status, error="registration answer had no id")
                    run_id = run_ids[key] = reply.body["id"]
                continue
            if run_id is None:
                summary.errors.append(f"{path}: record {i} has no run record before it; skipped")
                continue
            sent_any = True
            if kind == "events":
                out = send_events(client, run_id, [encode(e) for e in body.get("events", ())], body=encode(body),
                                  budget_s=budget_s)
                summary.requests += 1
                summary.events += out.sent
                summary.duplicates += out.duplicates
                summary.rejected += out.rejected
                summary.errors += [f"{path}: events rejected: {e}" for e in out.errors]
                if out.failed is None:
                    continue
                left = [{"v": rec.get("v", 1), "kind": "events", "n": n, "body": json.loads(b)} for b, n in out.unsent]
                return _keep_rest(path, header, left + records[i + 1:], out.failed, run_ids)
            reply = client.post(kind, run_id, encode(body), budget_s=budget_s())
            summary.requests += 1
            if reply.ok:
                continue
            if reply.transient or reply.too_large:
                return _keep_rest(path, header, records[i:], reply, run_ids)
            summary.rejected += 1
            summary.errors.append(f"{path}: {kind} record rejected: {reply.error}")
            log.error("spooled %s record rejected by the collector, dropped: %s", kind, reply.error)
        size = path.stat().st_size
        path.unlink()
        summary.files += 1
        summary.bytes_deleted += size
    return None


def _keep_rest(
    path: Path, header: dict[str, Any] | None, rest: list[dict[str, Any]], reply: Reply, run_ids: dict[str, str]
) -> Reply:
    """Keep what is left (from the failed record on) for the next attempt; what was uploaded is not repeated."""
    if reply.status == 404 and header is not None:
        run_ids.pop(_run_key(header["body"]), None)  # the collector lost the run: register again next time
    rewrite(path, ([header] if header else []) + rest)
    return reply


def replay_spool(
    spool_dir: str | os.PathLike[str], collector_url: str, token: str | None, *, connect_timeout_s: float = 1.0,
    read_timeout_s: float = 10.0,
) -> ReplaySummary:
    """Upload every spooled file in ``spool_dir`` exactly once (see the module docstring). Stops at the first file the
    collector cannot take (unreachable, overloaded): what is left stays on disk for the next run."""
    summary = ReplaySummary()
    client = CollectorClient(collector_url, token, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    run_ids: dict[str, str] = {}
    try:
        files = list_files(spool_dir)
        for n, path in enumerate(files):
            with claim_writer(Path(spool_dir), writer_of(path)) as free:
                # A live transport owns its finished files until it closes: it replays them itself.
                failed = replay_file(client, path, run_ids, summary) if free else None
                summary.skipped += not free
            if failed is not None:
                summary.remaining = [str(p) for p in files[n:] if p.exists()]
                summary.errors.append(f"{path}: stopped: {failed.error or failed.status}")
                break
    finally:
        client.close()
    return summary
