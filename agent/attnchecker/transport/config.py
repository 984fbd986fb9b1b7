"""The transport's settings: one frozen, validated value instead of a loose dict of keyword arguments."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportConfig:
    """How the sender thread batches, times out, backs off and spools (docs/transport.md). Every field is checked
    when the config is built, so a typo fails at ``protect()``, not later on the sender thread."""

    batch_size: int = 500
    """Events per ``events:batch`` request, at most."""
    flush_interval_s: float = 1.0
    """A batch goes out at the latest this long after its oldest event was emitted."""
    queue_max: int = 10_000
    """Events the training thread may queue before ``emit_event`` drops (and counts) instead of waiting."""
    stats_queue_max: int = 1_000
    """Stats intervals queued before ``emit_stats`` drops."""
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 2.0
    max_backoff_s: float = 30.0
    """Longest wait between two retries of the collector's API while it is down."""
    probe_interval_s: float = 1.0
    """While backing off, ``/readyz`` is probed about this often, so the sender is back within about this long after
    the collector is, however long the backoff has grown."""
    poll_interval_s: float = 2.0
    """Policy poll period (``GET .../policy`` with ``If-None-Match``)."""
    max_batch_bytes: int = 900_000
    """A batch is cut before this many bytes of events (the collector takes 1 MiB bodies)."""
    max_spool_bytes: int = 1 << 30
    """Disk this transport may fill with its spool; beyond it records are dropped and counted."""
    replay_leftovers: bool = True
    """Upload what earlier transports left in the spool directory (other runs, or this run before a restart) once
    the collector answers. Off: only ``attnchecker sync`` uploads them."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "queue_max", "stats_queue_max", "max_batch_bytes", "max_spool_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"transport.{name} must be an int >= 1, got {value!r}")
        for name in ("flush_interval_s", "connect_timeout_s", "read_timeout_s", "max_backoff_s", "probe_interval_s",
                     "poll_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"transport.{name} must be a number > 0, got {value!r}")
        if not isinstance(self.replay_leftovers, bool):
            got = self.replay_leftovers
            raise ValueError(f"transport.replay_leftovers must be True or False, got {got!r}")

    @classmethod
    def from_options(cls, options: TransportConfig | Mapping[str, Any] | None) -> TransportConfig:
        """A config from ``protect(transport_options=...)``: a ``TransportConfig``, a mapping of its fields, or None
        (the defaults). An unknown key is an error that lists the known ones."""
        if options is None:
            return cls()
        if isinstance(options, TransportConfig):
            return options
        if not isinstance(options, Mapping):
            raise ValueError(
                f"transport_options must be a TransportConfig or a mapping of its fields, got {type(options).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in options if k not in known)
        if unknown:
            raise ValueError(f"transport_options: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"known keys are {', '.join(known)}")
        return cls(**options)
