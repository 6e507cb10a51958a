"""Wire items: ``elicitation`` and ``elicitation_response``, their JSON schemas and validation.

Shapes follow the OpenResponses proposal (seeds/proposal-tool-call-approvals.txt) plus what its
discussion asks for. Common fields of every elicitation: ``id``, ``type: "elicitation"``,
``elicitation_type`` (the discriminator), ``message``, optional ``status``. Of every response: ``id``,
``type: "elicitation_response"``, ``elicitation_id``, ``action`` (``accept`` / ``decline`` /
``cancel``), optional ``reason``. Optional fields may be ``null`` (SDKs often serialize unset fields
that way); ``null`` means absent.

``elicitation_type`` values live in a **registry** (:func:`register_elicitation_type`): each type adds
its own item fields, response fields and response rules. ``tool_call_approval`` is registered here;
an ``oauth_login`` type can be added the same way without touching anything else. An
``elicitation`` item of an unregistered type is a 400 naming ``<param>.elicitation_type``.

``tool_call_approval`` item (what the server emits; every field below is required)::

    {"id": "elicit_9f...", "type": "elicitation", "elicitation_type": "tool_call_approval",
     "message": "The assistant wants to call add_pr_comment.",
     "call_id": "call_abc", "name": "add_pr_comment", "namespace": null,
     "arguments": "{\\"pr_number\\": 123}",
     "arguments_digest": "sha256:<hex>", "tool_definition_digest": "sha256:<hex>",
     "requested_scopes": ["once", "session"], "expires_at": 1767225600}

(``namespace`` is optional: present for a Responses namespace member, like on ``function_call``
items; ``name`` is then the bare member name.) ``tool_call_approval`` response::

    {"id": "elicit_resp_1", "type": "elicitation_response", "elicitation_id": "elicit_9f...",
     "action": "accept", "scope": "session", "reason": "optional"}

``scope`` is required with ``accept`` and must be absent (or null) otherwise. A response may also
repeat ``call_id``, ``arguments_digest`` and ``tool_definition_digest`` of the elicitation it answers;
when it does they must equal the server's record (an extra binding a careful client can assert; the
server never relies on them, nor on an echoed elicitation item).

Validation uses :mod:`jsonschema` (Draft 2020-12) against the schemas below, which are plain data
(:func:`elicitation_schema`, :func:`elicitation_response_schema`, and the two ``TOOL_CALL_APPROVAL_*``
constants) and strict (no unknown keys). Errors are :class:`ApprovalInputError` whose ``param`` names
the field (``input[3].scope``).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..request import ToolIdentity
from .errors import (
    CODE_INVALID_ELICITATION,
    CODE_INVALID_ELICITATION_RESPONSE,
    CODE_UNKNOWN_ELICITATION_TYPE,
    ApprovalInputError,
)
from .scopes import SCOPES

__all__ = [
    "ACTIONS",
    "ELICITATION",
    "ELICITATION_RESPONSE",
    "TOOL_CALL_APPROVAL",
    "TOOL_CALL_APPROVAL_RESPONSE_SCHEMA",
    "TOOL_CALL_APPROVAL_SCHEMA",
    "ApprovalItems",
    "Elicitation",
    "ElicitationResponse",
    "ElicitationType",
    "ToolCallApproval",
    "elicitation_response_schema",
    "elicitation_schema",
    "elicitation_types",
    "get_elicitation_type",
    "parse_elicitation",
    "parse_elicitation_response",
    "parse_input_items",
    "register_elicitation_type",
    "unregister_elicitation_type",
]

ELICITATION = "elicitation"
ELICITATION_RESPONSE = "elicitation_response"
TOOL_CALL_APPROVAL = "tool_call_approval"
ACTIONS: tuple[str, ...] = ("accept", "decline", "cancel")
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_ID = {"type": "string", "minLength": 1, "maxLength": 512}
_DIGEST = {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}
_OPT_STRING = {"type": ["string", "null"]}

ELICITATION_COMMON_PROPERTIES: Mapping[str, Any] = {
    "id": _ID,
    "type": {"const": ELICITATION},
    "elicitation_type": {"type": "string", "minLength": 1},
    "message": {"type": "string"},
    "status": {"enum": ["in_progress", "completed", "incomplete", None]},
}
ELICITATION_COMMON_REQUIRED: tuple[str, ...] = ("id", "type", "elicitation_type", "message")

RESPONSE_COMMON_PROPERTIES: Mapping[str, Any] = {
    "id": _ID,
    "type": {"const": ELICITATION_RESPONSE},
    "elicitation_id": _ID,
    "action": {"enum": list(ACTIONS)},
    "reason": _OPT_STRING,
}
RESPONSE_COMMON_REQUIRED: tuple[str, ...] = ("id", "type", "elicitation_id", "action")


# --------------------------------------------------------------------------------------------------
# the registry


@dataclass(frozen=True)
class ElicitationType:
    """One ``elicitation_type``: its extra fields on items and responses, as JSON schema fragments.

    ``response_rules`` are extra schema objects every response to this type must satisfy (``allOf``),
    e.g. "scope is required when action is accept". ``field_help`` adds a sentence to validation
    errors about a field. ``item_class`` (with ``from_json(dict)``) gives parsed items a typed class;
    without one they are generic :class:`Elicitation` objects.
    """

    name: str
    item_properties: Mapping[str, Any]
    item_required: tuple[str, ...] = ()
    response_properties: Mapping[str, Any] = field(default_factory=dict)
    response_rules: tuple[Mapping[str, Any], ...] = ()
    field_help: Mapping[str, str] = field(default_factory=dict)
    item_class: Any = None


_REGISTRY: dict[str, ElicitationType] = {}
_REGISTRY_LOCK = threading.Lock()
_registry_version = 0


def register_elicitation_type(kind: ElicitationType, *, replace: bool = False) -> None:
    """Add an ``elicitation_type`` (or replace one with ``replace=True``).

    Its fields may not redefine the common ones. Schemas and validators are rebuilt on next use.
    """
    global _registry_version
    clash = set(kind.item_properties) & set(ELICITATION_COMMON_PROPERTIES)
    clash |= set(kind.response_properties) & set(RESPONSE_COMMON_PROPERTIES)
    if clash:
        raise ValueError(f"elicitation type {kind.name!r} redefines common fields {sorted(clash)}")
    with _REGISTRY_LOCK:
        if kind.name in _REGISTRY and not replace:
            raise ValueError(f"elicitation type {kind.name!r} is already registered")
        _REGISTRY[kind.name] = kind
        _registry_version += 1


def unregister_elicitation_type(name: str) -> None:
    """Remove a registered type (items of it become unknown: a 400). ``tool_call_approval`` stays."""
    global _registry_version
    if name == TOOL_CALL_APPROVAL:
        raise ValueError("tool_call_approval cannot be unregistered")
    with _REGISTRY_LOCK:
        if _REGISTRY.pop(name, None) is not None:
            _registry_version += 1


def elicitation_types() -> tuple[str, ...]:
    """The registered ``elicitation_type`` names, sorted."""
    return tuple(sorted(_REGISTRY))


def get_elicitation_type(name: str) -> ElicitationType | None:
    return _REGISTRY.get(name)


# --------------------------------------------------------------------------------------------------
# schemas (plain data)


def _object(properties: Mapping[str, Any], required: Sequence[str],
            extra: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": dict(properties),
                              "required": list(required), "additionalProperties": False}
    if extra:
        schema["allOf"] = [dict(rule) for rule in extra]
    return schema


def _item_schema(kind: ElicitationType) -> dict[str, Any]:
    props = dict(ELICITATION_COMMON_PROPERTIES)
    props.update(kind.item_properties)
    props["elicitation_type"] = {"const": kind.name}
    return _object(props, (*ELICITATION_COMMON_REQUIRED, *kind.item_required))


def _response_schema(kind: ElicitationType | None) -> dict[str, Any]:
    props = dict(RESPONSE_COMMON_PROPERTIES)
    if kind is not None:
        props.update(kind.response_properties)
        return _object(props, RESPONSE_COMMON_REQUIRED, kind.response_rules)
    # any registered type: the union of their response fields (a field two types define
    # differently may take either shape)
    for registered in _REGISTRY.values():
        for name, fragment in registered.response_properties.items():
            if name in props and props[name] != fragment:
                existing = props[name]
                options = list(existing["anyOf"]) if "anyOf" in existing else [existing]
                if fragment not in options:
                    options.append(fragment)
                props[name] = {"anyOf": options}
            else:
                props[name] = fragment
    return _object(props, RESPONSE_COMMON_REQUIRED)


def elicitation_schema(elicitation_type: str | None = None) -> dict[str, Any]:
    """JSON schema of an ``elicitation`` item: of one registered type, or (None) of any registered
    type (``elicitation_type`` an enum of them, each dispatching to its own strict schema)."""
    if elicitation_type is not None:
        kind = _REGISTRY.get(elicitation_type)
        if kind is None:
            raise KeyError(elicitation_type)
        return {"$schema": SCHEMA_DIALECT, **_item_schema(kind)}
    common = dict(ELICITATION_COMMON_PROPERTIES)
    common["elicitation_type"] = {"enum": list(elicitation_types())}
    return {
        "$schema": SCHEMA_DIALECT,
        "type": "object",
        "properties": common,
        "required": list(ELICITATION_COMMON_REQUIRED),
        "allOf": [{"if": {"properties": {"elicitation_type": {"const": name}},
                          "required": ["elicitation_type"]},
                   "then": _item_schema(_REGISTRY[name])} for name in elicitation_types()],
    }


def elicitation_response_schema(elicitation_type: str | None = None) -> dict[str, Any]:
    """JSON schema of an ``elicitation_response``: to one registered type (with that type's rules),
    or (None) to any registered type (common fields plus every type's fields, no per-type rules:
    a response does not say which type it answers; the server knows it from its record)."""
    if elicitation_type is not None:
        kind = _REGISTRY.get(elicitation_type)
        if kind is None:
            raise KeyError(elicitation_type)
        return {"$schema": SCHEMA_DIALECT, **_response_schema(kind)}
    return {"$schema": SCHEMA_DIALECT, **_response_schema(None)}


# --------------------------------------------------------------------------------------------------
# validation


@functools.lru_cache(maxsize=64)
def _validator(kind: str, type_name: str | None, version: int) -> Any:
    try:
        from jsonschema import Draft202012Validator
    except ModuleNotFoundError as exc:  # pragma: no cover - a packaging error
        raise RuntimeError("approvals need the `jsonschema` package (pip install jsonschema)") from exc
    if kind == "common":
        schema = {"type": "object", "properties": dict(ELICITATION_COMMON_PROPERTIES),
                  "required": list(ELICITATION_COMMON_REQUIRED)}
    elif kind == "item":
        schema = elicitation_schema(type_name)
    else:
        schema = elicitation_response_schema(type_name)
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _js(value: Any) -> str:
    text = json.dumps(value, default=repr, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _path_param(base: str, path: Sequence[Any]) -> str:
    out = base
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _check(kind: str, type_name: str | None, item: Any, param: str, code: str,
           help_text: Mapping[str, str]) -> None:
    from jsonschema.exceptions import best_match

    validator = _validator(kind, type_name, _registry_version)
    error = best_match(validator.iter_errors(item))
    if error is None:
        return
    path = list(error.absolute_path)
    instance = error.instance
    if error.validator == "required" and isinstance(instance, Mapping):
        missing = next((name for name in error.validator_value if name not in instance), None)
        path.append(missing)
        problem = "is required"
    elif error.validator == "additionalProperties" and isinstance(instance, Mapping):
        known = error.schema.get("properties", {})
        unexpected = next((name for name in instance if name not in known), None)
        path.append(unexpected)
        problem = f"is not a field of this item (known fields: {', '.join(sorted(known))})"
    elif error.validator == "type" and not path and not isinstance(instance, Mapping):
        problem = "must be a JSON object"
    elif error.validator == "enum":
        problem = (f"must be one of {', '.join(_js(v) for v in error.validator_value)}, "
                   f"got {_js(instance)}")
    elif error.validator == "const":
        problem = (f"must be {_js(error.validator_value)} here, got {_js(instance)}"
                   if error.validator_value is not None else f"must be absent here, got {_js(instance)}")
    elif error.validator == "type":
        expected = error.validator_value
        expected = " or ".join(expected) if isinstance(expected, list) else expected
        problem = f"must be of type {expected}, got {_js(instance)}"
    else:
        problem = f"is invalid: {error.message}"
    where = _path_param(param, path)
    message = f"{where} {problem}."
    last = path[-1] if path else None
    if isinstance(last, str) and last in help_text:
        message += f" {help_text[last]}"
    raise ApprovalInputError(message, param=where, code=code)


def _help_for(type_name: str | None) -> Mapping[str, str]:
    if type_name is not None and type_name in _REGISTRY:
        return _REGISTRY[type_name].field_help
    merged: dict[str, str] = {}
    for kind in _REGISTRY.values():
        merged.update(kind.field_help)
    return merged


def parse_elicitation(item: Any, *, param: str = "item") -> Elicitation | ToolCallApproval:
    """Validate one ``elicitation`` item; returns the type's class (or a generic Elicitation)."""
    _check("common", None, item, param, CODE_INVALID_ELICITATION, {})
    name = item["elicitation_type"]
    kind = _REGISTRY.get(name)
    if kind is None:
        known = ", ".join(json.dumps(n) for n in elicitation_types())
        raise ApprovalInputError(
            f"{param}.elicitation_type {json.dumps(name)} is not an elicitation type this server "
            f"knows; known types: {known}.",
            param=f"{param}.elicitation_type", code=CODE_UNKNOWN_ELICITATION_TYPE)
    _check("item", name, item, param, CODE_INVALID_ELICITATION, kind.field_help)
    if kind.item_class is not None:
        return kind.item_class.from_json(item)
    return Elicitation.from_json(item)


def parse_elicitation_response(item: Any, *, param: str = "item",
                               elicitation_type: str | None = None) -> ElicitationResponse:
    """Validate one ``elicitation_response``: against the rules of ``elicitation_type`` when the
    caller knows which type it answers (the engine does, from its record), else the common schema."""
    if elicitation_type is not None and elicitation_type not in _REGISTRY:
        raise ApprovalInputError(f"{param}.elicitation_id answers an elicitation of type "
                                 f"{elicitation_type!r}, which this server no longer supports.",
                                 param=f"{param}.elicitation_id", code=CODE_UNKNOWN_ELICITATION_TYPE)
    _check("response", elicitation_type, item, param, CODE_INVALID_ELICITATION_RESPONSE,
           _help_for(elicitation_type))
    return ElicitationResponse.from_json(item)


# --------------------------------------------------------------------------------------------------
# item classes


def _drop_none(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}


@dataclass(frozen=True)
class Elicitation:
    """An elicitation item of any registered type; ``fields`` holds the type's own fields."""

    id: str
    elicitation_type: str
    message: str
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> Elicitation:
        common = set(ELICITATION_COMMON_PROPERTIES)
        return cls(id=item["id"], elicitation_type=item["elicitation_type"], message=item["message"],
                   fields={k: v for k, v in item.items() if k not in common and v is not None})

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": ELICITATION, "elicitation_type": self.elicitation_type,
                "message": self.message, **self.fields}


