"""List and revoke approval grants.

    python -m vllm_allowed_tools.approvals.cli --db PATH list [--subject S] [--all] [--json]
    python -m vllm_allowed_tools.approvals.cli --db PATH revoke GRANT_ID [--reason TEXT]
    python -m vllm_allowed_tools.approvals.cli --db PATH purge --older-than-days N

``--db`` takes a SQLite path or a ``postgresql://`` DSN (default: ``$VLLM_ALLOWED_TOOLS_GRANT_STORE``).
``list`` shows live grants (``--all``: revoked and expired ones too). A revocation takes effect for
every API server sharing the store at its next proposal. Exit status: 0 done, 1 no such (live)
grant, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence

from ..settings import current
from .store import Grant, open_store

__all__ = ["main"]


def _when(ts: float | None) -> str:
    if ts is None:
        return "never"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _state(grant: Grant, now: float) -> str:
    if grant.revoked_at is not None:
        return "revoked"
    if grant.expires_at is not None and now >= grant.expires_at:
        return "expired"
    return "live"


def _table(grants: Sequence[Grant], now: float) -> str:
    header = ("GRANT", "STATE", "SUBJECT", "SCOPE", "SESSION", "TOOL", "ARGS", "CREATED", "EXPIRES")
    rows = [header]
    for g in grants:
        rows.append((g.id, _state(g, now), g.subject, g.scope, g.session or "-",
                     g.identity.flat_name, "bound" if g.arguments_digest else "any",
                     _when(g.created_at), _when(g.expires_at)))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def _days(text: str) -> float:
    """An ``--older-than-days`` value: a finite number >= 0. A negative age would put the cut-off
    in the future and purge every closed record and dead grant at once, so it is a usage error."""
    try:
        days = float(text)
    except ValueError:
        days = math.nan
    if not math.isfinite(days) or days < 0:
        raise argparse.ArgumentTypeError(
            f"must be a number of days >= 0 (0 purges everything already closed), got {text!r}")
    return days


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vllm_allowed_tools.approvals.cli",
                                     description="List and revoke tool-call approval grants.")
    parser.add_argument("--db", default=current().grant_store,
                        help="SQLite path or postgresql:// DSN (default: "
                             "$VLLM_ALLOWED_TOOLS_GRANT_STORE)")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list grants")
    ls.add_argument("--subject", help="only this principal's grants")
    ls.add_argument("--all", action="store_true", help="include revoked and expired grants")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    rv = sub.add_parser("revoke", help="revoke a grant")
    rv.add_argument("grant_id")
    rv.add_argument("--reason", help="recorded with the revocation")
    pg = sub.add_parser("purge", help="delete old closed elicitations and dead grants")
    pg.add_argument("--older-than-days", type=_days, required=True, metavar="DAYS",
                    help="only rows closed (resolved, expired, revoked) more than DAYS ago (>= 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.db:
        parser.error("--db is required (or set VLLM_ALLOWED_TOOLS_GRANT_STORE)")
    if not str(args.db).startswith(("postgresql://", "postgres://", "sqlite:")) \
            and not os.path.exists(args.db):
        print(f"error: no grant store at {args.db!r}", file=sys.stderr)
        return 2
    store = open_store(args.db)
    now = time.time()
    try:
        if args.command == "list":
            grants = store.list_grants(subject=args.subject, include_inactive=args.all, now=now)
            if args.json:
                for grant in grants:
                    print(json.dumps({**grant.to_json(), "state": _state(grant, now)},
                                     sort_keys=True))
            elif grants:
                print(_table(grants, now))
            else:
                print("no grants" if args.all else "no live grants")
            return 0
        if args.command == "revoke":
            if store.revoke_grant(args.grant_id, now=now, reason=args.reason):
                print(f"revoked {args.grant_id}")
                return 0
            existing = store.get_grant(args.grant_id)
            if existing is None:
                print(f"error: no grant {args.grant_id!r}", file=sys.stderr)
            else:
                print(f"error: grant {args.grant_id!r} was already revoked at "
                      f"{_when(existing.revoked_at)}", file=sys.stderr)
            return 1
        if args.command == "purge":
            removed = store.purge(before=now - args.older_than_days * 86_400)
            print(f"removed {removed} rows")
            return 0
    finally:
        store.close()
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
