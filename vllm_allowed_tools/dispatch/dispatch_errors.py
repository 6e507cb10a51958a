"""The dispatch guard's typed errors: a stable ``code`` an application can branch on, and a message
the model can act on, so an agent loop feeds a refusal back instead of crashing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from .results import CallAnswer


class DispatchError(CallAnswer, Exception):
    """Base of every typed dispatch error.

    ``code`` is stable (branch on it); ``message`` says what went wrong and what to do;
    ``retryable`` tells whether the model can fix the call and try again; ``executed`` whether the
    handler ran. ``to_tool_output()`` is the JSON string to send to the model as the tool result.
    A subclass declares these on its class line: ``class X(CallRefusedError, code="x")``.
    """

    ok: ClassVar[bool] = False
    code: ClassVar[str] = "dispatch_error"
    retryable: ClassVar[bool] = False
    executed: ClassVar[bool] = False

    def __init_subclass__(cls, *, code: str | None = None, retryable: bool | None = None,
                          executed: bool | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = {"code": code, "retryable": retryable, "executed": executed}
        for attribute, value in declared.items():
            if value is not None:  # what a subclass does not declare it inherits
                setattr(cls, attribute, value)

    def __init__(self, message: str, *, call_id: str | None = None, tool: str | None = None,
                 details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.call_id = call_id
        self.tool = tool
        self.details: dict[str, Any] = dict(details or {})
        self.replayed = False

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message,
                                "retryable": self.retryable}
        if self.tool is not None:
            body["tool"] = self.tool
        body.update(self.details)
        return body

    def to_tool_output(self) -> str:
        return json.dumps({"error": self.to_dict()}, ensure_ascii=False, default=str)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, tool={self.tool!r}, message={self.message!r})"


class CallRefusedError(DispatchError, code="call_refused"):
    """The call was refused before its handler ran: nothing was executed."""


class MalformedCallError(CallRefusedError, code="malformed_call"):
    """The call is not a function call of either API's shape."""

    def __init__(self, detail: str, **kwargs: Any) -> None:
        super().__init__(f"The tool call is malformed: {detail}. Nothing was run.", **kwargs)


class UnknownToolError(CallRefusedError, code="unknown_tool"):
    """The name is not a function of this turn's catalog."""


class ToolNotAllowedError(CallRefusedError, code="tool_not_allowed"):
    """The function exists in the catalog but is not in this turn's allowed set."""


class ToolUnavailableError(CallRefusedError, code="tool_unavailable"):
    """Allowed, but this application cannot run it (no handler, or an unusable schema)."""


class InvalidArgumentsError(CallRefusedError, code="invalid_arguments", retryable=True):
    """The arguments are not one JSON object."""


class SchemaViolationError(CallRefusedError, code="schema_violation", retryable=True):
    """The arguments do not validate against the tool's JSON schema."""


class AuthorizationDeniedError(CallRefusedError, code="authorization_denied"):
    """The authorization hook did not allow this caller to make this call."""


class GrantRequiredError(CallRefusedError, code="grant_required"):
    """A gated tool without a live grant for this subject, session, tool and arguments."""


class IdempotencyConflictError(CallRefusedError, code="idempotency_conflict"):
    """The idempotency key was already used in this session for a different call."""


class CallInProgressError(CallRefusedError, code="call_in_progress"):
    """A call with the same idempotency key is running right now."""


class ToolFailedError(DispatchError, code="tool_failed", executed=True):
    """The handler ran and failed."""


class ToolFailure(Exception):
    """Raise from a handler to report a failure; its message is shown to the model as is.

    ``details`` (JSON-serializable) are added to the error the model sees.
    """

    def __init__(self, message: str, *, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = dict(details or {})
