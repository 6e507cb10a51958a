"""The embedded grant store: one SQLite file in WAL mode, shared by the API server processes of one
host (not for network file systems).

A consumed elicitation must survive a power cut, or it could be replayed: hence ``synchronous=FULL``
and writes in ``BEGIN IMMEDIATE`` transactions. The file holds secrets, so it is created owner-only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..approval_errors import GrantStoreUnavailable
from .sql import (
    DEFAULT_STORE_TIMEOUT_S,
    SCHEMA,
    SCHEMA_VERSION,
    SQLStore,
    migrate,
    read_principal_secret,
)

__all__ = ["SQLiteGrantStore"]

logger = logging.getLogger(__name__)

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


class SQLiteGrantStore(SQLStore):
    """The embedded store: one SQLite file in WAL mode, ``synchronous=FULL``, writes in ``BEGIN
    IMMEDIATE`` transactions (concurrent writers queue on the busy timeout).

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
                for statement in SCHEMA:
                    cur.execute(statement)
                if version < SCHEMA_VERSION:
                    migrate(cur, [row[1] for row in
                                  cur.execute("PRAGMA table_info(elicitations)").fetchall()])
                    cur.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self.principal_secret = read_principal_secret(cur)
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