@dataclass(frozen=True)
class ToolCallApproval:
    """A ``tool_call_approval`` elicitation: one proposed call, bound by digests, with an expiry."""

    elicitation_type: ClassVar[str] = TOOL_CALL_APPROVAL

    id: str
    message: str
    call_id: str
    name: str
    namespace: str | None
    arguments: str
    arguments_digest: str
    tool_definition_digest: str
    requested_scopes: tuple[str, ...]
    expires_at: int

    @property
    def identity(self) -> ToolIdentity:
        return ToolIdentity(self.namespace, self.name)

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> ToolCallApproval:
        return cls(id=item["id"], message=item["message"], call_id=item["call_id"],
                   name=item["name"], namespace=item.get("namespace"), arguments=item["arguments"],
                   arguments_digest=item["arguments_digest"],
                   tool_definition_digest=item["tool_definition_digest"],
                   requested_scopes=tuple(item["requested_scopes"]), expires_at=item["expires_at"])

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "type": ELICITATION, "elicitation_type": TOOL_CALL_APPROVAL,
            "message": self.message, "call_id": self.call_id, "name": self.name,
        }
        if self.namespace is not None:
            out["namespace"] = self.namespace
        out.update({"arguments": self.arguments, "arguments_digest": self.arguments_digest,
                    "tool_definition_digest": self.tool_definition_digest,
                    "requested_scopes": list(self.requested_scopes), "expires_at": self.expires_at})
        return out


