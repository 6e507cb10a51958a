"""The dispatch guard: the application's last check before it runs a tool call the model returned.
Model-side restriction narrows what the model proposes; this is the security boundary. What it
checks, in which order, and how it refuses: docs/dispatch.md."""

from .call_arguments import arguments_digest
from .tool_calls import ToolCall, TurnContext
from .dispatcher import Dispatcher
from .dispatch_errors import (
    AuthorizationDeniedError,
    CallInProgressError,
    CallRefusedError,
    DispatchError,
    GrantRequiredError,
    IdempotencyConflictError,
    InvalidArgumentsError,
    MalformedCallError,
    SchemaViolationError,
    ToolFailedError,
    ToolFailure,
    ToolNotAllowedError,
    ToolUnavailableError,
    UnknownToolError,
)
from .hooks import (
    AuthorizationDecision,
    GrantChecker,
    InMemoryGrantChecker,
    Invocation,
    allow,
    allow_all,
    deny,
)
from .idempotency import IdempotencyStore, InMemoryIdempotencyStore, Reservation, StoredOutcome
from .results import DispatchResult

__all__ = [
    "AuthorizationDecision",
    "AuthorizationDeniedError",
    "CallInProgressError",
    "CallRefusedError",
    "DispatchError",
    "DispatchResult",
    "Dispatcher",
    "GrantChecker",
    "GrantRequiredError",
    "IdempotencyConflictError",
    "IdempotencyStore",
    "InMemoryGrantChecker",
    "InMemoryIdempotencyStore",
    "InvalidArgumentsError",
    "Invocation",
    "MalformedCallError",
    "Reservation",
    "SchemaViolationError",
    "StoredOutcome",
    "ToolCall",
    "ToolFailedError",
    "ToolFailure",
    "ToolNotAllowedError",
    "ToolUnavailableError",
    "TurnContext",
    "UnknownToolError",
    "allow",
    "allow_all",
    "arguments_digest",
    "deny",
]
