"""Where pending elicitations and grants live: the :class:`GrantStore` interface, its SQLite and
PostgreSQL backends, and :func:`open_store`, which picks one from a path or DSN.

Every method blocks (call it from a worker thread in an event loop) and raises
:class:`~..errors.GrantStoreUnavailable` instead of a driver error. The contract (atomic
consumption, secrets at rest, failure modes) is in ``docs/approvals.md``.
"""

from __future__ import annotations

import os

from ...settings import current
from .postgres import PostgresGrantStore
from .records import TERMINAL_STATUSES, ConsumeResult, ElicitationRecord, Grant, GrantStore
from .sql import DEFAULT_STORE_TIMEOUT_S, ENV_STORE_TIMEOUT, SQLStore
from .sqlite import SQLiteGrantStore

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
]


def open_store(target: str | os.PathLike[str] | GrantStore, *,
               timeout_s: float | None = None) -> GrantStore:
    """A store from a target: a store object as is; ``postgresql://...`` / ``postgres://...``
    -> :class:`PostgresGrantStore`; ``sqlite:///abs/path``, ``sqlite:rel/path`` or a plain path
    -> :class:`SQLiteGrantStore`. ``timeout_s``: see :data:`ENV_STORE_TIMEOUT` (default: the
    process's settings, :func:`...settings.current`)."""
    if isinstance(target, SQLStore) or (not isinstance(target, (str, os.PathLike))
                                         and isinstance(target, GrantStore)):
        return target  # type: ignore[return-value]
    text = os.fspath(target)
    timeout = current().grant_store_timeout_s if timeout_s is None else timeout_s
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresGrantStore(text, timeout_s=timeout)
    if text.startswith("sqlite://"):
        text = text[len("sqlite://"):]
    elif text.startswith("sqlite:"):
        text = text[len("sqlite:"):]
    return SQLiteGrantStore(text, busy_timeout_s=timeout)

