"""The grant store for several hosts: the shared SQL on PostgreSQL through psycopg 3.

A consumption locks its row (``SELECT ... FOR UPDATE``) so racing servers serialize on it; psycopg
is imported only when this store is opened.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..approval_errors import GrantStoreUnavailable
from .sql import DEFAULT_STORE_TIMEOUT_S, SCHEMA, SQLStore, migrate, read_principal_secret

__all__ = ["PostgresGrantStore"]


class PostgresGrantStore(SQLStore):
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
                for statement in SCHEMA:
                    cur.execute(statement)
                cur.execute("SELECT column_name FROM information_schema.columns WHERE "
                            "table_name = 'elicitations' AND table_schema = current_schema()")
                migrate(cur, [row[0] for row in cur.fetchall()])
                self.principal_secret = read_principal_secret(cur)
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
        with self._store_errors(), self._conn().cursor() as cur:
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
