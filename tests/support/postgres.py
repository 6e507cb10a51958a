"""A throwaway PostgreSQL server for tests and benchmarks (initdb + pg_ctl), stoppable and
restartable on the same data directory (the grant-store outage tests stop it mid-run).

    with ThrowawayPostgres.start() as pg:    # raises PostgresUnavailable with the reason
        dsn = pg.dsn
        pg.stop(); ...; pg.restart()

Needs the PostgreSQL server binaries on PATH and, when running as root, a ``postgres`` user
(PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

__all__ = ["PostgresUnavailable", "ThrowawayPostgres"]


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (the message says why)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThrowawayPostgres:
    def __init__(self, folder: str, port: int, prefix: list[str], pg_ctl: str) -> None:
        self.folder, self.port, self._prefix, self._pg_ctl = folder, port, prefix, pg_ctl
        self.data = os.path.join(folder, "data")
        self.dsn = f"postgresql://vat@/postgres?host={folder}&port={port}"

    def _run(self, cmd: list[str]) -> subprocess.CompletedProcess[str]:
        if self._prefix:
            cmd = [*self._prefix, " ".join(f"'{c}'" for c in cmd)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)

    @classmethod
    def start(cls) -> ThrowawayPostgres:
        initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
        if not (initdb and pg_ctl):
            raise PostgresUnavailable("no PostgreSQL server binaries (initdb, pg_ctl) on PATH")
        try:
            import psycopg  # noqa: F401
        except ModuleNotFoundError as exc:
            raise PostgresUnavailable("psycopg is not installed (pip install 'psycopg[binary]')"
                                      ) from exc
        prefix: list[str] = []
        if os.geteuid() == 0:
            if subprocess.run(["id", "postgres"], capture_output=True, check=False).returncode:
                raise PostgresUnavailable("running as root without a `postgres` user")
            prefix = ["su", "postgres", "-s", "/bin/sh", "-c"]
        folder = tempfile.mkdtemp(prefix="vat-pg-")
        os.chmod(folder, 0o777)
        pg = cls(folder, _free_port(), prefix, pg_ctl)
        proc = pg._run([initdb, "-D", pg.data, "-A", "trust", "-U", "vat", "--no-sync"])
        if proc.returncode != 0:
            shutil.rmtree(folder, ignore_errors=True)
            raise PostgresUnavailable(f"initdb failed: {proc.stderr.strip()[:300]}")
        try:
            pg.restart()
        except PostgresUnavailable:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return pg

    def restart(self) -> None:
        """Start the server (again) on the same data directory and port."""
        proc = self._run([self._pg_ctl, "-D", self.data, "-l", os.path.join(self.folder, "log"),
                          "-w", "-o", (f"-p {self.port} -k {self.folder} -c listen_addresses= "
                                       "-c fsync=off"), "start"])
        if proc.returncode != 0:
            raise PostgresUnavailable(f"the server did not start: {proc.stderr.strip()[:300]}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: clients are disconnected; ``immediate``: like a crash)."""
        self._run([self._pg_ctl, "-D", self.data, "-m", mode, "-w", "stop"])

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:  # noqa: PYI034 - Python 3.10 has no typing.Self
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