@dataclass(frozen=True)
class ElicitationResponse:
    """An ``elicitation_response``. ``scope`` is the tool_call_approval field; ``fields`` holds the
    other type-specific fields that were present (e.g. the optional ``call_id`` binding)."""

    id: str
    elicitation_id: str
    action: str
    reason: str | None = None
    scope: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> ElicitationResponse:
        common = set(RESPONSE_COMMON_PROPERTIES) | {"scope"}
        return cls(id=item["id"], elicitation_id=item["elicitation_id"], action=item["action"],
                   reason=item.get("reason"), scope=item.get("scope"),
                   fields={k: v for k, v in item.items() if k not in common and v is not None})

    def to_json(self) -> dict[str, Any]:
        return _drop_none({"id": self.id, "type": ELICITATION_RESPONSE,
                           "elicitation_id": self.elicitation_id, "action": self.action,
                           "scope": self.scope, "reason": self.reason, **self.fields})


register_elicitation_type(ElicitationType(
    name=TOOL_CALL_APPROVAL,
    item_properties={
        "call_id": _ID,
        "name": {"type": "string", "minLength": 1},
        "namespace": _OPT_STRING,
        "arguments": {"type": "string"},
        "arguments_digest": _DIGEST,
        "tool_definition_digest": _DIGEST,
        "requested_scopes": {"type": "array", "items": {"enum": list(SCOPES)}, "minItems": 1,
                             "uniqueItems": True},
        "expires_at": {"type": "integer", "minimum": 0},
    },
    item_required=("call_id", "name", "arguments", "arguments_digest", "tool_definition_digest",
                   "requested_scopes", "expires_at"),
    response_properties={
        "scope": {"enum": [*SCOPES, None]},
        "call_id": _ID,
        "arguments_digest": _DIGEST,
        "tool_definition_digest": _DIGEST,
    },
    response_rules=(
        {"if": {"properties": {"action": {"const": "accept"}}, "required": ["action"]},
         "then": {"properties": {"scope": {"enum": list(SCOPES)}}, "required": ["scope"]},
         "else": {"properties": {"scope": {"const": None}}}},
    ),
    field_help={"scope": 'With action "accept", scope is one of "once", "session", "always" (from '
                         "the elicitation's requested_scopes); with decline or cancel, leave it out.",
                "requested_scopes": 'A non-empty list of distinct scopes from "once", "session", '
                                    '"always".'},
    item_class=ToolCallApproval,
))

