"""Where pending elicitations and grants live: the :class:`GrantStore` protocol and two backends.

Two kinds of record, kept apart as the proposal's discussion asks:

* :class:`ElicitationRecord`: the server's own record of one proposed call it paused (call id, exact
  arguments, both digests, offered scopes, expiry, who and which session it was asked of) and, once
  answered, how (``status``, ``response_id``, ``scope``, ``reason``, the minted ``grant_id``). The
  transcript's items are only pointers to it: the server never trusts what the client echoes.
* :class:`Grant`: a reusable authority minted by a ``session`` / ``always`` acceptance: subject
  (the authenticated principal), session (``session`` scope only), tool identity, definition
  digest, optional argument digest, scope, origin ids, expiry, revocation.

:meth:`GrantStore.consume` is the heart: it turns a pending elicitation into a terminal one and
inserts the grant (if any) **in one transaction**, only if the record is still ``pending`` and not
expired. Two follow-ups racing on one elicitation: exactly one consumes it; the other sees it
already consumed. A writer killed mid-transaction leaves neither the status change nor the grant.

Backends:

* :class:`SQLiteGrantStore` (the embedded default): one file, WAL journal, ``synchronous=FULL`` (a
  consumed elicitation must survive a power cut, or it could be replayed), writes in ``BEGIN
  IMMEDIATE`` transactions (the write lock is taken up front, so concurrent writers queue on
  ``busy_timeout`` instead of failing on a lock upgrade), one connection per thread and per
  process. Safe for several API server processes on one host. Not for network file systems.
* :class:`PostgresGrantStore` (several hosts): the same SQL through :mod:`psycopg` (3), the pending
  row locked with ``SELECT ... FOR UPDATE`` while it is consumed.

**Secrets at rest.** Each store holds one random **principal secret** (32 bytes, table
``store_secrets``), generated when the schema is created and read once per store object
(:attr:`GrantStore.principal_secret`): principals are an HMAC of the caller's credential under it
(:func:`~.wire.principal_from_headers`), so every API server process and replica sharing the store
derives the same principal, and a principal seen elsewhere (a grant listing, a log) does not let
anyone test guesses of weak API keys without also reading the store. The SQLite file is therefore
created owner-only (``0600``), and so are its ``-wal`` and ``-shm`` files (SQLite gives them the
main file's mode); an existing file keeps the mode its operator gave it (a warning is logged when
others may read it).

All methods are blocking: call them from a worker thread (``asyncio.to_thread``) in an event loop.
Times are Unix seconds (floats; wire ``expires_at`` are whole seconds).

**When the store is unavailable** every method raises :class:`~.errors.GrantStoreUnavailable` (HTTP
503) instead of a driver error, and a failed write leaves nothing behind (its transaction is rolled
back whole). Nothing is cached: the next call tries again, so the store recovers by itself when it
comes back. SQLite counts as unavailable when its file is missing (it is never silently re-created
after start-up: grants written into a fresh file would hide the loss of the old ones), when the path
now names another file than the one opened (replaced or restored: connections reopen it, and use it
if it is a grant store), when it is not a database or lacks the schema, when a write waits for
another process's lock longer than the busy timeout (``VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT``,
default 5 s), and on I/O errors. PostgreSQL: connection refused or lost (``connect_timeout`` and
``lock_timeout`` are the same timeout). :meth:`ping` is a cheap read the server uses before it
starts a request that may need the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from ..request import ToolIdentity
from .errors import GrantStoreUnavailable
from .items import TOOL_CALL_APPROVAL, ToolCallApproval

__all__ = [
    "DEFAULT_STORE_TIMEOUT_S",
    "ENV_STORE_TIMEOUT",
    "TERMINAL_STATUSES",
    "ConsumeResult",
    "ElicitationRecord",
    "Grant",
    "GrantStore",
    "PostgresGrantStore",
    "SQLiteGrantStore",
    "open_store",
    "store_timeout_from_env",
]

#: 2: the ``store_secrets`` table (the principal secret). An older server opening a version-2 file
#: refuses it: it would derive other principals from the same credentials.
SCHEMA_VERSION = 2

logger = logging.getLogger(__name__)

#: Environment variable: seconds a store operation may wait (SQLite busy timeout, PostgreSQL
#: connect and lock timeouts) before the store counts as unavailable.
ENV_STORE_TIMEOUT = "VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT"
DEFAULT_STORE_TIMEOUT_S = 5.0


def store_timeout_from_env(environ: Any = None) -> float:
    """The store timeout from ``VLLM_ALLOWED_TOOLS_GRANT_STORE_TIMEOUT`` (a positive number of
    seconds), else :data:`DEFAULT_STORE_TIMEOUT_S`."""
    raw = (os.environ if environ is None else environ).get(ENV_STORE_TIMEOUT)
    if raw in (None, ""):
        return DEFAULT_STORE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):   # also refuses NaN
        raise ValueError(f"{ENV_STORE_TIMEOUT}={raw!r}: give a positive number of seconds "
                         f"(default {DEFAULT_STORE_TIMEOUT_S:g})")
    return value

#: Terminal statuses of an elicitation record (``pending`` is the only other one).
TERMINAL_STATUSES = frozenset({"accepted", "declined", "cancelled", "expired", "unanswered",
                               "invalidated"})
_ACTION_STATUS = {"accept": "accepted", "decline": "declined", "cancel": "cancelled"}


@dataclass(frozen=True)
class ElicitationRecord:
    """The server's record of one paused call (see the module docstring)."""

    id: str
    principal: str
    session: str | None
    batch_id: str
    call_id: str
    namespace: str | None
    name: str
    arguments: str
    arguments_digest: str
    definition_digest: str
    requested_scopes: tuple[str, ...]
    bind_arguments: bool
    grant_expires_in: dict[str, int] = field(hash=False)
    message: str = ""
    created_at: float = 0.0
    expires_at: float = 0.0
    elicitation_type: str = TOOL_CALL_APPROVAL
    status: str = "pending"
    response_id: str | None = None
    action: str | None = None
    scope: str | None = None
    reason: str | None = None
    resolved_at: float | None = None
    grant_id: str | None = None

    @property
    def identity(self) -> ToolIdentity:
        return ToolIdentity(self.namespace, self.name)

    def to_item(self) -> ToolCallApproval:
        """The wire item for this record (what the client is shown)."""
        return ToolCallApproval(id=self.id, message=self.message, call_id=self.call_id,
                                name=self.name, namespace=self.namespace, arguments=self.arguments,
                                arguments_digest=self.arguments_digest,
                                tool_definition_digest=self.definition_digest,
                                requested_scopes=self.requested_scopes,
                                expires_at=int(self.expires_at))


