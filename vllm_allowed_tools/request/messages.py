"""How the request path's 400s show what the client sent: short, typed, and never bloated by one
huge value, so each message can say what to fix."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CODE_INVALID_TOOLS, InvalidSelectionError

__all__ = ["ABSENT", "is_name", "malformed", "names_list", "quote", "type_name"]

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
