"""`attnchecker demo | sync | bench` — the command line. Printing to the terminal is this package's job only."""
from __future__ import annotations

import argparse
import logging
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnchecker", description="Fault-tolerant attention for LLM training.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True)

    from . import demo, sync

    demo.add_parser(sub)
    sync.add_parser(sub)
    try:  # bench/ lives at the repository root; it is there in a checkout, not in an installed wheel
        from . import bench
    except ImportError:  # pragma: no cover - depends on the install layout
        pass
    else:
        bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":  # `python -m attnchecker.cli`
    sys.exit(main())
