"""Read every request field the plugin depends on exactly as vLLM will, or refuse the request.

vLLM coerces bodies with pydantic's lax rules; a plugin reading a field more strictly would disagree
with vLLM about the request, and each such disagreement is a bypass. The fields and rules are listed
in ``docs/request-path.md``. No vLLM imports: pydantic is the library vLLM validates with."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ..errors import AllowedToolsError
from .catalog import Api

__all__ = ["CODE_INVALID_FIELD", "normalise_fields"]

CODE_INVALID_FIELD = "invalid_request_field"

#: Boolean fields read by the plugin, per API (vLLM declares each ``bool | None``).
_BOOL_FIELDS: dict[str, tuple[str, ...]] = {
    "responses": ("parallel_tool_calls", "stream", "background", "store"),
    "chat": ("parallel_tool_calls", "stream"),
}
#: Optional string fields the approvals read (who and which session is asking).
_STRING_FIELDS: dict[str, tuple[str, ...]] = {
    "responses": ("prompt_cache_key", "previous_response_id"),
    "chat": (),
}


def _refuse(field: str, message: str) -> AllowedToolsError:
    return AllowedToolsError(f"`{field}` {message}", param=field, code=CODE_INVALID_FIELD)


@functools.lru_cache(maxsize=1)
def _bool_adapter() -> Any:
    from pydantic import TypeAdapter
    return TypeAdapter(bool | None)


def _lax_bool(field: str, value: Any) -> bool | None:
    """pydantic's lax ``bool | None``: what vLLM serves for this value."""
    from pydantic import ValidationError
    try:
        return _bool_adapter().validate_python(value)
    except ValidationError:
        raise _refuse(field, f"must be a boolean, got {_shown(value)}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_type(body: Mapping[str, Any], field: str, kinds: tuple[type, ...], expected: str) -> None:
    value = body.get(field)
    if value is not None and not isinstance(value, kinds):
        raise _refuse(field, f"must be {expected}, got {_shown(value)}")


def normalise_fields(body: Mapping[str, Any], api: Api) -> dict[str, Any]:
    """A copy of ``body`` whose plugin-read fields are canonical JSON types; raises a 400
    (:class:`AllowedToolsError`, ``param`` = the field) for a value vLLM would coerce in a way the
    plugin cannot follow, or that neither could read."""
    new = dict(body)
    for field in _BOOL_FIELDS[api]:
        if field in new and new[field] is not None and not isinstance(new[field], bool):
            new[field] = _lax_bool(field, new[field])
    for field in _STRING_FIELDS[api]:
        _check_type(new, field, (str,), "a string")
    _check_type(new, "tools", (list,), "a list of tool objects")
    for index, tool in enumerate(new.get("tools") or ()):
        if not isinstance(tool, Mapping):
            raise _refuse(f"tools[{index}]", f"must be a tool object, got {_shown(tool)}")
    _check_type(new, "tool_choice", (str, Mapping), 'a string ("none", "auto", "required") or an '
                                                    "object")
    if api == "responses":
        _check_type(new, "input", (str, list), "a string or a list of input items")
        conversation = new.get("conversation")
        if isinstance(conversation, Mapping) and not isinstance(conversation.get("id"), str):
            raise _refuse("conversation.id", f"must be a string, got {_shown(conversation.get('id'))}")
        _check_type(new, "conversation", (str, Mapping), 'a string or an object with a string "id"')
    else:
        _check_type(new, "messages", (list,), "a list of messages")
    return new
