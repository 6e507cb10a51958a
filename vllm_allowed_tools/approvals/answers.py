"""Checking a follow-up's ``elicitation_response`` against the server's own record, before anything
is consumed: a bad answer is a 4xx the client can correct and resend, never a half-applied one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..request import FunctionSpec, ToolIdentity, TurnAllowlist
from .digests import definition_matches
from .approval_errors import (
    CODE_ELICITATION_CONSUMED,
    CODE_ELICITATION_MISMATCH,
    CODE_INVALID_ELICITATION_RESPONSE,
    CODE_TOOL_NOT_ALLOWED_THIS_TURN,
    CODE_UNKNOWN_ELICITATION,
    ApprovalInputError,
)
from .items import ElicitationResponse, parse_elicitation_response
from .outcomes import Release
from .store import ElicitationRecord, GrantStore

__all__ = ["CheckedAnswer", "check_answer", "function_call_ids", "release_of", "same_answer"]


@dataclass(frozen=True)
class CheckedAnswer:
    """An answer that passed every check, with the record it answers and what consuming it means."""

    response: ElicitationResponse
    record: ElicitationRecord
    param: str = "item"
    replay: bool = False
    stale: bool = False
    in_history: bool = False
    release: Release | None = None


def check_answer(store: GrantStore, response: ElicitationResponse | Mapping[str, Any], param: str,
                 principal: str, session: str | None,
                 catalog: Mapping[ToolIdentity, FunctionSpec | str] | None,
                 turn: TurnAllowlist | None | Literal[False],
                 history_calls: Collection[str] = ()) -> CheckedAnswer:
    """The checked answer, or :class:`ApprovalInputError` (4xx) naming what to fix. ``catalog``:
    the request's tools now (identity -> spec, or -> definition digest); None skips the definition
    check. ``turn``: see :meth:`~.engine.ApprovalEngine.resolve_all`; False skips the turn check
    (said explicitly)."""
    raw = response.to_json() if isinstance(response, ElicitationResponse) else response
    common = parse_elicitation_response(raw, param=param)
    record = store.get_elicitation(common.elicitation_id)
    if record is None or record.principal != principal or record.session != session:
        raise ApprovalInputError(
            f"{param}.elicitation_id {common.elicitation_id!r} does not name an elicitation "
            "that is waiting for this caller in this session.",
            param=f"{param}.elicitation_id", code=CODE_UNKNOWN_ELICITATION)
    typed = parse_elicitation_response(raw, param=param, elicitation_type=record.elicitation_type)
    if record.status != "pending" and not same_answer(record, typed):
        raise ApprovalInputError(
            f"{param}.elicitation_id {record.id!r} was already answered by another response "
            f"and is closed ({record.status}); an approval is single-use and its answer cannot "
            "be changed. Answer the current elicitation instead.",
            param=f"{param}.elicitation_id", code=CODE_ELICITATION_CONSUMED, status=409)
    in_history = record.call_id in history_calls
    bound = {"call_id": record.call_id, "arguments_digest": record.arguments_digest,
             "tool_definition_digest": record.definition_digest}
    for key, expected in bound.items():
        value = typed.fields.get(key)
        if value is not None and value != expected:
            raise ApprovalInputError(
                f"{param}.{key} does not match elicitation {record.id!r}: it answers another "
                "call. Send the response for the elicitation of that call.",
                param=f"{param}.{key}", code=CODE_ELICITATION_MISMATCH)
    if record.status != "pending":   # the same answer again
        if record.status != "accepted" or in_history:
            return CheckedAnswer(typed, record, param, replay=True, in_history=in_history)
        if turn is not False:         # released again: only if this turn could make the call
            _check_turn(record, param, turn)
        return CheckedAnswer(typed, record, param, replay=True, release=release_of(record))
    if typed.action == "accept" and typed.scope not in record.requested_scopes:
        raise ApprovalInputError(
            f"{param}.scope {typed.scope!r} was not offered for this call; choose one of "
            f"{list(record.requested_scopes)} (the elicitation's requested_scopes).",
            param=f"{param}.scope", code=CODE_INVALID_ELICITATION_RESPONSE)
    stale = False
    if catalog is not None:
        current = catalog.get(record.identity)
        stale = current is None or not definition_matches(current, record.definition_digest)
    if typed.action == "accept" and turn is not False:
        _check_turn(record, param, turn, stale=stale)
    return CheckedAnswer(typed, record, param, stale=stale, in_history=in_history)


#: the Responses items of calls a model made to the client's tools (functions, custom tools)
CALL_ITEM_TYPES = ("function_call", "custom_tool_call")


def function_call_ids(items: Sequence[Any]) -> set[str]:
    """The call ids of the ``function_call`` and ``custom_tool_call`` items of a Responses
    ``input`` list (its history)."""
    return {item["call_id"] for item in items if isinstance(item, Mapping)
            and item.get("type") in CALL_ITEM_TYPES and isinstance(item.get("call_id"), str)}


def same_answer(record: ElicitationRecord, response: ElicitationResponse) -> bool:
    """Is ``response`` the answer that closed ``record`` again (an idempotent resend)?

    Same action and, for ``accept``, the same scope, under any response id (an SDK retry keeps the
    id, a client that rebuilt its answer may not). A record closed without an answer of its own
    (expired, unanswered, definition changed: no ``action``) matches only its own response id."""
    if record.action is None:
        return record.response_id is not None and record.response_id == response.id
    return record.action == response.action and (response.action != "accept"
                                                 or record.scope == response.scope)


def release_of(record: ElicitationRecord) -> Release:
    """The release of an accepted record: the recorded call, the scope and grant of its answer."""
    return Release(call_id=record.call_id, name=record.name, namespace=record.namespace,
                   arguments=record.arguments, arguments_digest=record.arguments_digest,
                   definition_digest=record.definition_digest, via="approval", scope=record.scope,
                   grant_id=record.grant_id, elicitation_id=record.id, tool_type=record.tool_type)


def _check_turn(record: ElicitationRecord, param: str, turn: TurnAllowlist | None, *,
                stale: bool = False) -> None:
    """Raise a 400 unless this request (``turn``) could have made the recorded call.

    ``stale`` (a pending record whose tool left the catalog or changed): not this check's business,
    the record is declined as ``definition_changed``; only a turn that can call no tool at all is
    refused first. A repeated accept (the record is closed, it cannot be declined any more) is
    refused when this turn lacks the tool or has another definition of it."""
    tool = record.identity.flat_name
    fix = (f"Nothing was consumed: the elicitation stays answerable. Send the same "
           f"elicitation_response again in a request whose tools include {tool} (with the same "
           f"definition) and whose tool_choice allows calling it (e.g. \"auto\", or an "
           "allowed_tools list that includes it).")
    if turn is None:
        why = "this request has no tools (or a tool_choice the server cannot apply to them)"
    elif turn.choice == "none":
        why = 'this request\'s tool_choice is "none"'
    elif stale:
        return
    elif not any(spec.identity == record.identity
                 and definition_matches(spec, record.definition_digest)
                 for spec in turn.catalog):
        why = f"this request's tools do not include {tool} with the definition it had when it " \
              "was approved"
    elif turn.allowed is not None and record.identity not in turn.allowed:
        names = sorted(identity.flat_name for identity in turn.allowed)
        why = f"this request's tool_choice allows only {names}"
    else:
        return
    raise ApprovalInputError(
        f"{param} accepts the call {record.call_id!r} to {tool}, but {why}, so this turn could not "
        f"make that call and it is not released. {fix}",
        param=param, code=CODE_TOOL_NOT_ALLOWED_THIS_TURN)
