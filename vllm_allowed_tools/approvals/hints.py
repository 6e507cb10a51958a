"""A tool definition's own ``approval`` object: how a client asks for more approval than the
operator's policy requires, and never for less.

Every hint of a request is checked when the request arrives (:func:`check_hints`), so a bad one is
a 400 before generation instead of a failure in the middle of a response.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from ..request import ToolIdentity
from .approval_errors import CODE_INVALID_APPROVAL_HINT, ApprovalInputError
from .scopes import SCOPES, canonical_scopes



class HintJudge(Protocol):
    """What :func:`check_hints` needs of the operator's policy (:class:`.policy.ApprovalPolicy`):
    a hint combined with the rule for a tool, exactly as a call would be."""

    def effective(self, identity: ToolIdentity, hint: Any, *, hint_param: str) -> Any: ...

__all__ = ["approval_hint", "check_hints", "parse_hint"]

_HINT_KEYS = frozenset({"required", "scopes", "expires_in", "bind_arguments"})


def approval_hint(tool: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ``approval`` object of one tool definition, or None.

    Responses function tools and namespace members carry it at their top level; Chat tools inside
    ``function`` (a top-level one is accepted too). Validation happens in
    :meth:`ApprovalPolicy.effective` (or :func:`parse_hint`).
    """
    if not isinstance(tool, Mapping):
        return None
    if "approval" in tool:
        return tool["approval"]
    fn = tool.get("function")
    if isinstance(fn, Mapping) and "approval" in fn:
        return fn["approval"]
    return None


def parse_hint(hint: Any, *, param: str = "approval") -> dict[str, Any]:
    """Validate a tool definition's ``approval`` object; errors name ``param`` plus the key."""
    def bad(key: str, message: str) -> ApprovalInputError:
        return ApprovalInputError(f"{key} {message}", param=key, code=CODE_INVALID_APPROVAL_HINT)

    if not isinstance(hint, Mapping):
        raise bad(param, "must be an object such as {\"required\": true, \"scopes\": [\"once\"]}.")
    out: dict[str, Any] = {}
    for key, value in hint.items():
        where = f"{param}.{key}"
        if key not in _HINT_KEYS:
            raise bad(where, f"is not a known approval setting; expected one of {sorted(_HINT_KEYS)}.")
        if key in ("required", "bind_arguments"):
            if not isinstance(value, bool):
                raise bad(where, f"must be true or false, got {json.dumps(value, default=repr)}.")
        elif key == "scopes":
            if not isinstance(value, list) or not value or any(s not in SCOPES for s in value):
                raise bad(where, f"must be a non-empty list of scopes from {list(SCOPES)}.")
            value = canonical_scopes(value)
        elif key == "expires_in" and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
            raise bad(where, "must be a positive whole number of seconds.")
        out[key] = value
    return out


def check_hints(body: Mapping[str, Any], policy: HintJudge) -> None:
    """Validate every tool definition's ``approval`` object in a request, before any generation.

    Otherwise a hint is first read when the model calls its tool, in the middle of the response,
    where a bad one can only become a 500 or a cut stream (and one on a tool never called is never
    checked). Each hint is validated and combined with the operator's rule exactly as a call would
    be (:meth:`ApprovalPolicy.effective`), so a malformed hint or one that could never be approved
    raises :class:`ApprovalInputError` (400) whose ``param`` names it: ``tools[1].approval.scopes``
    (a Responses function tool, or a Chat tool's top level), ``tools[0].function.approval`` (Chat),
    ``tools[2].tools[0].approval`` (a Responses namespace member). ``"approval": null`` is no hint.
    An ``approval`` object where nothing reads it (on a namespace itself, on a non-function tool)
    or given twice for one Chat tool is refused too: the client asked for something that would
    silently not happen.
    """
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    for index, tool in enumerate(tools):
        for identity, hint, param in _hints_of(tool, f"tools[{index}]"):
            if identity is None:   # no usable name: the request fails elsewhere; check the shape
                parse_hint(hint, param=param)
            else:
                policy.effective(identity, hint, hint_param=param)


def _hints_of(tool: Any, where: str) -> list[tuple[ToolIdentity | None, Any, str]]:
    """(identity, hint, param) for each ``approval`` object that one ``tools[i]`` entry carries."""
    if not isinstance(tool, Mapping):
        return []
    kind = tool.get("type", "function")
    if kind == "namespace":
        _refuse_unread_hint(tool, where, "a namespace carries none; put it on each member "
                                         f"({where}.tools[j].approval)")
        namespace = tool.get("name") if isinstance(tool.get("name"), str) else None
        members = tool.get("tools") if isinstance(tool.get("tools"), list) else []
        return [(_member_identity(namespace, member), member["approval"],
                 f"{where}.tools[{j}].approval")
                for j, member in enumerate(members)
                if isinstance(member, Mapping) and member.get("approval") is not None]
    if kind != "function":
        _refuse_unread_hint(tool, where, f"only function tools carry one, not type {kind!r}")
        return []
    fn = tool.get("function") if isinstance(tool.get("function"), Mapping) else {}
    found = [(hint, param) for hint, param in ((tool.get("approval"), f"{where}.approval"),
                                               (fn.get("approval"), f"{where}.function.approval"))
             if hint is not None]
    if len(found) > 1:
        raise ApprovalInputError(
            f"{where} carries two approval objects ({where}.approval and "
            f"{where}.function.approval); keep one (Chat Completions: inside `function`).",
            param=f"{where}.approval", code=CODE_INVALID_APPROVAL_HINT)
    name = tool.get("name", fn.get("name"))
    identity = ToolIdentity(None, name) if isinstance(name, str) and name else None
    return [(identity, hint, param) for hint, param in found]


def _member_identity(namespace: str | None, member: Mapping[str, Any]) -> ToolIdentity | None:
    name = member.get("name")
    if namespace and isinstance(name, str) and name:
        return ToolIdentity(namespace, name)
    return None


def _refuse_unread_hint(tool: Mapping[str, Any], where: str, why: str) -> None:
    """An ``approval`` object nothing would read: refuse it instead of silently ignoring it."""
    if tool.get("approval") is not None:
        raise ApprovalInputError(f"{where}.approval is not read here: {why}.",
                                 param=f"{where}.approval", code=CODE_INVALID_APPROVAL_HINT)
