"""attnchecker-server: serve, migrate, token create|list|revoke, prune, grafana push. The only module that prints."""

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy.engine import make_url

from .auth import ROLES, create_token, list_tokens, parse_duration, revoke_tokens
from .config import Settings
from .db import make_engine, make_session_factory, session_scope

__all__ = ["main"]


def _sessions(settings: Settings):  # type: ignore[no-untyped-def]
    return make_session_factory(make_engine(settings, pooled=False))


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from .main import create_app
    from .migrate import upgrade

    is_sqlite = make_url(settings.effective_database_url).get_backend_name() == "sqlite"
    if args.workers < 1:
        print("attnchecker-server serve: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1 and is_sqlite:
        print(
            "attnchecker-server serve: --workers > 1 needs PostgreSQL (ATTNCHECKER_DATABASE_URL): one process owns "
            "a SQLite file",
            file=sys.stderr,
        )
        return 2
    # One process owns a SQLite file, so migrating here cannot race; on PostgreSQL several replicas may start
    # at once, so migrations stay a separate step (`attnchecker-server migrate`) unless asked for.
    if args.migrate if args.migrate is not None else is_sqlite:
        upgrade(settings)
    if args.workers == 1:
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level, workers=1)
        return 0
    # Several worker processes need an import string; each builds its app from the same ATTNCHECKER_* environment
    # these settings came from. /metrics reads the database, so every worker answers the same run metrics (the
    # attnchecker_ingest_* series are per process).
    uvicorn.run(
        "attnchecker_server.main:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        workers=args.workers,
    )
    return 0


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from alembic import command

    from .migrate import alembic_config

    if args.downgrade:
        command.downgrade(alembic_config(settings), args.revision)
    else:
        command.upgrade(alembic_config(settings), args.revision)
    return 0


def _token(args: argparse.Namespace, settings: Settings) -> int:
    sessions = _sessions(settings)
    if args.token_command == "create":
        try:
            expires_in = parse_duration(args.expires_in) if args.expires_in else None
            with session_scope(sessions) as session:
                token = create_token(
                    session, name=args.name, role=args.role, run_name=args.run, expires_in=expires_in
                )
        except ValueError as exc:
            print(f"attnchecker-server token create: {exc}", file=sys.stderr)
            return 2
        print(token)
        scope = f", bound to run {args.run!r}" if args.run else ""
        expiry = f", expires in {args.expires_in}" if args.expires_in else ""
        print(f"token for {args.name!r} (role {args.role}{scope}{expiry}); it is shown only this once", file=sys.stderr)
        return 0
    if args.token_command == "list":
        with sessions() as session:
            rows = list_tokens(session)
        for row in rows:
            state = f"revoked {row.revoked_at.isoformat()}" if row.revoked_at else "active"
            expiry = f"expires {row.expires_at.isoformat()}" if row.expires_at else "no expiry"
            run = f"run {row.run_name}" if row.run_name else "own runs"
            print(f"{row.prefix}\t{row.role}\t{row.name}\t{row.created_at.isoformat()}\t{state}\t{expiry}\t{run}")
        return 0
    with session_scope(sessions) as session:
        count = revoke_tokens(session, name=args.name, prefix=args.prefix)
    print(f"revoked {count} token(s)")
    return 0 if count else 1


def _prune(args: argparse.Namespace, settings: Settings) -> int:
    from .services.retention import prune

    try:
        older_than = parse_duration(args.older_than)
        report = prune(_sessions(settings), older_than=older_than, batch_size=args.batch_size, dry_run=args.dry_run)
    except ValueError as exc:
        print(f"attnchecker-server prune: {exc}", file=sys.stderr)
        return 2
    verb = "would delete" if args.dry_run else "deleted"
    rows = ", ".join(f"{n} {table}" for table, n in report.deleted.items())
    print(f"{verb} {rows} received before {report.cutoff.isoformat()} ({report.runs_scanned} runs scanned); "
          "run and device totals are kept")
    return 0


def _grafana(args: argparse.Namespace, _settings: Settings) -> int:
    # Imported lazily: grafana-client is only needed by this subcommand.
    from .grafana import push  # type: ignore[import-not-found,unused-ignore]

    result = push(args.url, args.token, Path(args.dashboards), Path(args.provisioning))
    print(json.dumps(result, indent=2, default=str))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnchecker-server",
        description="ATTNChecker collector. Configuration comes from ATTNCHECKER_* environment variables "
        "(ATTNCHECKER_DATABASE_URL, ATTNCHECKER_DATA_DIR, ...); see docs/collector.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the collector (uvicorn; --workers N on PostgreSQL)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument(
        "--workers", type=int, default=1, help="uvicorn worker processes (default 1; more than 1 needs PostgreSQL)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--migrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="upgrade the database before serving (default: yes on SQLite, no on PostgreSQL)",
    )
    serve.set_defaults(func=_serve)

    migrate = sub.add_parser("migrate", help="upgrade the database schema (Alembic)")
    migrate.add_argument("--revision", default="head")
    migrate.add_argument("--downgrade", action="store_true", help="downgrade to --revision instead")
    migrate.set_defaults(func=_migrate)

    token = sub.add_parser("token", help="manage API tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="create a token and print it (once)")
    create.add_argument("--role", required=True, choices=ROLES)
    create.add_argument("--name", required=True, help="who uses it; recorded as the actor of policy changes")
    create.add_argument(
        "--run",
        metavar="NAME",
        help="agent tokens: bind to the run of this name, so several ranks (tokens) write to one run; "
        "without it an agent token writes only to the runs it created",
    )
    create.add_argument("--expires-in", metavar="DURATION", help="e.g. 90d, 12h, 30m, 3600 (seconds); default never")
    token_sub.add_parser(
        "list", help="list tokens (prefix, role, name, created, state, expiry, run); never the secret"
    )
    revoke = token_sub.add_parser("revoke", help="revoke tokens by name or by prefix")
    which = revoke.add_mutually_exclusive_group(required=True)
    which.add_argument("--name")
    which.add_argument("--prefix")
    token.set_defaults(func=_token)

    prune = sub.add_parser(
        "prune", help="delete old events, stats intervals and batch receipts in batches; totals are kept"
    )
    prune.add_argument("--older-than", required=True, metavar="DURATION",
                       help="what was received longer ago than this, e.g. 90d (at least 1d)")
    prune.add_argument("--batch-size", type=int, default=5000, help="rows per transaction (default 5000)")
    prune.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    prune.set_defaults(func=_prune)

    grafana = sub.add_parser("grafana", help="Grafana dashboards")
    grafana_sub = grafana.add_subparsers(dest="grafana_command", required=True)
    push = grafana_sub.add_parser("push", help="push dashboards and provisioning to a Grafana server")
    push.add_argument("--url", required=True)
    push.add_argument("--token", required=True)
    push.add_argument("--dashboards", required=True, metavar="DIR")
    push.add_argument("--provisioning", required=True, metavar="DIR")
    grafana.set_defaults(func=_grafana)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return int(args.func(args, Settings()))


if __name__ == "__main__":
    sys.exit(main())