@dataclass(frozen=True)
class Grant:
    """A reusable approval (``session`` or ``always``). ``session`` is None for ``always`` grants;
    ``origin_session`` is where it was given either way (audit)."""

    id: str
    subject: str
    session: str | None
    namespace: str | None
    name: str
    definition_digest: str
    arguments_digest: str | None
    scope: Literal["session", "always"]
    origin_elicitation_id: str
    origin_response_id: str
    origin_session: str | None
    created_at: float
    expires_at: float | None
    revoked_at: float | None = None
    revoked_reason: str | None = None

    @property
    def identity(self) -> ToolIdentity:
        return ToolIdentity(self.namespace, self.name)

    def is_live(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "subject": self.subject, "session": self.session,
                "namespace": self.namespace, "name": self.name,
                "tool": ToolIdentity(self.namespace, self.name).flat_name,
                "definition_digest": self.definition_digest,
                "arguments_digest": self.arguments_digest, "scope": self.scope,
                "origin_elicitation_id": self.origin_elicitation_id,
                "origin_response_id": self.origin_response_id,
                "origin_session": self.origin_session, "created_at": self.created_at,
                "expires_at": self.expires_at, "revoked_at": self.revoked_at,
                "revoked_reason": self.revoked_reason}


@dataclass(frozen=True)
class ConsumeResult:
    """What :meth:`GrantStore.consume` did.

    * ``consumed``: the record was pending and is now terminal with the given status; ``grant``
      (if one was passed) is stored.
    * ``expired``: it was pending but past ``expires_at``; it is now ``expired``; no grant.
    * ``already``: it was terminal before; nothing changed (``record.response_id`` says by whom).
    * ``missing``: no such record for this principal and session.
    """

    outcome: Literal["consumed", "expired", "already", "missing"]
    record: ElicitationRecord | None = None
    grant: Grant | None = None


