"""Open Responses conformance: what the server sends on ``/v1/responses``, checked against the
published OpenAPI schema (``openresponses/openapi.json``, vendored with its source and licence).

Why a check of our own: vLLM's Responses objects miss fields the schema requires and carry nulls
where it wants values, and the approvals add an item type (``elicitation``) the schema does not
know. :func:`check_response` / :func:`check_event` say exactly what does not conform, as readable
paths (``output[0].content[0].logprobs: None is not of type 'array'``), so the fixer
(:mod:`.conform`) can be held to it in the tests and in a running server's check mode.

The document is OpenAPI 3.1, whose schemas are JSON Schema 2020-12 (nullable fields are
``anyOf: [X, {type: null}]``, no 3.0 ``nullable``); ``$ref`` to ``#/components/schemas/...`` are
resolved inside the document. Two changes are made to a private copy before validating, neither
loosening what a standard item must be:

- a ``oneOf`` with a ``discriminator`` is validated by dispatching on the discriminator (what
  OpenAPI means by it), so an error names the field of the branch the object claims to be, not
  "is not valid under any of the given schemas";
- an output item type another part of the package adds (the approvals proposal's ``elicitation``,
  registered by ``approvals/elicitation_types.py``) is validated against the schema it registers
  (:func:`register_output_item`);
- OpenAI's custom tools (a ``custom_tool_call`` item, its input's events, a custom tool named in
  ``tool_choice``), which Open Responses does not define, against OpenAI's shapes
  (:mod:`.openai_extensions`).
"""

from __future__ import annotations

import copy
import functools
import json
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .openai_extensions import (
    CUSTOM_TOOL_CALL,
    EXTENSION_EVENTS,
    MCP_APPROVAL_REQUEST,
    MCP_CALL,
    WEB_SEARCH_CALL,
    custom_tool_call_schema,
    mcp_approval_request_schema,
    mcp_call_schema,
    web_search_call_schema,
    with_custom_choices_as_functions,
)

SCHEMA_FILE = Path(__file__).resolve().parent / "openresponses" / "openapi.json"
_ROOT = "urn:openresponses:openapi"
_REF = "#/components/schemas/"

#: the terminal event a response of each status ends its stream with
TERMINAL_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete",
                  "failed": "response.failed"}
TERMINAL_TYPES = frozenset(TERMINAL_EVENT.values())
#: the status each terminal event's response carries
TERMINAL_STATUS = {event: status for status, event in TERMINAL_EVENT.items()}

_MESSAGE_LIMIT = 240

#: OpenAI's names for events Open Responses names differently, with the same fields. vLLM sends the
#: OpenAI names, and OpenAI clients (the SDKs, Codex) know only those, so they are kept; such an
#: event is validated against the schema of its Open Responses name (a known, documented deviation
#: of the event name only; renaming would break every OpenAI client's reasoning display).
OPENAI_EVENT_ALIASES = {"response.reasoning_text.delta": "response.reasoning.delta",
                        "response.reasoning_text.done": "response.reasoning.done"}


