"""Grant-store faults for tests and benchmarks: another process holding the SQLite write lock."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE grants SET revoked_reason = revoked_reason")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


@contextlib.contextmanager
def sqlite_locked(db: Path) -> Iterator[None]:
    """Another process holds the store's write lock until the block ends (longer than any busy
    timeout the block waits out); reads still work in WAL mode."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(db)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "locked":
            raise RuntimeError("the lock holder did not take the lock")
        yield
    finally:
        holder.communicate("\n", timeout=60)