@runtime_checkable
class GrantStore(Protocol):
    """Storage of elicitation records and grants. Every method is atomic on its own."""

    #: The store's principal secret (see the module docstring): the same bytes for every store
    #: object on the same database, for as long as the database lives.
    principal_secret: bytes

    def add_elicitations(self, records: Sequence[ElicitationRecord]) -> None:
        """Insert new pending records (all or none)."""

    def get_elicitation(self, elicitation_id: str) -> ElicitationRecord | None: ...

    def consume(self, elicitation_id: str, *, principal: str, session: str | None,
                response_id: str, status: str, scope: str | None, reason: str | None, now: float,
                grant: Grant | None = None, ignore_expiry: bool = False) -> ConsumeResult:
        """Atomically: if the record (of ``principal`` and ``session``) is pending and
        ``now < expires_at`` (or ``ignore_expiry``, for declines the server itself decides), make it
        terminal with ``status`` and insert ``grant``; see :class:`ConsumeResult`."""

    def pending_in_batches(self, batch_ids: Sequence[str]) -> list[ElicitationRecord]: ...

    def find_grants(self, *, subject: str, session: str | None, identity: ToolIdentity,
                    definition_digest: str, arguments_digest: str, now: float) -> list[Grant]:
        """Live grants (not revoked, not expired) of ``subject`` for exactly this tool identity and
        definition, of scope ``always`` or of scope ``session`` for this ``session``, whose argument
        constraint (if any) equals ``arguments_digest``; oldest first."""

    def get_grant(self, grant_id: str) -> Grant | None: ...

    def list_grants(self, *, subject: str | None = None, include_inactive: bool = False,
                    now: float) -> list[Grant]: ...

    def revoke_grant(self, grant_id: str, *, now: float, reason: str | None = None) -> bool:
        """Mark a grant revoked; False when there is no such grant or it was already revoked."""

    def purge(self, *, before: float) -> int:
        """Delete terminal elicitations resolved before ``before`` and grants that expired or were
        revoked before it; returns how many rows went. (A purged elicitation answered again is
        unknown: still nothing executes.)"""

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------------
# SQL shared by both backends ("?" placeholders; PostgreSQL's are rewritten to "%s")

_SCHEMA = [
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
    """CREATE TABLE IF NOT EXISTS store_secrets (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL                  -- hex
    )""",
]

_PRINCIPAL_SECRET = "principal"


def _principal_secret(cur: Any) -> bytes:
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
    "scope", "reason", "resolved_at", "grant_id")
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
            r.status, r.response_id, r.action, r.scope, r.reason, r.resolved_at, r.grant_id)


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


class _SQLStore:
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


# --------------------------------------------------------------------------------------------------
# SQLite

_SQLITE_SIDE_FILES = ("-wal", "-shm")


def _create_private(path: Path) -> bool:
    """Create the database file owner-only (0600) before SQLite opens it; False when it exists.

    It holds grants, pending calls' arguments and the principal secret. An explicit mode plus
    ``fchmod`` instead of changing the umask: the umask is process-wide, and other threads of the
    server create files meanwhile. Where the file cannot be created, SQLite's own open reports why.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return False
    try:
        os.fchmod(fd, 0o600)   # exactly 0600 whatever the umask (a umask may not leave us writing)
    finally:
        os.close(fd)
    return True


def _make_private(path: Path) -> None:
    """0600 for the -wal and -shm files of a database this store created. SQLite already gives
    them the main file's mode; this makes it so whatever the SQLite build does."""
    for suffix in _SQLITE_SIDE_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", 0o600)


