"""Streaming to the collector without ever blocking training: bounded queue, sender thread, disk spool, replay.

Torch-free (it may not import ``torch`` at all); see docs/transport.md.
"""
from __future__ import annotations

from .config import TransportConfig
from .replay import ReplaySummary, replay_spool
from .sender import RemotePolicy, Transport

__all__ = ["RemotePolicy", "ReplaySummary", "Transport", "TransportConfig", "replay_spool"]