@functools.cache
def document() -> dict[str, Any]:
    """The vendored OpenAPI document, as published."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


#: output item types other parts of the package add, each with its schema's maker
_ADDED_ITEMS: dict[str, Callable[[], Mapping[str, Any]]] = {}


def register_output_item(item_type: str, schema: Callable[[], Mapping[str, Any]]) -> None:
    """Validate output items of ``item_type`` against ``schema()`` (asked again whenever a
    registration changes: the approvals re-register when an elicitation type is added). The
    part that adds an item type says so here, so this module imports nothing above it."""
    _ADDED_ITEMS[item_type] = schema
    _prepared.cache_clear()
    _validator.cache_clear()


@functools.cache
def _prepared() -> dict[str, Any]:
    """The document with discriminated unions dispatched and the added item types in."""
    doc = copy.deepcopy(document())
    schemas = doc["components"]["schemas"]
    added = {kind: {k: v for k, v in schema().items() if k != "$schema"}
             for kind, schema in _ADDED_ITEMS.items()}
    schemas["ItemField"] = _dispatching(schemas["ItemField"], schemas,
                                        extra={**added,
                                               CUSTOM_TOOL_CALL: custom_tool_call_schema(),
                                               MCP_CALL: mcp_call_schema(),
                                               MCP_APPROVAL_REQUEST: mcp_approval_request_schema(),
                                               WEB_SEARCH_CALL: web_search_call_schema()})
    _walk(doc, schemas)
    schemas.update(dict(EXTENSION_EVENTS.values()))
    return doc


def _walk(node: Any, schemas: Mapping[str, Any]) -> None:
    """Replace every discriminated ``oneOf`` below ``node`` (in place)."""
    if isinstance(node, list):
        for child in node:
            _walk(child, schemas)
        return
    if not isinstance(node, dict):
        return
    for key, child in list(node.items()):
        if isinstance(child, dict) and "oneOf" in child and "discriminator" in child:
            node[key] = child = _dispatching(child, schemas)
        _walk(child, schemas)


def _tag_values(branch: Mapping[str, Any], schemas: Mapping[str, Any], prop: str) -> list[str]:
    ref = branch.get("$ref", "")
    target = schemas.get(ref[len(_REF):]) if ref.startswith(_REF) else branch
    field = (target or {}).get("properties", {}).get(prop, {})
    values = field.get("enum") or ([field["const"]] if "const" in field else [])
    return [v for v in values if isinstance(v, str)]


def _dispatching(union: Mapping[str, Any], schemas: Mapping[str, Any],
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``oneOf`` + ``discriminator`` as: the tag must be one of the branches' values, and an
    object with a tag is validated against that branch alone. A branch whose tag cannot be read
    leaves the union as it is."""
    if "discriminator" not in union:
        return dict(union)
    prop = union["discriminator"].get("propertyName", "type")
    branches: list[tuple[str, Mapping[str, Any]]] = []
    for branch in union.get("oneOf", ()):
        values = _tag_values(branch, schemas, prop)
        if not values:
            return dict(union)
        branches += [(value, branch) for value in values]
    branches += list((extra or {}).items())
    rest = {k: v for k, v in union.items() if k not in ("oneOf", "discriminator")}
    return {**rest, "type": "object", "required": [prop],
            "properties": {prop: {"enum": [value for value, _ in branches]}},
            "allOf": [{"if": {"properties": {prop: {"const": value}}, "required": [prop]},
                       "then": branch} for value, branch in branches]}


@functools.cache
def event_schemas() -> dict[str, str]:
    """Streamed event ``type`` -> the component that event must validate against (the union the
    document gives for ``POST /responses`` ``text/event-stream``)."""
    content = document()["paths"]["/responses"]["post"]["responses"]["200"]["content"]
    schemas = document()["components"]["schemas"]
    out: dict[str, str] = {}
    for branch in content["text/event-stream"]["schema"]["oneOf"]:
        name = branch["$ref"][len(_REF):]
        for value in _tag_values(branch, schemas, "type"):
            out[value] = name
    return {**out, **{kind: name for kind, (name, _) in EXTENSION_EVENTS.items()}}


@functools.cache
def _validator(component: str) -> Any:
    from jsonschema import Draft202012Validator
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012
    registry = Registry().with_resource(_ROOT, DRAFT202012.create_resource(_prepared()))
    return Draft202012Validator({"$ref": f"{_ROOT}{_REF}{component}"}, registry=registry)


def check(instance: Any, component: str) -> list[str]:
    """What in ``instance`` does not conform to the component schema ``component``: one readable
    line per problem (``path: why``), in path order; empty when it conforms."""
    errors = _validator(component).iter_errors(instance)
    lines: list[str] = []
    for error in sorted(errors, key=lambda e: [str(p) for p in e.absolute_path]):
        lines += _describe(error)
    return list(dict.fromkeys(lines))


def _describe(error: Any) -> list[str]:
    """An ``anyOf`` / ``oneOf`` failure is described by the branch the value was meant for: the
    ``null`` branch of a nullable field is ignored, and when what is left failed in one branch its
    own errors are the description."""
    if error.validator in ("anyOf", "oneOf") and error.context:
        meant = [e for e in error.context
                 if not (e.validator == "type" and e.validator_value == "null")]
        branches = {e.relative_schema_path[0] for e in meant if e.relative_schema_path}
        if meant and len(branches) == 1:
            return [line for sub in meant for line in _describe(sub)]
    message = error.message
    if len(message) > _MESSAGE_LIMIT:
        message = message[:_MESSAGE_LIMIT] + "..."
    return [f"{format_path(error.absolute_path)}: {message}"]