def _warn_if_readable(path: Path) -> None:
    """An existing store keeps its operator's mode; say so when others may read its secrets."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return
    if mode & 0o077:
        logger.warning("grant store %s has mode %04o: other users may read its grants and its "
                       "principal secret; run `chmod 600 %s` (and its -wal and -shm files)",
                       path, mode, path)


class SQLiteGrantStore(_SQLStore):
    """The embedded store: one SQLite file in WAL mode (see the module docstring).

    Connections are per thread and per process (a store object inherited across ``fork`` opens its
    own), so one store object may be shared by the threads of a server. The file is created (with
    its schema) here; later connections only open an existing file, and every operation first checks
    that the path still names the file its connection opened.
    """

    def __init__(self, path: str | os.PathLike[str], *,
                 busy_timeout_s: float = DEFAULT_STORE_TIMEOUT_S) -> None:
        target = str(path)
        if target in ("", ":memory:") or target.startswith("file:"):
            raise ValueError("SQLiteGrantStore needs a file path (several connections share it)")
        self.path = Path(target)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self._create = True
        created = _create_private(self.path)
        try:
            with self._tx() as cur:
                (version,) = cur.execute("PRAGMA user_version").fetchone()
                if version > SCHEMA_VERSION:
                    raise RuntimeError(f"{self.path} holds grant store schema {version}; this "
                                       f"version of vllm-allowed-tools knows {SCHEMA_VERSION}. "
                                       "Upgrade it.")
                for statement in _SCHEMA:
                    cur.execute(statement)
                if version < SCHEMA_VERSION:
                    cur.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self.principal_secret = _principal_secret(cur)
            if created:
                _make_private(self.path)
            else:
                _warn_if_readable(self.path)
        except GrantStoreUnavailable as exc:
            raise GrantStoreUnavailable(exc.cause, store="SQLite file", detail=(
                f"cannot open the grant store {self.path}: {exc.detail}. Check the path "
                "(VLLM_ALLOWED_TOOLS_GRANT_STORE), that its folder exists and is writable, and that "
                "no other program holds a lock on it")) from exc
        finally:
            self._create = False

    # -- connections and their health

    def _unavailable(self, cause: str, detail: str) -> GrantStoreUnavailable:
        return GrantStoreUnavailable(cause, store="SQLite file",
                                     detail=f"grant store {self.path}: {detail}")

    def _file_id(self) -> tuple[int, int]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError as exc:
            raise self._unavailable("missing", "the database file is gone (moved, deleted, or its "
                                    "volume unmounted); restore it") from exc
        except OSError as exc:
            raise self._unavailable("io_error", f"cannot stat the database file: {exc}") from exc
        return st.st_dev, st.st_ino

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            if self._file_id() == self._local.file_id:
                return conn
            self._drop()   # the path names another file now: open that one (and check it)
        if self._create:
            conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        else:   # never re-create a store that went away: that would hide the loss of its grants
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=rw", uri=True,
                                   timeout=self.busy_timeout_s, isolation_level=None)
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(f"cannot put {self.path} in WAL mode (got journal_mode={mode}); "
                                   "use a local file system")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout_s * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")
            file_id = self._file_id()
        except BaseException:
            conn.close()
            raise
        self._local.conn, self._local.pid, self._local.file_id = conn, os.getpid(), file_id
        with self._all_lock:
            self._all.append(conn)
        return conn

    def _translate(self, exc: BaseException) -> BaseException:
        """A driver error that means "the store is not usable now" -> GrantStoreUnavailable (and
        this thread's connection is dropped); anything else (a bug, a constraint) as it is."""
        if isinstance(exc, GrantStoreUnavailable):
            self._drop()
            return exc
        if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, (
                sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.DataError,
                sqlite3.NotSupportedError)):
            return exc
        self._drop()
        text = str(exc)
        lowered = text.lower()
        if "locked" in lowered or "busy" in lowered:
            cause = "locked"
            text += (f" (another process held the database's write lock for more than the "
                     f"{self.busy_timeout_s:g} s busy timeout)")
        elif "not a database" in lowered or "malformed" in lowered:
            cause = "not_a_database"
        elif "no such table" in lowered:
            cause = "not_a_grant_store"
        elif "unable to open" in lowered:
            cause = "missing"
        elif "readonly" in lowered or "read-only" in lowered:
            cause = "read_only"
        else:
            cause = "io_error"
        return self._unavailable(cause, text)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Cursor]:
        with self._store_errors():
            conn = self._conn()
            cur = conn.cursor()
            cur.execute("BEGIN IMMEDIATE")
        try:
            with self._store_errors():
                try:
                    yield cur
                    cur.execute("COMMIT")
                except BaseException:
                    try:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                    raise
        finally:
            try:
                cur.close()
            except sqlite3.Error:
                pass

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._store_errors():
            return self._conn().execute(sql, tuple(params)).fetchall()

    def close(self) -> None:
        """Close every connection this process opened (other threads must be done with it)."""
        with self._all_lock:
            for conn in self._all:
                try:
                    conn.close()
                except sqlite3.ProgrammingError:  # opened in another thread
                    pass
            self._all.clear()
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"SQLiteGrantStore({str(self.path)!r})"


# --------------------------------------------------------------------------------------------------
# PostgreSQL


