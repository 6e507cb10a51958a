"""Errors of the approvals core, each with a stable ``code`` clients may branch on: a client's
mistake is a 4xx raised before anything is consumed (:class:`ApprovalInputError`), a store outage a
503 that fails closed (:class:`GrantStoreUnavailable`), a bad policy file a start-up failure
(:class:`PolicyFileError`).
"""

from __future__ import annotations

from ..errors import AllowedToolsError

__all__ = [
    "CODE_ELICITATION_CONSUMED",
    "CODE_ELICITATION_MISMATCH",
    "CODE_GRANT_STORE_UNAVAILABLE",
    "CODE_INVALID_APPROVAL_HINT",
    "CODE_INVALID_ELICITATION",
    "CODE_INVALID_ELICITATION_RESPONSE",
    "CODE_TOOL_NOT_ALLOWED_THIS_TURN",
    "CODE_UNKNOWN_ELICITATION",
    "CODE_UNKNOWN_ELICITATION_TYPE",
    "ApprovalInputError",
    "GrantStoreUnavailable",
    "PolicyFileError",
]

# Stable ``code`` strings (clients may branch on them; never rename one).
CODE_INVALID_ELICITATION = "invalid_elicitation"
CODE_INVALID_ELICITATION_RESPONSE = "invalid_elicitation_response"
CODE_UNKNOWN_ELICITATION_TYPE = "unknown_elicitation_type"
CODE_UNKNOWN_ELICITATION = "unknown_elicitation"  # no pending elicitation with that id for this caller
CODE_ELICITATION_MISMATCH = "elicitation_mismatch"  # the response names another call / digest
CODE_ELICITATION_CONSUMED = "elicitation_consumed"  # already answered by another response (409)
CODE_GRANT_STORE_UNAVAILABLE = "grant_store_unavailable"  # the grant store is down (503)
CODE_INVALID_APPROVAL_HINT = "invalid_approval_hint"  # a tool definition's `approval` object
#: An ``accept`` names a call this request could not have made (no tools, ``tool_choice: none``, an
#: allowlist or named choice without the tool): 400, nothing consumed.
CODE_TOOL_NOT_ALLOWED_THIS_TURN = "tool_not_allowed_this_turn"


class ApprovalInputError(AllowedToolsError):
    """A request item about approvals is invalid (HTTP 400 unless ``status`` says otherwise)."""

    status = 400
    type = "invalid_request_error"
    code = CODE_INVALID_ELICITATION_RESPONSE


class GrantStoreUnavailable(AllowedToolsError):
    """The grant store cannot be used right now (HTTP 503, ``retry_after`` seconds).

    ``message`` is for the client: what happened and what to do, without server paths. ``detail``
    is for the server log (which store, the underlying error). ``cause`` is a short label (``locked``,
    ``missing``, ``replaced``, ``not_a_database``, ``io_error``, ``unreachable``, ...).
    """

    status = 503
    type = "server_error"
    code = CODE_GRANT_STORE_UNAVAILABLE
    retry_after = 5

    def __init__(self, cause: str, *, store: str, detail: str = "") -> None:
        super().__init__(
            f"Tool-call approvals are unavailable: the server's grant store ({store}) cannot be "
            f"used right now ({cause.replace('_', ' ')}). A call to a tool that needs approval can "
            "be neither checked against a grant nor recorded for approval, so nothing was released "
            "and nothing was recorded. Retry the same request in a few seconds; tools that need no "
            "approval keep working. If it persists, the server operator must make the grant store "
            "(VLLM_ALLOWED_TOOLS_GRANT_STORE) reachable again; no restart is needed.")
        self.cause = cause
        self.detail = detail or cause


class PolicyFileError(ValueError):
    """The operator's approval policy file cannot be used; ``key`` is the offending key path."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
