"""`attnchecker sync DIR`: upload a spool directory left by a run that could not reach its collector.

A transport started later on the same spool directory uploads what earlier ones left by itself (docs/transport.md);
this command is for nodes that never run again, and for operators who want it done now.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("spool_dir", help="the agent's spool directory")
    p.add_argument("--collector", default=os.environ.get("ATTNCHECKER_COLLECTOR_URL", "http://127.0.0.1:8000"),
                   help="collector base URL (default: $ATTNCHECKER_COLLECTOR_URL or http://127.0.0.1:8000)")
    p.add_argument("--token", default=os.environ.get("ATTNCHECKER_TOKEN"),
                   help="agent token (default: $ATTNCHECKER_TOKEN)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="upload spooled events and stats to the collector, exactly once",
                       description="Upload spooled ATTNChecker payloads once.")
    add_arguments(p)
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when nothing is left, 1 otherwise."""
    # The CLI starts fast: httpx only when a command needs it.
    from ..transport import replay_spool

    if not Path(args.spool_dir).is_dir():
        args.parser.error(f"{args.spool_dir} is not a directory")
    s = replay_spool(args.spool_dir, args.collector, args.token)
    sys.stdout.write(json.dumps(s.to_dict(), indent=2) + "\n")
    return 0 if not s.remaining and not s.rejected else 1


def sync_main(argv: Sequence[str] | None = None) -> int:
    """``attnchecker sync`` on its own, for callers that have an argv (tests, wrappers)."""
    p = argparse.ArgumentParser(prog="attnchecker sync", description="Upload spooled ATTNChecker payloads once.")
    add_arguments(p)
    args = p.parse_args(argv)
    args.parser = p
    return run(args)
