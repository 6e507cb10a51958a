"""The two kinds of record the approvals keep, and the :class:`GrantStore` interface over them.

An :class:`ElicitationRecord` is the server's own account of one paused call (the transcript only
points at it); a :class:`Grant` is reusable authority minted by a ``session`` / ``always``
acceptance. They are kept apart so that answering an elicitation never edits a grant. See
``docs/approvals.md`` for the store's contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from ...request import ToolIdentity
from ...request.identity import ToolKind
from ..elicitation_types import TOOL_CALL_APPROVAL
from ..items import ToolCallApproval

__all__ = ["TERMINAL_STATUSES", "ConsumeResult", "ElicitationRecord", "ExecutionRecord", "Grant",
           "GrantStore"]

#: Terminal statuses of an elicitation record (``pending`` is the only other one).
TERMINAL_STATUSES = frozenset({"accepted", "declined", "cancelled", "expired", "unanswered",
                               "invalidated"})


@dataclass(frozen=True)
class ElicitationRecord:
    """The server's record of one paused call: the exact call (call id, arguments, both digests),
    the scopes offered, its expiry, whom and which session it was asked of, and, once answered,
    how (``status``, ``response_id``, ``scope``, ``reason``, the minted ``grant_id``)."""

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
    #: the kind of tool called: ``function`` (``arguments``: the JSON text), or ``custom`` (a
    #: ``custom_tool_call``; ``arguments``: its raw ``input``)
    tool_type: ToolKind = "function"

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
                                expires_at=int(self.expires_at), tool_type=self.tool_type)


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


@dataclass(frozen=True)
class ExecutionRecord:
    """The one execution of an approved server-side call: claimed before it ran; ``output`` once it
    ran (None with ``finished_at`` None: the outcome is unknown, and it is never run again)."""

    elicitation_id: str
    recipient: str
    arguments_digest: str
    claimed_at: float
    finished_at: float | None
    output: str | None


@runtime_checkable
class GrantStore(Protocol):
    """Storage of elicitation records and grants. Every method is atomic on its own."""

    #: 32 random bytes kept in the store, under which principals are derived from credentials: the
    #: same bytes for every store object on the same database, for as long as the database lives.
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
