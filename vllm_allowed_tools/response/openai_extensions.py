"""OpenAI Responses features Open Responses does not define, as the conformance check validates them.

A custom tool (Codex's ``apply_patch``) is OpenAI's: its call is a ``custom_tool_call`` output item,
its input streams as ``response.custom_tool_call_input.delta`` / ``.done`` events, and a
``tool_choice`` may name it (``{"type": "custom", "name": ...}``, alone or in ``allowed_tools``).
Open Responses knows none of these, and OpenAI clients need all of them, so :mod:`.conformance`
validates each against OpenAI's own shape (from the ``openai`` SDK's types), written here as JSON
schemas: a documented extension, as the approvals' ``elicitation`` item is, never a loosening of a
standard item. The items and events of the tools vLLM runs itself (``mcp_call``,
``mcp_approval_request``, ``web_search_call``: docs/server-side-tools.md) are OpenAI's too, and
checked the same way. No vLLM imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CUSTOM_TOOL_CALL = "custom_tool_call"
INPUT_DELTA = "response.custom_tool_call_input.delta"
INPUT_DONE = "response.custom_tool_call_input.done"

_STRING = {"type": "string"}
_INTEGER = {"type": "integer"}
#: who made the call (``openai.types.responses.response_custom_tool_call.Caller``)
_CALLER = {"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": False, "required": ["type"],
    "properties": {"type": {"enum": ["direct", "program"]}, "caller_id": _STRING}}]}


def custom_tool_call_schema() -> dict[str, Any]:
    """A ``custom_tool_call`` output item (``openai.types.responses.ResponseCustomToolCall``, with
    the ``status`` vLLM sends on every output item)."""
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "call_id", "name", "input"],
            "properties": {"type": {"const": CUSTOM_TOOL_CALL}, "id": _STRING, "call_id": _STRING,
                           "name": _STRING, "input": _STRING, "namespace": {"type": ["string", "null"]},
                           "status": {"enum": ["in_progress", "completed", "incomplete"]},
                           "async": {"type": ["boolean", "null"]}, "caller": _CALLER}}



MCP_CALL = "mcp_call"
MCP_APPROVAL_REQUEST = "mcp_approval_request"
_MCP_ERROR = {"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": False, "required": ["type"],
    "properties": {"type": {"enum": ["mcp_protocol_error", "mcp_tool_execution_error",
                                     "http_error"]},
                   "code": _INTEGER, "message": _STRING, "content": {}}}]}


def mcp_call_schema() -> dict[str, Any]:
    """An ``mcp_call`` output item (``openai.types.responses.response_output_item.McpCall``): a
    call the server ran (or did not) on an MCP server (``docs/server-side-tools.md``)."""
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "id", "arguments", "name", "server_label"],
            "properties": {"type": {"const": MCP_CALL}, "id": _STRING, "arguments": _STRING,
                           "name": _STRING, "server_label": _STRING,
                           "approval_request_id": {"type": ["string", "null"]},
                           "output": {"type": ["string", "null"]}, "error": _MCP_ERROR,
                           "status": {"enum": ["in_progress", "completed", "incomplete",
                                               "calling", "failed"]}}}


def mcp_approval_request_schema() -> dict[str, Any]:
    """An ``mcp_approval_request`` output item (``...response_output_item.McpApprovalRequest``)."""
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "id", "arguments", "name", "server_label"],
            "properties": {"type": {"const": MCP_APPROVAL_REQUEST}, "id": _STRING,
                           "arguments": _STRING, "name": _STRING, "server_label": _STRING}}


WEB_SEARCH_CALL = "web_search_call"
_NULLABLE_STRING = {"type": ["string", "null"]}
_WEB_SEARCH_SOURCE = {"type": "object", "required": ["type", "url"],
                      "properties": {"type": {"const": "url"}, "url": _STRING}}
_WEB_SEARCH_ACTION = {"anyOf": [
    {"type": "object", "additionalProperties": False, "required": ["type"],
     "properties": {"type": {"const": "search"}, "query": _NULLABLE_STRING,
                    "queries": {"anyOf": [{"type": "null"}, {"type": "array", "items": _STRING}]},
                    "sources": {"anyOf": [{"type": "null"},
                                          {"type": "array", "items": _WEB_SEARCH_SOURCE}]}}},
    {"type": "object", "additionalProperties": False, "required": ["type"],
     "properties": {"type": {"const": "open_page"}, "url": _NULLABLE_STRING}},
    {"type": "object", "additionalProperties": False, "required": ["type", "pattern", "url"],
     "properties": {"type": {"const": "find_in_page"}, "pattern": _STRING, "url": _STRING}}]}


def web_search_call_schema() -> dict[str, Any]:
    """A ``web_search_call`` output item (``openai.types.responses.ResponseFunctionWebSearch``): a
    ``web_search_preview`` call vLLM ran on the ``browser`` tool server."""
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "id", "action", "status"],
            "properties": {"type": {"const": WEB_SEARCH_CALL}, "id": _STRING,
                           "action": _WEB_SEARCH_ACTION,
                           "status": {"enum": ["in_progress", "searching", "completed", "failed",
                                               "incomplete"]}}}


def _event(kind: str, field: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "sequence_number", "item_id", "output_index", field],
            "properties": {"type": {"const": kind}, "sequence_number": _INTEGER, "item_id": _STRING,
                           "output_index": _INTEGER, field: _STRING, "obfuscation": _STRING}}


def _state_event(kind: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False,
            "required": ["type", "sequence_number", "item_id", "output_index"],
            "properties": {"type": {"const": kind}, "sequence_number": _INTEGER, "item_id": _STRING,
                           "output_index": _INTEGER}}


#: event type -> (the component name it is validated as, its schema)
EXTENSION_EVENTS: Mapping[str, tuple[str, dict[str, Any]]] = {
    INPUT_DELTA: ("OpenAICustomToolCallInputDeltaEvent", _event(INPUT_DELTA, "delta")),
    INPUT_DONE: ("OpenAICustomToolCallInputDoneEvent", _event(INPUT_DONE, "input")),
    # an mcp_call's events (openai.types.responses.ResponseMcpCall*Event)
    "response.mcp_call.in_progress": ("OpenAIMcpCallInProgressEvent",
                                      _state_event("response.mcp_call.in_progress")),
    "response.mcp_call.completed": ("OpenAIMcpCallCompletedEvent",
                                    _state_event("response.mcp_call.completed")),
    "response.mcp_call.failed": ("OpenAIMcpCallFailedEvent",
                                 _state_event("response.mcp_call.failed")),
    "response.mcp_call_arguments.delta": ("OpenAIMcpCallArgumentsDeltaEvent",
                                          _event("response.mcp_call_arguments.delta", "delta")),
    "response.mcp_call_arguments.done": ("OpenAIMcpCallArgumentsDoneEvent",
                                         _event("response.mcp_call_arguments.done", "arguments")),
    # a web_search_call's events (openai.types.responses.ResponseWebSearchCall*Event)
    **{f"response.web_search_call.{state}": (
        f"OpenAIWebSearchCall{state.title().replace('_', '')}Event",
        _state_event(f"response.web_search_call.{state}"))
       for state in ("in_progress", "searching", "completed")},
}


def _as_function_choice(entry: Any) -> Any:
    """A custom tool named in a ``tool_choice`` has the function choice's shape (``type`` and
    ``name``): it is checked as one."""
    if isinstance(entry, Mapping) and entry.get("type") == "custom" and set(entry) <= {"type", "name"}:
        return {**entry, "type": "function"}
    return entry


def with_custom_choices_as_functions(response: Any) -> Any:
    """``response`` (a Responses object) as the check sees its ``tool_choice``: a custom tool named
    (alone or among ``allowed_tools``) checked as the function choice of the same shape."""
    choice = response.get("tool_choice") if isinstance(response, Mapping) else None
    if not isinstance(choice, Mapping):
        return response
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        checked: Any = {**choice, "tools": [_as_function_choice(entry) for entry in choice["tools"]]}
    else:
        checked = _as_function_choice(choice)
    return {**response, "tool_choice": checked} if checked != choice else response
