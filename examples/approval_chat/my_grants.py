"""A person's own grants, read and revoked through the package's store API.

The server binds every grant to a *principal*: an HMAC of the caller's bearer API key under the
store's ``principal_secret`` (``wire.principal_from_headers``). This module derives the same
principal from the API key the person signed in with, so it lists only grants whose subject is
that principal and refuses to revoke anyone else's. The browser never sees the store, the secret or
other people's principals: it talks to the app's authenticated ``/api/grants`` endpoints.

The app must reach the same store as the server (the same SQLite file on this host, or the same
``postgresql://`` DSN). Every store method blocks: the web layer runs them in a worker thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_allowed_tools.approvals.store import Grant, GrantStore
from vllm_allowed_tools.approvals.response_bodies import ANONYMOUS, principal_from_headers, session_of

REVOKE_REASON = "revoked by its holder on the approval chat's My approvals page"


class NotYourGrant(LookupError):
    """No live grant of this id belongs to the signed-in person (it may not exist at all)."""


@dataclass(frozen=True)
class GrantView:
    """What the My approvals page shows of one grant (no principal, no digests)."""

    id: str
    tool: str
    scope: str
    session: str | None
    bound_to_arguments: bool
    created_at: float
    expires_at: float | None

    @classmethod
    def of(cls, grant: Grant) -> GrantView:
        return cls(id=grant.id, tool=grant.identity.flat_name, scope=grant.scope,
                   session=grant.session, bound_to_arguments=grant.arguments_digest is not None,
                   created_at=grant.created_at, expires_at=grant.expires_at)

    def to_json(self, chat_session_key: str | None = None) -> dict[str, Any]:
        """``chat_session_key``: the ``prompt_cache_key`` of the person's current chat, to say
        whether a ``session`` grant is that chat's (the server names sessions its own way)."""
        this_chat = session_of({"prompt_cache_key": chat_session_key}) if chat_session_key else None
        return {"id": self.id, "tool": self.tool, "scope": self.scope,
                "in_this_chat": self.session is not None and self.session == this_chat,
                "bound_to_arguments": self.bound_to_arguments, "created_at": self.created_at,
                "expires_at": self.expires_at}


class MyGrants:
    """The grants of whoever holds an API key, over one :class:`GrantStore`."""

    def __init__(self, store: GrantStore) -> None:
        self._store = store

    def principal_of(self, api_key: str) -> str:
        """The principal the server derives from ``api_key`` (as a bearer token)."""
        if not api_key.strip():
            raise ValueError("an empty API key has no grants: sign in with your API key")
        principal = principal_from_headers([(b"authorization", f"Bearer {api_key}".encode())],
                                           self._store.principal_secret)
        assert principal != ANONYMOUS
        return principal

    def live(self, api_key: str) -> list[GrantView]:
        """The live grants (not revoked, not expired) of ``api_key``'s principal, newest first."""
        grants = self._store.list_grants(subject=self.principal_of(api_key), now=time.time())
        return sorted((GrantView.of(g) for g in grants), key=lambda g: -g.created_at)

    def revoke(self, api_key: str, grant_id: str) -> None:
        """Revoke one of ``api_key``'s live grants; NotYourGrant for any other id (whether it
        exists is not revealed). The next matching call is asked about again."""
        grant = self._store.get_grant(grant_id)
        now = time.time()
        if grant is None or grant.subject != self.principal_of(api_key) or not grant.is_live(now):
            raise NotYourGrant(f"no live grant {grant_id!r} of yours: reload My approvals to see "
                               "the grants you hold now")
        if not self._store.revoke_grant(grant_id, now=now, reason=REVOKE_REASON):
            raise NotYourGrant(f"grant {grant_id!r} was revoked meanwhile")