def format_path(parts: Iterable[Any]) -> str:
    """``output[0].content[1].text``; ``(root)`` for the object itself."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(root)"


#: Open Responses defines one tool type (its ``Tool`` union has only ``function``); a request may
#: carry others (OpenAI's namespaces, custom tools, hosted tools such as ``web_search``). The
#: ``tools`` echo shows them as the client sent them, so they are left out of the check: a
#: documented deviation, not a fixable one.
DEFINED_TOOL_TYPES = frozenset({"function"})


def _without_extension_tools(response: Any) -> Any:
    response = with_custom_choices_as_functions(response)
    tools = response.get("tools") if isinstance(response, Mapping) else None
    if not isinstance(tools, list):
        return response
    return {**response, "tools": [tool for tool in tools if not (
        isinstance(tool, Mapping) and tool.get("type") not in DEFINED_TOOL_TYPES)]}


def check_response(response: Any) -> list[str]:
    """A Responses object (a unary answer, or the ``response`` of an event)."""
    return check(_without_extension_tools(response), "ResponseResource")


def check_event(event: Any) -> list[str]:
    """A streamed Responses event: its own schema (chosen by its ``type``), and for a terminal
    event, that it is the one its response's ``status`` ends with."""
    if not isinstance(event, Mapping):
        return [f"(root): {event!r} is not an object"]
    kind = event.get("type")
    alias = OPENAI_EVENT_ALIASES.get(kind) if isinstance(kind, str) else None
    component = event_schemas().get(alias or kind) if isinstance(kind, str) else None
    if component is None:
        return [f"type: {kind!r} is not an Open Responses streaming event type"]
    response = event.get("response")
    checked = {**event, "type": alias} if alias else event
    if isinstance(response, Mapping):
        checked = {**checked, "response": _without_extension_tools(response)}
    problems = check(checked, component)
    if kind in TERMINAL_TYPES and isinstance(response, Mapping) \
            and response.get("status") != TERMINAL_STATUS[kind]:
        problems.append(f"response.status: {response.get('status')!r} ends the stream with "
                        f"{kind} (a response of that status ends with "
                        f"{TERMINAL_EVENT.get(response.get('status'), 'no terminal event')})")
    return problems


def check_stream(events: Iterable[Any]) -> list[str]:
    """Every event of a whole stream (problems prefixed by the event's position), and that the
    stream ends with exactly one terminal event, last."""
    problems: list[str] = []
    terminals: list[int] = []
    count = 0
    for index, event in enumerate(events):
        count = index + 1
        problems += [f"event {index}: {problem}" for problem in check_event(event)]
        if isinstance(event, Mapping) and event.get("type") in TERMINAL_TYPES:
            terminals.append(index)
    if terminals != [count - 1]:
        problems.append(f"stream: terminal events at {terminals} of {count} events "
                        "(expected exactly one, last)")
    return problems


# -- making what vLLM sends conform (never in place: an unchanged event keeps its bytes)

#: the request-echo fields vLLM 0.32 leaves out, and what they are when it does: the response
#: is not stored (this server refuses the retrieve routes), no safety identifier or cache key was
#: echoed (``restore_echo`` puts the client's own back where the middleware knows it)
_MISSING = {"error": None, "store": False, "safety_identifier": None, "prompt_cache_key": None}
_DEFAULT_TEXT = {"format": {"type": "text"}}


