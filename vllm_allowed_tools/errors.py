"""Errors of the allowed-tools plugin, each rendered in the OpenAI error shape.

Every error carries what an OpenAI-compatible server puts on the wire (``status``, ``message``,
``type``, ``param``, ``code``) so the glue can turn any of them into a response without knowing
which one it caught. The classes say *who* is at fault, which is what metrics and HTTP status need:

* :class:`InvalidSelectionError`: the client sent something we cannot resolve (HTTP 400). It also
  carries a short ``reason`` label for the ``vllm_allowed_tools:invalid_selections`` counter.
* :class:`CapabilityError`: the deployment (parser, template, structured-output backend) cannot
  enforce what the client asked for; it names the missing capability instead of silently
  ignoring the allowlist.

How a message shows what the client sent (:func:`quote`, :func:`type_name`, ...) is here too:
short, typed, and never bloated by one huge value, so each message can say what to fix.

This module imports nothing from vLLM so the policy layer stays testable in milliseconds.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "ABSENT",
    "CODE_INVALID_ALLOWED_TOOLS",
    "CODE_INVALID_PARALLEL_TOOL_CALLS",
    "CODE_INVALID_TOOLS",
    "CODE_UNSUPPORTED",
    "SELECTION_REASONS",
    "AllowedToolsError",
    "CapabilityError",
    "InvalidSelectionError",
    "is_name",
    "malformed",
    "names_list",
    "quote",
    "type_name",
]

# Stable ``code`` strings. Clients may branch on them, so never rename one.
CODE_INVALID_ALLOWED_TOOLS = "invalid_allowed_tools"  # tool_choice (the selection) is at fault
CODE_INVALID_TOOLS = "invalid_tools"  # the `tools` catalog cannot back an allowlist
CODE_INVALID_PARALLEL_TOOL_CALLS = "invalid_parallel_tool_calls"
CODE_UNSUPPORTED = "allowed_tools_unsupported"  # CapabilityError

# Every ``reason`` label InvalidSelectionError may carry (metrics label values; keep bounded).
SELECTION_REASONS = frozenset({
    "empty_subset",
    "unknown_function",
    "ambiguous_name",
    "duplicate_tool",
    "non_function_selector",
    "tool_type_mismatch",
    "malformed",
    "invalid_mode",
    "no_function_tools",
})


class AllowedToolsError(Exception):
    """Base of every plugin error; knows how to present itself as an OpenAI error body.

    Attributes:
        status: HTTP status the server should answer with.
        message: what went wrong *and* what to do about it.
        type: OpenAI error ``type`` (``invalid_request_error`` for 4xx, ``server_error`` for 5xx).
        param: the request field at fault, as a path (``tool_choice.tools[2].name``), or None.
        code: a stable machine-readable string.
    """

    status: int = 400
    type: str = "invalid_request_error"
    code: str = "allowed_tools_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if error_type is not None:
            self.type = error_type
        elif self.status >= 500:
            self.type = "server_error"

    def to_openai(self) -> dict[str, Any]:
        """The body OpenAI servers send: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(status={self.status}, code={self.code!r}, "
                f"param={self.param!r}, message={self.message!r})")


class InvalidSelectionError(AllowedToolsError):
    """The client's tools / tool_choice cannot be resolved to a sound allowlist (HTTP 400).

    Raised before anything reaches the engine, so a bad selection never widens to the catalog.
    ``reason`` is one of :data:`SELECTION_REASONS`; it is a metrics label, never shown as the message.
    """

    status = 400
    type = "invalid_request_error"
    code = CODE_INVALID_ALLOWED_TOOLS

    def __init__(self, message: str, *, reason: str, param: str | None = None,
                 code: str | None = None) -> None:
        if reason not in SELECTION_REASONS:
            raise ValueError(f"unknown InvalidSelectionError reason {reason!r}")
        super().__init__(message, param=param, code=code)
        self.reason = reason


class CapabilityError(AllowedToolsError):
    """This deployment cannot enforce the requested tool policy; names what is missing.

    Use status 400 when the client asked for something this server is not set up for (for example
    ``allowed_tools`` with a tool parser that has no allowlist support: the client can drop the
    selection or use another endpoint), and 500 when the server is misconfigured in a way the client
    cannot work around. Either way the request fails instead of silently ignoring the allowlist.
    """

    code = CODE_UNSUPPORTED

    def __init__(self, message: str, *, capability: str, status: int = 400,
                 param: str | None = "tool_choice", code: str | None = None) -> None:
        super().__init__(message, param=param, code=code, status=status)
        self.capability = capability


# --------------------------------------------------------------------------------------------------
# how a message shows what the client sent

_MAX_LISTED_NAMES = 20
_MAX_QUOTED_CHARS = 80


class _Absent:
    """Marks a field the client did not send (so messages can say "missing", not "null")."""


ABSENT: Any = _Absent()


def quote(value: Any) -> str:
    """A client value for an error message (compact JSON with sorted keys, or its ``repr`` when it
    is not JSON), truncated so one huge name cannot bloat the error."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            text = repr(value)
    if len(text) > _MAX_QUOTED_CHARS:
        text = text[:_MAX_QUOTED_CHARS] + "..."
    return f"'{text}'"


def type_name(value: Any) -> str:
    """What the client sent, in JSON words ("an object", "null", "nothing (the field is missing)")."""
    if value is ABSENT:
        return "nothing (the field is missing)"
    if isinstance(value, str) and not value:
        return "an empty string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


def names_list(names: Sequence[str]) -> str:
    """The first names of a list, and how many more there are."""
    shown = ", ".join(names[:_MAX_LISTED_NAMES])
    if len(names) > _MAX_LISTED_NAMES:
        shown += f", ... ({len(names) - _MAX_LISTED_NAMES} more)"
    return shown


def malformed(param: str, message: str, *, code: str = CODE_INVALID_TOOLS) -> InvalidSelectionError:
    return InvalidSelectionError(message, reason="malformed", param=param, code=code)


def is_name(value: Any) -> bool:
    return isinstance(value, str) and value != ""
