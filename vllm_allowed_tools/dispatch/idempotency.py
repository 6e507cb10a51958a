"""At-most-once execution: an idempotency key, unique within a (tenant, session), runs its handler
once; the same call again gets the stored outcome back, and the key used for another call is
refused."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from .call_arguments import arguments_digest
from .dispatch_errors import CallInProgressError, DispatchError, IdempotencyConflictError, ToolFailedError
from .hooks import Invocation
from .messages import short
from .results import DispatchResult


@dataclass(frozen=True)
class StoredOutcome:
    """What a completed key stored: the fingerprint of its call and its result or error."""

    fingerprint: str
    result: DispatchResult | None = None
    error: DispatchError | None = None


class Reservation(NamedTuple):
    """``new``: the key is reserved for the caller, which must :meth:`IdempotencyStore.complete` or
    :meth:`IdempotencyStore.release` it. ``done``: ``outcome`` holds the stored outcome.
    ``running``: the same call is in flight. ``conflict``: the key belongs to a different call."""

    state: Literal["new", "done", "running", "conflict"]
    outcome: StoredOutcome | None = None


class IdempotencyStore(Protocol):
    """Pluggable store of idempotency keys, unique within a (tenant, session) scope.

    ``reserve`` must be atomic: of two concurrent reservations of a new key exactly one gets
    ``new``."""

    def reserve(self, scope: tuple[str, str], key: str, fingerprint: str) -> Reservation: ...

    def complete(self, scope: tuple[str, str], key: str, outcome: StoredOutcome) -> None: ...

    def release(self, scope: tuple[str, str], key: str) -> None: ...


@dataclass
class _KeyEntry:
    fingerprint: str
    outcome: StoredOutcome | None  # None while running
    at: float


class InMemoryIdempotencyStore:
    """A thread-safe in-memory :class:`IdempotencyStore`.

    Completed keys are kept for ``ttl_s`` seconds (None: forever) and at most ``max_entries`` of
    them (the oldest completed ones are forgotten first); running keys are never evicted.
    """

    def __init__(self, max_entries: int = 100_000, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._max = max_entries
        self._ttl = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str, str], _KeyEntry] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def reserve(self, scope: tuple[str, str], key: str, fingerprint: str) -> Reservation:
        full = (scope[0], scope[1], key)
        with self._lock:
            now = self._clock()
            entry = self._entries.get(full)
            if (entry is not None and entry.outcome is not None and self._ttl is not None
                    and now - entry.at >= self._ttl):
                del self._entries[full]
                entry = None
            if entry is None:
                self._entries[full] = _KeyEntry(fingerprint, None, now)
                self._evict()
                return Reservation("new")
            if entry.fingerprint != fingerprint:
                return Reservation("conflict", entry.outcome)
            if entry.outcome is None:
                return Reservation("running")
            return Reservation("done", entry.outcome)

    def complete(self, scope: tuple[str, str], key: str, outcome: StoredOutcome) -> None:
        full = (scope[0], scope[1], key)
        with self._lock:
            self._entries[full] = _KeyEntry(outcome.fingerprint, outcome, self._clock())
            self._entries.move_to_end(full)
            self._evict()

    def release(self, scope: tuple[str, str], key: str) -> None:
        with self._lock:
            entry = self._entries.get((scope[0], scope[1], key))
            if entry is not None and entry.outcome is None:
                del self._entries[(scope[0], scope[1], key)]

    def _evict(self) -> None:
        if len(self._entries) <= self._max:
            return
        for full in [k for k, e in self._entries.items() if e.outcome is not None]:
            if len(self._entries) <= self._max:
                break
            del self._entries[full]


def run_once(store: IdempotencyStore, invocation: Invocation, key: str,
             run: Callable[[], DispatchResult]) -> DispatchResult:
    """``run()`` under ``key``: at most once per (tenant, session, key), replaying its stored
    outcome to the same call again. Raises :class:`IdempotencyConflictError`,
    :class:`CallInProgressError`, or the stored :class:`ToolFailedError` of a replay."""
    scope = invocation.turn.scope
    fingerprint = arguments_digest({"tool": invocation.tool.as_json(),
                                    "arguments": invocation.arguments})
    reservation = store.reserve(scope, key, fingerprint)
    call_id = invocation.call.call_id
    if reservation.state == "conflict":
        raise IdempotencyConflictError(
            f"The idempotency key {short(key)!r} was already used in this session for a "
            f"different call (another tool or other arguments). Nothing was run. Every new "
            "call needs a new call id.", call_id=call_id, tool=invocation.name,
            details={"idempotency_key": key})
    if reservation.state == "running":
        raise CallInProgressError(
            f"A call with idempotency key {short(key)!r} is still running. Nothing was run "
            "again; wait for its result instead of calling again.", call_id=call_id,
            tool=invocation.name, details={"idempotency_key": key})
    if reservation.state == "done":
        return _replay(reservation.outcome, call_id)
    try:
        result = run()
    except ToolFailedError as error:
        store.complete(scope, key, StoredOutcome(fingerprint, error=error))
        raise
    except BaseException:
        store.release(scope, key)
        raise
    store.complete(scope, key, StoredOutcome(fingerprint, result=result))
    return result


def _replay(outcome: StoredOutcome | None, call_id: str | None) -> DispatchResult:
    if outcome is None or (outcome.result is None and outcome.error is None):
        raise RuntimeError("the idempotency store returned a completed key without an outcome")
    if outcome.result is not None:
        stored = outcome.result
        try:  # the caller may mutate what it gets; the stored outcome must not change
            output, arguments = copy.deepcopy(stored.output), copy.deepcopy(stored.arguments)
        except Exception:  # noqa: BLE001 - an output that cannot be copied is shared as is
            output, arguments = stored.output, stored.arguments
        return dataclasses.replace(stored, replayed=True, call_id=call_id, output=output,
                                   arguments=arguments)
    error = copy.copy(outcome.error)
    error.replayed = True
    error.call_id = call_id
    error.details = {**error.details, "replayed": True}
    raise error