def conformed_response(response: Any, *, now: Callable[[], float] = time.time) -> Any:
    """``response`` as the schema wants it (the same object when it already is): the fields vLLM
    omits added, ``completed_at`` the time a ``completed`` response is sent (else null), a null
    ``text`` the default text format, a null ``top_logprobs`` 0, and its output items conformed."""
    if not isinstance(response, dict) or response.get("object") != "response":
        return response
    fixed: dict[str, Any] = {}
    if "completed_at" not in response:
        fixed["completed_at"] = int(now()) if response.get("status") == "completed" else None
    fixed.update({key: value for key, value in _MISSING.items() if key not in response})
    text = response.get("text", _DEFAULT_TEXT)
    if text is None:
        fixed["text"] = copy.deepcopy(_DEFAULT_TEXT)
    elif isinstance(text, dict) and (text.get("format", _DEFAULT_TEXT) is None
                                     or ("verbosity" in text and text["verbosity"] is None)):
        # a request's text without a format (Codex sends only ``verbosity``) is echoed by vLLM
        # with a null format: the default one; ``verbosity`` is optional, never null
        fixed["text"] = {**{k: v for k, v in text.items() if not (k == "verbosity" and v is None)},
                         **({"format": copy.deepcopy(_DEFAULT_TEXT["format"])}
                            if text.get("format", _DEFAULT_TEXT) is None else {})}
    if response.get("top_logprobs", 0) is None:
        fixed["top_logprobs"] = 0
    tools = response.get("tools")
    if isinstance(tools, list):
        filled = [conformed_tool(tool) for tool in tools]
        if any(new is not old for new, old in zip(filled, tools)):
            fixed["tools"] = filled
    output = response.get("output")
    if isinstance(output, list):
        items = [conformed_item(item) for item in output]
        if any(new is not old for new, old in zip(items, output)):
            fixed["output"] = items
    return {**response, **fixed} if fixed else response


#: what a function tool's echo must carry, and what it is when the request left it out
_FUNCTION_TOOL_FIELDS = {"description": None, "parameters": None, "strict": None}


def conformed_tool(tool: Any) -> Any:
    """A function tool in the echo with every field the schema requires (null where the request
    gave none); other tool types as they are."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        return tool
    missing = {key: value for key, value in _FUNCTION_TOOL_FIELDS.items() if key not in tool}
    return {**tool, **missing} if missing else tool


def conformed_item(item: Any) -> Any:
    """An output item: a message's null ``phase`` left out (it is optional, and never null), and
    its content parts conformed; a reasoning item's null ``encrypted_content`` left out and a null
    ``content`` an empty list (vLLM sends both while the item is being written)."""
    if isinstance(item, dict) and item.get("type") == "reasoning":
        new = {k: v for k, v in item.items() if not (k == "encrypted_content" and v is None)}
        if new.get("content", []) is None:
            new["content"] = []
        return new if new != item or len(new) != len(item) else item
    if not isinstance(item, dict) or item.get("type") != "message":
        return item
    new = {k: v for k, v in item.items() if k != "phase"} if item.get("phase", "") is None else item
    content = item.get("content")
    if isinstance(content, list):
        parts = [conformed_part(part) for part in content]
        if any(p is not q for p, q in zip(parts, content)):
            new = {**new, "content": parts}
    return new


def conformed_part(part: Any) -> Any:
    """A content part: a null ``logprobs`` left out (optional since 2026-04-24, never null)."""
    if isinstance(part, dict) and "logprobs" in part and part["logprobs"] is None:
        return {k: v for k, v in part.items() if k != "logprobs"}
    return part


def conformed_event(event: Any, *, now: Callable[[], float] = time.time) -> Any:
    """A streamed event as the schema wants it (the same object when it already is): its
    ``response``, ``item`` and ``part`` conformed, a null ``logprobs`` left out, and a terminal
    event renamed to the one its response's status ends with (vLLM ends an ``incomplete``
    response with ``response.completed``)."""
    if not isinstance(event, dict):
        return event
    fixed: dict[str, Any] = {}
    response = conformed_response(event.get("response"), now=now)
    if response is not event.get("response"):
        fixed["response"] = response
    kind = event.get("type")
    if kind in TERMINAL_TYPES and isinstance(response, dict):
        wanted = TERMINAL_EVENT.get(response.get("status"))
        if wanted is not None and wanted != kind:
            fixed["type"] = wanted
    for key, conform in (("item", conformed_item), ("part", conformed_part)):
        value = conform(event.get(key))
        if value is not event.get(key):
            fixed[key] = value
    new = {**event, **fixed} if fixed else event
    if "logprobs" in new and new["logprobs"] is None:
        new = {k: v for k, v in new.items() if k != "logprobs"}
    if kind == "response.mcp_call_arguments.done" and "name" in new:
        # vLLM adds the call's name, which OpenAI's event does not have (it is on the item)
        new = {k: v for k, v in new.items() if k != "name"}
    return new
