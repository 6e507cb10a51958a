"""What the application plugs into the dispatcher: the checked call its hooks and handlers receive,
the authorization hook's answer, and the grant checker that gated tools need."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..request import FunctionSpec, ToolIdentity
from .call_arguments import arguments_digest
from .tool_calls import ToolCall, TurnContext


@dataclass(frozen=True)
class Invocation:
    """Everything known about a checked call: what hooks and handlers receive."""

    turn: TurnContext
    call: ToolCall
    spec: FunctionSpec
    arguments: dict[str, Any]
    idempotency_key: str | None

    @property
    def subject(self) -> str:
        return self.turn.subject

    @property
    def tenant(self) -> str:
        return self.turn.tenant

    @property
    def session(self) -> str:
        return self.turn.session

    @property
    def tool(self) -> ToolIdentity:
        return self.spec.identity

    @property
    def name(self) -> str:
        return self.spec.flat_name


@dataclass(frozen=True)
class AuthorizationDecision:
    allowed: bool
    reason: str | None = None


def allow() -> AuthorizationDecision:
    return AuthorizationDecision(True)


def deny(reason: str | None = None) -> AuthorizationDecision:
    """A denial; ``reason`` is shown to the model, so keep secrets out of it."""
    return AuthorizationDecision(False, reason)


#: ``authorize(invocation)`` -> ``True`` / :func:`allow` to allow; anything else denies.
Authorizer = Callable[[Invocation], bool | AuthorizationDecision]
#: ``handler(arguments, invocation)`` -> the tool's output (a string, or anything JSON-serializable).
Handler = Callable[[dict[str, Any], Invocation], Any]


def allow_all(invocation: Invocation) -> bool:
    """An authorizer that allows everything the policy allows (tests and demos only)."""
    return True


@runtime_checkable
class GrantChecker(Protocol):
    """Answers whether a gated call may run now (the approvals layer implements this)."""

    def has_live_grant(self, subject: str, session: str, tool_identity: ToolIdentity,
                       arguments: Mapping[str, Any]) -> bool: ...


@dataclass
class _Grant:
    subject: str
    session: str
    tool: ToolIdentity
    arguments_digest: str | None
    expires_at: float | None


class InMemoryGrantChecker:
    """A thread-safe in-memory :class:`GrantChecker` (tests and single-process demos).

    A grant binds subject, session, tool identity and, optionally, the exact arguments (by digest of
    their canonical JSON); it may expire (``clock()`` seconds) and be revoked.
    """

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[str, _Grant] = {}

    def grant(self, subject: str, session: str, tool: ToolIdentity | str, *,
              arguments: Mapping[str, Any] | None = None, expires_at: float | None = None,
              ttl_s: float | None = None) -> str:
        """Record a grant; returns its id (for :meth:`revoke`). ``tool`` as a string is a top-level
        function name. ``arguments=None`` grants any arguments."""
        identity = tool if isinstance(tool, ToolIdentity) else ToolIdentity(None, tool)
        if ttl_s is not None:
            expires_at = self._clock() + ttl_s
        grant_id = uuid.uuid4().hex
        digest = None if arguments is None else arguments_digest(dict(arguments))
        with self._lock:
            self._grants[grant_id] = _Grant(subject, session, identity, digest, expires_at)
        return grant_id

    def revoke(self, grant_id: str) -> bool:
        with self._lock:
            return self._grants.pop(grant_id, None) is not None

    def has_live_grant(self, subject: str, session: str, tool_identity: ToolIdentity,
                       arguments: Mapping[str, Any]) -> bool:
        now = self._clock()
        digest = arguments_digest(dict(arguments))
        with self._lock:
            for grant in self._grants.values():
                if (grant.subject == subject and grant.session == session
                        and grant.tool == tool_identity
                        and (grant.arguments_digest is None or grant.arguments_digest == digest)
                        and (grant.expires_at is None or now < grant.expires_at)):
                    return True
        return False