class PostgresGrantStore(_SQLStore):
    """The multi-host store: PostgreSQL through psycopg 3 (``pip install "psycopg[binary]"``).

    One connection per thread and per process, autocommit outside explicit transactions; a
    consumption locks its row (``SELECT ... FOR UPDATE``) so racing servers serialize on it. A lost
    or refused connection is :class:`GrantStoreUnavailable`; the next call connects again.
    """

    def __init__(self, dsn: str, *, timeout_s: float = DEFAULT_STORE_TIMEOUT_S) -> None:
        try:
            import psycopg  # noqa: F401
        except ModuleNotFoundError as exc:
            raise RuntimeError("PostgresGrantStore needs psycopg 3: pip install \"psycopg[binary]\""
                               ) from exc
        self.dsn = dsn
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._all: list[Any] = []
        self._all_lock = threading.Lock()
        try:
            with self._tx() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(727274)")  # one schema creator at a time
                for statement in _SCHEMA:
                    cur.execute(statement)
                self.principal_secret = _principal_secret(cur)
        except GrantStoreUnavailable as exc:
            raise GrantStoreUnavailable(exc.cause, store="PostgreSQL", detail=(
                f"cannot open the grant store: {exc.detail}. Check the DSN "
                "(VLLM_ALLOWED_TOOLS_GRANT_STORE) and that the server is up")) from exc

    def _conn(self) -> Any:
        import psycopg

        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid() and not conn.closed:
            return conn
        seconds = max(1, round(self.timeout_s))
        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=seconds)
        conn.execute(f"SET lock_timeout = {int(self.timeout_s * 1000)}")
        self._local.conn, self._local.pid = conn, os.getpid()
        with self._all_lock:
            self._all.append(conn)
        return conn

    def _translate(self, exc: BaseException) -> BaseException:
        import psycopg

        if isinstance(exc, GrantStoreUnavailable):
            return exc
        if not isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)):
            return exc
        self._drop()
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        cause = "locked" if isinstance(exc, psycopg.errors.LockNotAvailable) else "unreachable"
        return GrantStoreUnavailable(cause, store="PostgreSQL",
                                     detail=f"PostgreSQL grant store: {type(exc).__name__}: {text}")

    @staticmethod
    def _sql(sql: str) -> str:
        return sql.replace("%", "%%").replace("?", "%s")

    def _lock_clause(self) -> str:
        return " FOR UPDATE"

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        with self._store_errors():
            conn = self._conn()
            with conn.transaction(), conn.cursor() as raw:
                yield _PgCursor(raw, self._sql)

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._store_errors():
            with self._conn().cursor() as cur:
                cur.execute(self._sql(sql), tuple(params))
                return cur.fetchall()

    def close(self) -> None:
        with self._all_lock:
            for conn in self._all:
                conn.close()
            self._all.clear()
        self._local = threading.local()

    def __repr__(self) -> str:
        return "PostgresGrantStore(...)"


class _PgCursor:
    """A psycopg cursor that takes the shared "?" SQL."""

    def __init__(self, cur: Any, translate: Callable[[str], str]) -> None:
        self._cur, self._translate = cur, translate

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _PgCursor:
        self._cur.execute(self._translate(sql), tuple(params))
        return self

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def fetchall(self) -> Any:
        return self._cur.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount


def open_store(target: str | os.PathLike[str] | GrantStore, *,
               timeout_s: float | None = None) -> GrantStore:
    """A store from a target: a store object as is; ``postgresql://...`` / ``postgres://...``
    -> :class:`PostgresGrantStore`; ``sqlite:///abs/path``, ``sqlite:rel/path`` or a plain path
    -> :class:`SQLiteGrantStore`. ``timeout_s``: see :data:`ENV_STORE_TIMEOUT` (default from it)."""
    if isinstance(target, _SQLStore) or (not isinstance(target, (str, os.PathLike))
                                         and isinstance(target, GrantStore)):
        return target  # type: ignore[return-value]
    text = os.fspath(target)
    timeout = store_timeout_from_env() if timeout_s is None else timeout_s
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresGrantStore(text, timeout_s=timeout)
    if text.startswith("sqlite://"):
        text = text[len("sqlite://"):]
    elif text.startswith("sqlite:"):
        text = text[len("sqlite:"):]
    return SQLiteGrantStore(text, busy_timeout_s=timeout)
