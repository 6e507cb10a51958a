"""The approval items on the wire: ``elicitation`` (what the server asks) and
``elicitation_response`` (what the client answers), as the OpenResponses tool-call approvals
proposal shapes them, and finding them in a request's ``input``.

Parsing validates against the registered types' schemas (:mod:`.elicitation_types`); the
``tool_call_approval`` type is defined here, with its item class. Field by field in
``docs/approvals.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..request import ToolIdentity
from .elicitation_types import (
    DIGEST_FIELD,
    ELICITATION,
    ELICITATION_COMMON_PROPERTIES,
    ELICITATION_RESPONSE,
    ID_FIELD,
    OPTIONAL_STRING_FIELD,
    RESPONSE_COMMON_PROPERTIES,
    TOOL_CALL_APPROVAL,
    ElicitationType,
    elicitation_response_schema,
    elicitation_schema,
    register_elicitation_type,
    validate_elicitation,
    validate_elicitation_response,
)
from .approval_errors import CODE_INVALID_ELICITATION_RESPONSE, ApprovalInputError
from .scopes import SCOPES

__all__ = [
    "TOOL_CALL_APPROVAL_RESPONSE_SCHEMA",
    "TOOL_CALL_APPROVAL_SCHEMA",
    "ApprovalItems",
    "Elicitation",
    "ElicitationResponse",
    "ToolCallApproval",
    "parse_elicitation",
    "parse_elicitation_response",
    "parse_input_items",
]


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
    #: ``function``, or ``custom``: the call is a ``custom_tool_call`` and ``arguments`` its raw
    #: ``input`` (on the wire only then, as ``"tool_type": "custom"``)
    tool_type: str = "function"

    @property
    def identity(self) -> ToolIdentity:
        return ToolIdentity(self.namespace, self.name)

    @classmethod
    def from_json(cls, item: Mapping[str, Any]) -> ToolCallApproval:
        return cls(id=item["id"], message=item["message"], call_id=item["call_id"],
                   name=item["name"], namespace=item.get("namespace"), arguments=item["arguments"],
                   arguments_digest=item["arguments_digest"],
                   tool_definition_digest=item["tool_definition_digest"],
                   requested_scopes=tuple(item["requested_scopes"]), expires_at=item["expires_at"],
                   tool_type=item.get("tool_type") or "function")

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
        if self.tool_type != "function":
            out["tool_type"] = self.tool_type
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
        "call_id": ID_FIELD,
        "name": {"type": "string", "minLength": 1},
        "namespace": OPTIONAL_STRING_FIELD,
        "arguments": {"type": "string"},
        "arguments_digest": DIGEST_FIELD,
        "tool_definition_digest": DIGEST_FIELD,
        "requested_scopes": {"type": "array", "items": {"enum": list(SCOPES)}, "minItems": 1,
                             "uniqueItems": True},
        "expires_at": {"type": "integer", "minimum": 0},
        # an extension: a custom tool's call (``arguments`` holds its raw ``input``)
        "tool_type": {"enum": ["function", "custom"]},
    },
    item_required=("call_id", "name", "arguments", "arguments_digest", "tool_definition_digest",
                   "requested_scopes", "expires_at"),
    response_properties={
        "scope": {"enum": [*SCOPES, None]},
        "call_id": ID_FIELD,
        "arguments_digest": DIGEST_FIELD,
        "tool_definition_digest": DIGEST_FIELD,
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
# parsing


def parse_elicitation(item: Any, *, param: str = "item") -> Elicitation | ToolCallApproval:
    """Validate one ``elicitation`` item; returns the type's class (or a generic Elicitation)."""
    kind = validate_elicitation(item, param=param)
    if kind.item_class is not None:
        return kind.item_class.from_json(item)
    return Elicitation.from_json(item)


def parse_elicitation_response(item: Any, *, param: str = "item",
                               elicitation_type: str | None = None) -> ElicitationResponse:
    """Validate one ``elicitation_response``: against the rules of ``elicitation_type`` when the
    caller knows which type it answers (the engine does, from its record), else the common schema."""
    validate_elicitation_response(item, param=param, elicitation_type=elicitation_type)
    return ElicitationResponse.from_json(item)


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
