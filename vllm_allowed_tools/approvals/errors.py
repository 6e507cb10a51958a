"""Errors of the approvals core.

* :class:`ApprovalInputError`: something in the client's request is wrong (an elicitation or
  elicitation_response item, a tool definition's ``approval`` object, a response that does not match
  the server's record). An OpenAI-shaped 4xx (``to_openai()``), ``param`` pointing at the field. It is
  raised **before anything is consumed**, so the client can correct the request and send it again.
* :class:`PolicyFileError`: the operator's policy file is unusable; raised at start-up.
"""

from __future__ import annotations

from ..errors import AllowedToolsError

__all__ = [
    "CODE_ELICITATION_CONSUMED",
    "CODE_ELICITATION_MISMATCH",
    "CODE_INVALID_ELICITATION",
    "CODE_INVALID_ELICITATION_RESPONSE",
    "CODE_UNKNOWN_ELICITATION",
    "CODE_UNKNOWN_ELICITATION_TYPE",
    "ApprovalInputError",
    "PolicyFileError",
]

# Stable ``code`` strings (clients may branch on them; never rename one).
CODE_INVALID_ELICITATION = "invalid_elicitation"
CODE_INVALID_ELICITATION_RESPONSE = "invalid_elicitation_response"
CODE_UNKNOWN_ELICITATION_TYPE = "unknown_elicitation_type"
CODE_UNKNOWN_ELICITATION = "unknown_elicitation"  # no pending elicitation with that id for this caller
CODE_ELICITATION_MISMATCH = "elicitation_mismatch"  # the response names another call / digest
CODE_ELICITATION_CONSUMED = "elicitation_consumed"  # already answered by another response (409)


class ApprovalInputError(AllowedToolsError):
    """A request item about approvals is invalid (HTTP 400 unless ``status`` says otherwise)."""

    status = 400
    type = "invalid_request_error"
    code = CODE_INVALID_ELICITATION_RESPONSE


class PolicyFileError(ValueError):
    """The operator's approval policy file cannot be used; ``key`` is the offending key path."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key