#: The strict schema of a ``tool_call_approval`` elicitation item (plain data).
TOOL_CALL_APPROVAL_SCHEMA: Mapping[str, Any] = elicitation_schema(TOOL_CALL_APPROVAL)
#: The strict schema of an ``elicitation_response`` to a ``tool_call_approval`` (plain data).
TOOL_CALL_APPROVAL_RESPONSE_SCHEMA: Mapping[str, Any] = elicitation_response_schema(TOOL_CALL_APPROVAL)


# --------------------------------------------------------------------------------------------------
# a request's input


@dataclass(frozen=True)
class ApprovalItems:
    """The approval items of one request's ``input``, each with its index there."""

    elicitations: tuple[tuple[int, Elicitation | ToolCallApproval], ...] = ()
    responses: tuple[tuple[int, ElicitationResponse], ...] = ()
    param: str = "input"

    def __bool__(self) -> bool:
        return bool(self.elicitations or self.responses)


def parse_input_items(items: Sequence[Any], *, param: str = "input") -> ApprovalItems:
    """Find and validate every ``elicitation`` / ``elicitation_response`` in a Responses ``input``.

    Other items are left alone. The first invalid item raises :class:`ApprovalInputError` naming
    ``input[i].<field>``; two responses to one elicitation in one request are refused too (the second
    is named). Nothing is looked up or consumed here.
    """
    elicitations: list[tuple[int, Elicitation | ToolCallApproval]] = []
    responses: list[tuple[int, ElicitationResponse]] = []
    answered: dict[str, int] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if kind == ELICITATION:
            elicitations.append((i, parse_elicitation(item, param=f"{param}[{i}]")))
        elif kind == ELICITATION_RESPONSE:
            response = parse_elicitation_response(item, param=f"{param}[{i}]")
            first = answered.setdefault(response.elicitation_id, i)
            if first != i:
                raise ApprovalInputError(
                    f"{param}[{i}].elicitation_id answers {response.elicitation_id!r} again "
                    f"({param}[{first}] already does); send one response per elicitation.",
                    param=f"{param}[{i}].elicitation_id", code=CODE_INVALID_ELICITATION_RESPONSE)
            responses.append((i, response))
    return ApprovalItems(elicitations=tuple(elicitations), responses=tuple(responses), param=param)

