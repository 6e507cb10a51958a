"""The store logic both backends share: the schema, rows to records and back, and the queries.

Written once as portable SQL with ``?`` placeholders over a DB-API cursor; a backend supplies
connections, transactions and the translation of its driver's errors into
:class:`~..errors.GrantStoreUnavailable`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ...request import ToolIdentity
from ...settings import Settings
from .records import TERMINAL_STATUSES, ConsumeResult, ElicitationRecord, ExecutionRecord, Grant

__all__ = [
    "DEFAULT_STORE_TIMEOUT_S",
    "ENV_STORE_TIMEOUT",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SQLStore",
    "migrate",
    "read_principal_secret",
]

#: 2: the ``store_secrets`` table (the principal secret). An older server opening a version-2 file
#: refuses it: it would derive other principals from the same credentials.
#: 3: ``elicitations.tool_type`` (``function`` or ``custom``: a paused ``custom_tool_call``), added
#: to an earlier table by :func:`migrate`; an older server would release a custom call as a function.
SCHEMA_VERSION = 3

#: Environment variable: seconds a store operation may wait (SQLite busy timeout, PostgreSQL
#: connect and lock timeouts) before the store counts as unavailable (:mod:`...settings`).
ENV_STORE_TIMEOUT = Settings.variable("grant_store_timeout_s")
DEFAULT_STORE_TIMEOUT_S: float = Settings.model_fields["grant_store_timeout_s"].default


#: Portable DDL ("?" placeholders elsewhere; the PostgreSQL backend rewrites them to "%s").
SCHEMA = [
    """CREATE TABLE IF NOT EXISTS elicitations (
        id TEXT PRIMARY KEY,
        elicitation_type TEXT NOT NULL,
        principal TEXT NOT NULL,
        session TEXT NOT NULL,               -- '' when the request had no session
        batch_id TEXT NOT NULL,
        call_id TEXT NOT NULL,
        namespace TEXT NOT NULL,             -- '' for a top-level function
        name TEXT NOT NULL,
        arguments TEXT NOT NULL,
        arguments_digest TEXT NOT NULL,
        definition_digest TEXT NOT NULL,
        requested_scopes TEXT NOT NULL,      -- JSON list
        bind_arguments INTEGER NOT NULL,
        grant_expires_in TEXT NOT NULL,      -- JSON object scope -> seconds
        message TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL,
        status TEXT NOT NULL,
        response_id TEXT,
        action TEXT,
        scope TEXT,
        reason TEXT,
        resolved_at DOUBLE PRECISION,
        grant_id TEXT,
        tool_type TEXT NOT NULL DEFAULT 'function',
        CHECK (tool_type IN ('function', 'custom')),
        CHECK (status IN ('pending', 'accepted', 'declined', 'cancelled', 'expired', 'unanswered',
                          'invalidated')),
        CHECK ((status = 'pending') = (response_id IS NULL))
    )""",
    "CREATE INDEX IF NOT EXISTS elicitations_batch ON elicitations (batch_id, status)",
    """CREATE TABLE IF NOT EXISTS grants (
        id TEXT PRIMARY KEY,
        subject TEXT NOT NULL,
        session TEXT,                        -- NULL for scope 'always'
        namespace TEXT NOT NULL,             -- '' for a top-level function
        name TEXT NOT NULL,
        definition_digest TEXT NOT NULL,
        arguments_digest TEXT,
        scope TEXT NOT NULL,
        origin_elicitation_id TEXT NOT NULL UNIQUE REFERENCES elicitations (id),
        origin_response_id TEXT NOT NULL,
        origin_session TEXT,
        created_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION,
        revoked_at DOUBLE PRECISION,
        revoked_reason TEXT,
        CHECK (scope IN ('session', 'always')),
        CHECK ((scope = 'session') = (session IS NOT NULL))
    )""",
    "CREATE INDEX IF NOT EXISTS grants_lookup ON grants (subject, name, namespace)",
    # one row per approved server-side call (a tool the server runs itself): claimed just before
    # it runs, its output recorded once it ran; a claim without an output is a call whose outcome
    # is unknown (the server stopped while it ran): it is never run again
    """CREATE TABLE IF NOT EXISTS server_executions (
        elicitation_id TEXT PRIMARY KEY,
        recipient TEXT NOT NULL,
        arguments_digest TEXT NOT NULL,
        claimed_at DOUBLE PRECISION NOT NULL,
        finished_at DOUBLE PRECISION,
        output TEXT
    )""",
    """CREATE TABLE IF NOT EXISTS store_secrets (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL                  -- hex
    )""",
]

_PRINCIPAL_SECRET = "principal"

#: the column an earlier table lacks, as :func:`migrate` adds it (the CHECK of a new table aside)
_TOOL_TYPE_COLUMN = "tool_type TEXT NOT NULL DEFAULT 'function'"


def migrate(cur: Any, columns: Sequence[str]) -> None:
    """Bring an ``elicitations`` table created by an earlier version up to :data:`SCHEMA`:
    ``columns`` are the names it has. Its records were all of function calls (the default)."""
    if "tool_type" not in columns:
        cur.execute(f"ALTER TABLE elicitations ADD COLUMN {_TOOL_TYPE_COLUMN}")


def read_principal_secret(cur: Any) -> bytes:
    """The store's principal secret, generated on first use (inside the schema transaction, so
    concurrent first starts agree on one: the loser's insert does nothing and it reads the winner's).
    """
    cur.execute("INSERT INTO store_secrets (name, value) VALUES (?, ?) ON CONFLICT (name) DO NOTHING",
                (_PRINCIPAL_SECRET, secrets.token_hex(32)))
    cur.execute("SELECT value FROM store_secrets WHERE name = ?", (_PRINCIPAL_SECRET,))
    return bytes.fromhex(cur.fetchone()[0])


_ELICITATION_COLUMNS = (
    "id", "elicitation_type", "principal", "session", "batch_id", "call_id", "namespace", "name",
    "arguments", "arguments_digest", "definition_digest", "requested_scopes", "bind_arguments",
    "grant_expires_in", "message", "created_at", "expires_at", "status", "response_id", "action",
    "scope", "reason", "resolved_at", "grant_id", "tool_type")
_GRANT_COLUMNS = (
    "id", "subject", "session", "namespace", "name", "definition_digest", "arguments_digest",
    "scope", "origin_elicitation_id", "origin_response_id", "origin_session", "created_at",
    "expires_at", "revoked_at", "revoked_reason")
_E_COLS = ", ".join(_ELICITATION_COLUMNS)
_G_COLS = ", ".join(_GRANT_COLUMNS)


def _elicitation_row(r: ElicitationRecord) -> tuple[Any, ...]:
    return (r.id, r.elicitation_type, r.principal, r.session or "", r.batch_id, r.call_id,
            r.namespace or "", r.name, r.arguments, r.arguments_digest, r.definition_digest,
            json.dumps(list(r.requested_scopes)), int(r.bind_arguments),
            json.dumps(r.grant_expires_in, sort_keys=True), r.message, r.created_at, r.expires_at,
            r.status, r.response_id, r.action, r.scope, r.reason, r.resolved_at, r.grant_id,
            r.tool_type)


def _elicitation_from(row: Sequence[Any]) -> ElicitationRecord:
    d = dict(zip(_ELICITATION_COLUMNS, row))
    d["session"] = d["session"] or None
    d["namespace"] = d["namespace"] or None
    d["requested_scopes"] = tuple(json.loads(d["requested_scopes"]))
    d["bind_arguments"] = bool(d["bind_arguments"])
    d["grant_expires_in"] = json.loads(d["grant_expires_in"])
    return ElicitationRecord(**d)


def _grant_row(g: Grant) -> tuple[Any, ...]:
    return (g.id, g.subject, g.session, g.namespace or "", g.name, g.definition_digest,
            g.arguments_digest, g.scope, g.origin_elicitation_id, g.origin_response_id,
            g.origin_session, g.created_at, g.expires_at, g.revoked_at, g.revoked_reason)


def _grant_from(row: Sequence[Any]) -> Grant:
    d = dict(zip(_GRANT_COLUMNS, row))
    d["namespace"] = d["namespace"] or None
    return Grant(**d)


class SQLStore:
    """The store logic over a DB-API connection; subclasses supply connections and transactions."""

    #: called inside every write transaction just before COMMIT (tests use it to kill a writer there)
    before_commit: Callable[[], None] | None = None

    def _drop(self) -> None:
        """Forget this thread's connection (it is reopened, and re-checked, on the next call).
        Subclasses keep ``_local`` (conn, pid), ``_all`` and ``_all_lock``."""
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None and self._local.pid == os.getpid():
            with self._all_lock:
                if conn in self._all:
                    self._all.remove(conn)
            with contextlib.suppress(Exception):   # a broken connection may fail to close
                conn.close()

    def _tx(self) -> Any:  # context manager yielding a cursor-like object with execute/fetch*
        raise NotImplementedError

    def _translate(self, exc: BaseException) -> BaseException:
        """The store's own error for a driver error (``exc`` itself when it is not one)."""
        return exc

    @contextmanager
    def _store_errors(self) -> Iterator[None]:
        """Driver errors leave the store as its own errors (GrantStoreUnavailable), others as is."""
        try:
            yield
        except BaseException as exc:
            translated = self._translate(exc)
            if translated is exc:
                raise
            raise translated from exc

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    def _lock_clause(self) -> str:
        return ""

    def ping(self) -> None:
        """A cheap read of the schema: raises :class:`GrantStoreUnavailable` when the store is down."""
        self._read("SELECT 1 FROM grants WHERE id = ?", ("",))

    # -- elicitations

    def add_elicitations(self, records: Sequence[ElicitationRecord]) -> None:
        placeholders = ", ".join("?" for _ in _ELICITATION_COLUMNS)
        with self._tx() as cur:
            for record in records:
                if record.status != "pending":
                    raise ValueError("only pending elicitations can be added")
                cur.execute(f"INSERT INTO elicitations ({_E_COLS}) VALUES ({placeholders})",
                            _elicitation_row(record))

    def get_elicitation(self, elicitation_id: str) -> ElicitationRecord | None:
        rows = self._read(f"SELECT {_E_COLS} FROM elicitations WHERE id = ?", (elicitation_id,))
        return _elicitation_from(rows[0]) if rows else None

    def consume(self, elicitation_id: str, *, principal: str, session: str | None,
                response_id: str, status: str, scope: str | None, reason: str | None, now: float,
                grant: Grant | None = None, ignore_expiry: bool = False) -> ConsumeResult:
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"not a terminal status: {status!r}")
        if grant is not None and (status != "accepted" or grant.origin_elicitation_id != elicitation_id):
            raise ValueError("a grant can only be minted by accepting its own elicitation")
        with self._tx() as cur:
            cur.execute(f"SELECT {_E_COLS} FROM elicitations WHERE id = ?{self._lock_clause()}",
                        (elicitation_id,))
            row = cur.fetchone()
            if row is None:
                return ConsumeResult("missing")
            record = _elicitation_from(row)
            if record.principal != principal or record.session != session:
                return ConsumeResult("missing")
            if record.status != "pending":
                return ConsumeResult("already", record)
            expired = not ignore_expiry and now >= record.expires_at
            if expired:
                status, grant, scope = "expired", None, None
            action = {"accepted": "accept", "declined": "decline", "cancelled": "cancel"}.get(status)
            cur.execute(
                "UPDATE elicitations SET status = ?, response_id = ?, action = ?, scope = ?, "
                "reason = ?, resolved_at = ?, grant_id = ? WHERE id = ? AND status = 'pending'",
                (status, response_id, action, scope, reason, now,
                 grant.id if grant is not None else None, elicitation_id))
            if cur.rowcount != 1:  # cannot happen under the lock; never report a consumption we
                raise RuntimeError("elicitation changed during its own transaction")  # didn't make
            if grant is not None:
                cur.execute(f"INSERT INTO grants ({_G_COLS}) VALUES "
                            f"({', '.join('?' for _ in _GRANT_COLUMNS)})", _grant_row(grant))
            if self.before_commit is not None:
                self.before_commit()
        done = replace(record, status=status, response_id=response_id, action=action, scope=scope,
                       reason=reason, resolved_at=now, grant_id=grant.id if grant else None)
        return ConsumeResult("expired" if expired else "consumed", done, grant)

    def pending_in_batches(self, batch_ids: Sequence[str]) -> list[ElicitationRecord]:
        ids = sorted(set(batch_ids))
        if not ids:
            return []
        marks = ", ".join("?" for _ in ids)
        rows = self._read(f"SELECT {_E_COLS} FROM elicitations WHERE status = 'pending' AND "
                          f"batch_id IN ({marks}) ORDER BY created_at, id", ids)
        return [_elicitation_from(row) for row in rows]

    # -- server-side executions

    def claim_execution(self, elicitation_id: str, *, recipient: str, arguments_digest: str,
                        now: float) -> ExecutionRecord | None:
        """Claim the one execution of an approved server-side call: None when this call claimed
        it (run it now, then :meth:`finish_execution`), else the earlier claim (never run again)."""
        with self._tx() as cur:
            cur.execute("INSERT INTO server_executions (elicitation_id, recipient, arguments_digest, "
                        "claimed_at) VALUES (?, ?, ?, ?) ON CONFLICT (elicitation_id) DO NOTHING",
                        (elicitation_id, recipient, arguments_digest, now))
            claimed = cur.rowcount == 1
            if self.before_commit is not None:
                self.before_commit()
        return None if claimed else self.get_execution(elicitation_id)

    def finish_execution(self, elicitation_id: str, *, output: str, now: float) -> None:
        with self._tx() as cur:
            cur.execute("UPDATE server_executions SET output = ?, finished_at = ? "
                        "WHERE elicitation_id = ? AND finished_at IS NULL",
                        (output, now, elicitation_id))

    def get_execution(self, elicitation_id: str) -> ExecutionRecord | None:
        rows = self._read("SELECT elicitation_id, recipient, arguments_digest, claimed_at, "
                          "finished_at, output FROM server_executions WHERE elicitation_id = ?",
                          (elicitation_id,))
        return ExecutionRecord(*rows[0]) if rows else None

    # -- grants

    def find_grants(self, *, subject: str, session: str | None, identity: ToolIdentity,
                    definition_digest: str, arguments_digest: str, now: float) -> list[Grant]:
        params: list[Any] = [subject, identity.name, identity.namespace or "", definition_digest,
                             now, arguments_digest]
        if session is None:  # no session: only `always` grants can apply
            scope_clause = "scope = 'always'"
        else:
            scope_clause = "(scope = 'always' OR (scope = 'session' AND session = ?))"
            params.append(session)
        rows = self._read(
            f"SELECT {_G_COLS} FROM grants WHERE subject = ? AND name = ? AND namespace = ? "
            "AND definition_digest = ? AND revoked_at IS NULL "
            "AND (expires_at IS NULL OR expires_at > ?) "
            "AND (arguments_digest IS NULL OR arguments_digest = ?) "
            f"AND {scope_clause} ORDER BY created_at, id", params)
        return [_grant_from(row) for row in rows]

    def get_grant(self, grant_id: str) -> Grant | None:
        rows = self._read(f"SELECT {_G_COLS} FROM grants WHERE id = ?", (grant_id,))
        return _grant_from(rows[0]) if rows else None

    def list_grants(self, *, subject: str | None = None, include_inactive: bool = False,
                    now: float) -> list[Grant]:
        sql, params = f"SELECT {_G_COLS} FROM grants WHERE 1 = 1", []
        if subject is not None:
            sql += " AND subject = ?"
            params.append(subject)
        if not include_inactive:
            sql += " AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)"
            params.append(now)
        return [_grant_from(row) for row in self._read(sql + " ORDER BY created_at, id", params)]

    def revoke_grant(self, grant_id: str, *, now: float, reason: str | None = None) -> bool:
        with self._tx() as cur:
            cur.execute("UPDATE grants SET revoked_at = ?, revoked_reason = ? "
                        "WHERE id = ? AND revoked_at IS NULL", (now, reason, grant_id))
            changed = cur.rowcount == 1
            if self.before_commit is not None:
                self.before_commit()
        return changed

    def purge(self, *, before: float) -> int:
        with self._tx() as cur:
            cur.execute("DELETE FROM grants WHERE (revoked_at IS NOT NULL AND revoked_at < ?) "
                        "OR (expires_at IS NOT NULL AND expires_at < ?)", (before, before))
            count = cur.rowcount
            cur.execute("DELETE FROM elicitations WHERE status <> 'pending' AND resolved_at < ? "
                        "AND id NOT IN (SELECT origin_elicitation_id FROM grants)", (before,))
            count += cur.rowcount
            cur.execute("DELETE FROM elicitations WHERE status = 'pending' AND expires_at < ?",
                        (before,))
            count += cur.rowcount
        return count
