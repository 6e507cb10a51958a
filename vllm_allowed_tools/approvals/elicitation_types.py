"""The ``elicitation_type`` registry: each type's own fields on items and responses, the strict JSON
schemas built from them, and validation whose errors name the offending field.

A new kind of question (an ``oauth_login``, say) is one :func:`register_elicitation_type` call;
nothing else changes. Schemas are plain data (Draft 2020-12) so clients can validate too.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..response.conformance import register_output_item
from .approval_errors import (
    CODE_INVALID_ELICITATION,
    CODE_INVALID_ELICITATION_RESPONSE,
    CODE_UNKNOWN_ELICITATION_TYPE,
    ApprovalInputError,
)

__all__ = [
    "ACTIONS",
    "DIGEST_FIELD",
    "ELICITATION",
    "ELICITATION_COMMON_PROPERTIES",
    "ELICITATION_RESPONSE",
    "ID_FIELD",
    "OPTIONAL_STRING_FIELD",
    "RESPONSE_COMMON_PROPERTIES",
    "TOOL_CALL_APPROVAL",
    "ElicitationType",
    "elicitation_response_schema",
    "elicitation_schema",
    "elicitation_types",
    "register_elicitation_type",
    "unregister_elicitation_type",
    "validate_elicitation",
    "validate_elicitation_response",
]

ELICITATION = "elicitation"
ELICITATION_RESPONSE = "elicitation_response"
TOOL_CALL_APPROVAL = "tool_call_approval"
ACTIONS: tuple[str, ...] = ("accept", "decline", "cancel")
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

ID_FIELD = {"type": "string", "minLength": 1, "maxLength": 512}
DIGEST_FIELD = {"type": "string", "pattern": "^sha256:[0-9a-f]{64}$"}
OPTIONAL_STRING_FIELD = {"type": ["string", "null"]}

ELICITATION_COMMON_PROPERTIES: Mapping[str, Any] = {
    "id": ID_FIELD,
    "type": {"const": ELICITATION},
    "elicitation_type": {"type": "string", "minLength": 1},
    "message": {"type": "string"},
    "status": {"enum": ["in_progress", "completed", "incomplete", None]},
}
ELICITATION_COMMON_REQUIRED: tuple[str, ...] = ("id", "type", "elicitation_type", "message")

RESPONSE_COMMON_PROPERTIES: Mapping[str, Any] = {
    "id": ID_FIELD,
    "type": {"const": ELICITATION_RESPONSE},
    "elicitation_id": ID_FIELD,
    "action": {"enum": list(ACTIONS)},
    "reason": OPTIONAL_STRING_FIELD,
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
    register_output_item(ELICITATION, elicitation_schema)   # the check mode sees the new type


def unregister_elicitation_type(name: str) -> None:
    """Remove a registered type (items of it become unknown: a 400). ``tool_call_approval`` stays."""
    global _registry_version
    if name == TOOL_CALL_APPROVAL:
        raise ValueError("tool_call_approval cannot be unregistered")
    with _REGISTRY_LOCK:
        if _REGISTRY.pop(name, None) is not None:
            _registry_version += 1
    register_output_item(ELICITATION, elicitation_schema)


def elicitation_types() -> tuple[str, ...]:
    """The registered ``elicitation_type`` names, sorted."""
    return tuple(sorted(_REGISTRY))


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


def validate_elicitation(item: Any, *, param: str = "item") -> ElicitationType:
    """Validate one ``elicitation`` item against its type's schema; returns that type."""
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
    return kind


def validate_elicitation_response(item: Any, *, param: str = "item",
                                  elicitation_type: str | None = None) -> None:
    """Validate one ``elicitation_response``: against the rules of ``elicitation_type`` when the
    caller knows which type it answers, else against what any registered type accepts."""
    if elicitation_type is not None and elicitation_type not in _REGISTRY:
        raise ApprovalInputError(f"{param}.elicitation_id answers an elicitation of type "
                                 f"{elicitation_type!r}, which this server no longer supports.",
                                 param=f"{param}.elicitation_id", code=CODE_UNKNOWN_ELICITATION_TYPE)
    _check("response", elicitation_type, item, param, CODE_INVALID_ELICITATION_RESPONSE,
           _help_for(elicitation_type))
