"""`attnchecker sync DIR`: upload a spool directory left by a run that could not reach its collector."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="upload spooled events and stats to the collector, exactly once",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from ..transport import sync_main

    return sync_main(args.rest)
