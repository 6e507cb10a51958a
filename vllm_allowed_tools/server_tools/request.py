"""The request side of server-side tools: the selection's server-side entries, the answers to
earlier approvals (OpenAI's ``mcp_approval_response``, OpenResponses' ``elicitation_response``),
and the :class:`~.turn.ServerTurn` the hook decides with. Pure over JSON bodies; blocking where it
asks the approval engine (call it off the event loop). No vLLM.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..approvals.approval_errors import ApprovalInputError
from ..approvals.outcomes import Decline, Rejected, Release, Replayed
from ..approvals.response_bodies import principal_from_headers, session_of
from ..errors import AllowedToolsError, quote, type_name
from ..settings import current
from ..wire import tool_choice_of
from .tools import (
    CODE_INVALID_SERVER_TOOL,
    TYPE_BUILTIN,
    ServerTarget,
    ServerTool,
    ServerTools,
    read_server_tools,
)
from .server_turn import TURN_KEY, ResumedCall, ServerSelection, ServerTurn

__all__ = ["CODE_SERVER_TOOLS_UNGUARDED", "PreparedServerTurn", "prepare_server_turn",
           "split_selection"]

#: ``code`` of the 400 for server-side tools where the plugin cannot decide their calls
CODE_SERVER_TOOLS_UNGUARDED = "server_tools_unguarded"

SERVER_ENTRY_TYPES = frozenset({"mcp", *TYPE_BUILTIN})


def _is_server_type(value: Any) -> bool:
    """A server-side entry's ``type`` (any other value, a list or an object too, is not one)."""
    return isinstance(value, str) and value in SERVER_ENTRY_TYPES
_APPROVAL_TYPES = ("mcp_approval_request", "mcp_approval_response")


def _error(message: str, param: str, code: str = CODE_INVALID_SERVER_TOOL) -> AllowedToolsError:
    return AllowedToolsError(message, param=param, code=code)


def split_selection(body: Mapping[str, Any], tools: ServerTools) -> tuple[dict[str, Any], ServerSelection | None, bool]:
    """The body without the server-side entries of its ``allowed_tools`` selection, those entries
    (None: the choice does not restrict server-side tools), and whether only server-side entries
    were selected (then no function may be called). A selection naming none of them, or a choice
    naming one function, allows no server-side tool."""
    choice = tool_choice_of(body, "responses")
    named = choice.named
    if named is not None and named.type in ("function", "custom"):
        return dict(body), ServerSelection(frozenset(), "required"), False
    if named is not None and _is_server_type(named.type):
        # a named server-side choice: the selection of that one tool, which must be called
        body = {**body, "tool_choice": {"type": "allowed_tools", "mode": "required",
                                        "tools": [dict(named.choice)]}}
        choice = tool_choice_of(body, "responses")
    selection = choice.allowed
    if selection is None or not isinstance(selection.entries, list):
        return dict(body), None, False
    kept, entries = _server_entries(selection.entries, tools)
    if not entries:
        return dict(body), ServerSelection(frozenset(), str(selection.mode)), False
    only_server = not kept
    new_body = dict(body)
    if only_server:
        selection.server_only_mode()   # a 400 unless "auto" or "required"
        new_body["tool_choice"] = "auto"   # functions: none may be called (the guard's filter)
    else:
        new_body["tool_choice"] = {**selection.choice, "tools": kept}
    return new_body, ServerSelection(frozenset(entries), str(selection.mode)), only_server


def _server_entries(entries_in: list[Any], tools: ServerTools) -> tuple[list[Any], set[tuple[int, str | None]]]:
    """The selection's other entries, and its server-side ones as (tool index, name or None)."""
    kept: list[Any] = []
    entries: set[tuple[int, str | None]] = set()
    for index, entry in enumerate(entries_in):
        param = f"tool_choice.tools[{index}]"
        if not isinstance(entry, Mapping) or not _is_server_type(entry.get("type")):
            kept.append(entry)
            continue
        kind = entry["type"]
        name = entry.get("name")
        if name is not None and (not isinstance(name, str) or not name):
            raise _error(f"{param}.name must be a tool name (a non-empty string), got "
                         f"{type_name(name)}.", f"{param}.name")
        if kind == "mcp":
            label = entry.get("server_label")
            if not isinstance(label, str) or not label:
                raise _error(f"{param}.server_label is required: select an mcp tool as "
                             "{\"type\": \"mcp\", \"server_label\": \"<label>\"} (optionally "
                             f"\"name\"), got {type_name(label)}.", f"{param}.server_label")
            tool = tools.by_label(label)
            if tool is None:
                raise _error(f"{param} selects the mcp server {quote(label)}, which is not a "
                             "server-side tool of this request (`tools` has no mcp tool with that "
                             "server_label that vLLM runs).", f"{param}.server_label")
            extra = sorted(set(entry) - {"type", "server_label", "name"})
        else:
            tool = tools.by_type(kind)
            if tool is None:
                raise _error(f"{param} selects {quote(kind)}, which is not in `tools`.", param)
            extra = sorted(set(entry) - {"type", "name"})
        if extra:
            raise _error(f"{param} has the unknown key {quote(extra[0])}.", f"{param}.{extra[0]}")
        if name is not None and not tool.offers(name):
            raise _error(f"{param}.name {quote(name)} is not in the allowed_tools of "
                         f"{tool.param}.", f"{param}.name")
        entries.add((tool.index, name))
    return kept, entries


def recipient_of(tool: ServerTool, tool_name: str) -> str:
    if tool.builtin == "python":
        return "python"
    return f"{tool.builtin}.{tool_name}"


@dataclass(frozen=True)
class PreparedServerTurn:
    body: dict[str, Any]
    turn: ServerTurn
    selection: ServerSelection | None
    only_server: bool


def policy_applies(tools: ServerTools, selection: ServerSelection | None, engine: Any) -> bool:
    """Whether anything restricts this request's server-side calls (then they must be decided)."""
    return engine is not None or selection is not None or any(
        tool.require_approval is not None and tool.require_approval.mode != "never"
        for tool in tools.tools)


def prepare_server_turn(body: dict[str, Any], tools: ServerTools, *, engine: Any,
                        headers: Any, harmony: bool, hook: Any,
                        operator_engine: bool, render: bool = False) -> PreparedServerTurn | None:
    """The request's server-side turn (None: no server-side tools), or a 4xx before generation.

    ``engine``: the approval engine server-side calls are recorded with (None: no grant store);
    ``operator_engine``: whether it carries the operator's policy; ``hook``: the glue's
    :class:`~.turn.HookStatus`; ``harmony``: whether the model is served on vLLM's harmony path,
    the only one whose server-side calls the hook sees. ``render``: a render request (nothing
    runs): the selection is read, nothing else."""
    if not tools:
        return None
    body, selection, only_server = split_selection(body, tools)
    if render:
        turn = ServerTurn(tools, selection=selection)
        return PreparedServerTurn({k: v for k, v in body.items() if k != TURN_KEY}, turn,
                                  selection, only_server)
    _refuse_undecidable(body, tools, selection, engine, harmony=harmony, hook=hook,
                        operator_engine=operator_engine)
    principal = session = None
    if engine is not None:
        principal = principal_from_headers(headers, engine.store.principal_secret)
        session = session_of(body)
    body, resume = _answers(body, tools, selection, engine, principal, session)
    limit = body.get("max_tool_calls")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise _error(f"max_tool_calls must be a non-negative integer, got {type_name(limit)}.",
                     "max_tool_calls", "invalid_request")
    bound = current().max_server_tool_calls   # the server's: a request can only lower it
    turn = ServerTurn(
        tools, selection=selection, tool_choice_none=tool_choice_of(body, "responses").string == "none",
        operator_gates=(functools.partial(_operator_gates, engine) if operator_engine else
                        (lambda tool, name: False)),
        propose=functools.partial(engine.propose, principal=principal, session=session)
        if engine is not None else None,
        resume=resume, max_tool_calls=bound if limit is None else min(limit, bound),
        store=engine.store if engine is not None else None)
    body = {k: v for k, v in body.items() if k != TURN_KEY}
    return PreparedServerTurn(body, turn, selection, only_server)


def _refuse_undecidable(body: Mapping[str, Any], tools: ServerTools,
                        selection: ServerSelection | None, engine: Any, *, harmony: bool,
                        hook: Any, operator_engine: bool) -> None:
    """A 4xx where this request's server-side calls could not be decided (or asked about)."""
    first = tools.tools[0]
    if policy_applies(tools, selection, engine if operator_engine else None):
        if not harmony:
            raise _error(
                f"{first.param} is a server-side tool ({first.type}); on this model vLLM would run "
                "it outside the harmony loop (VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT), where "
                "vllm-allowed-tools cannot decide its calls before they run, so it is refused "
                "while a policy applies.", first.param, CODE_SERVER_TOOLS_UNGUARDED)
        if not hook.installed:
            raise _error(f"{first.param} is a server-side tool ({first.type}), refused while a "
                         f"policy applies: {hook.reason}.", first.param,
                         CODE_SERVER_TOOLS_UNGUARDED)
        if body.get("previous_response_id") is not None:
            raise _error("`previous_response_id` is not supported with server-side tools under "
                         "a policy: vLLM would rebuild the history from its own store, past the "
                         "decisions. Send the whole conversation in `input`.",
                         "previous_response_id", CODE_SERVER_TOOLS_UNGUARDED)
    for tool in tools.tools:
        if tool.require_approval is not None and tool.require_approval.mode != "never" \
                and engine is None:
            raise _error(
                f"{tool.param}.require_approval asks for approvals, which this server cannot "
                "honour: it keeps no grant store (set VLLM_ALLOWED_TOOLS_APPROVAL_POLICY or "
                "VLLM_ALLOWED_TOOLS_GRANT_STORE). Send \"require_approval\": \"never\" to let the "
                "server run the tool unasked.", f"{tool.param}.require_approval")


def _operator_gates(engine: Any, tool: ServerTool, tool_name: str) -> bool:
    from ..approvals.outcomes import ProposedCall
    return engine.needs_approval(ProposedCall(call_id="", identity=tool.identity(tool_name),
                                              arguments="", definition_digest=""))


def _target_of(tools: ServerTools, namespace: str | None, name: str) -> tuple[ServerTool, ServerTarget] | None:
    if namespace is None:
        return None
    tool = tools.by_label(namespace) or (tools.by_type(namespace)
                                         if namespace in TYPE_BUILTIN else None)
    if tool is None:
        return None
    return tool, ServerTarget(tool.builtin, name, recipient_of(tool, name))


def _answers(body: dict[str, Any], tools: ServerTools, selection: ServerSelection | None,
             engine: Any, principal: str | None, session: str | None) -> tuple[dict[str, Any], ResumedCall | None]:
    """Take the approval items of server-side calls out of ``input`` and apply the answers: the
    call to resume (run, or show as refused), or None."""
    items = body.get("input")
    if not isinstance(items, list):
        return body, None
    drop: set[int] = set()
    answers: list[tuple[int, dict[str, Any], str]] = []   # (index, elicitation_response, wire)
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        param = f"input[{index}]"
        if kind == "mcp_approval_request":
            drop.add(index)   # an echo: the server's record is what counts
        elif kind == "mcp_approval_response":
            answers.append((index, _mcp_answer(item, param), "mcp"))
            drop.add(index)
        elif kind in ("elicitation", "elicitation_response") and engine is not None:
            eid = item.get("id") if kind == "elicitation" else item.get("elicitation_id")
            record = engine.store.get_elicitation(eid) if isinstance(eid, str) else None
            if record is None or _target_of(tools, record.namespace, record.name) is None:
                continue   # a function's approval: the approvals' business
            drop.add(index)
            if kind == "elicitation_response":
                answers.append((index, dict(item), "elicitation"))
    if not drop:
        return body, None
    new_body = {**body, "input": [item for i, item in enumerate(items) if i not in drop]}
    if not answers:
        return new_body, None
    return new_body, _apply_answer(answers, tools, selection, engine, principal, session)


def _apply_answer(answers: list[tuple[int, dict[str, Any], str]], tools: ServerTools,
                  selection: ServerSelection | None, engine: Any, principal: str | None,
                  session: str | None) -> ResumedCall:
    """Check and apply the one answer (nothing is consumed when a check fails)."""
    if engine is None:
        index = answers[0][0]
        raise _error(f"input[{index}] answers an approval, but this server keeps no grant store "
                     "to check it against.", f"input[{index}]")
    if len(answers) > 1:
        index = answers[1][0]
        raise _error(f"input[{index}]: one request answers at most one server-side approval (a "
                     "response pauses at its first gated call).", f"input[{index}]")
    index, answer, wire = answers[0]
    param = f"input[{index}]"
    record = engine.store.get_elicitation(answer["elicitation_id"])
    if record is None or record.principal != principal or record.session != session:
        raise ApprovalInputError(
            f"{param} answers {answer['elicitation_id']!r}, which this server never asked of "
            "this caller and session.", param=f"{param}.approval_request_id"
            if wire == "mcp" else f"{param}.elicitation_id", code="unknown_elicitation", status=400)
    found = _target_of(tools, record.namespace, record.name)
    if found is None:
        raise _error(f"{param} answers an approval of {record.namespace}.{record.name}, a "
                     "server-side tool this request does not offer; send the tool again.",
                     param, "tool_not_allowed_this_turn")
    tool, target = found
    if not tool.offers(target.tool_name) or (selection is not None
                                             and not selection.allows(tool, target.tool_name)):
        raise _error(f"{param} accepts a call of {tool.namespace}.{target.tool_name}, which this "
                     "turn's allowed_tools does not allow; nothing was applied.", param,
                     "tool_not_allowed_this_turn")
    if answer["action"] == "accept" and wire == "mcp":
        scopes = record.requested_scopes
        answer["scope"] = "once" if "once" in scopes or not scopes else scopes[0]
    digests = {record.identity: tool.definition_digest(record.name)}
    outcomes = engine.resolve_all([answer], principal=principal, session=session,
                                  catalog=digests, turn=False, history_calls=set())
    outcome = outcomes[0]
    if isinstance(outcome, Rejected):
        raise outcome.error
    if isinstance(outcome, Release) or (isinstance(outcome, Replayed) and outcome.release):
        return ResumedCall(record.id, target, record.arguments, wire)
    if isinstance(outcome, Decline):
        return ResumedCall(record.id, target, record.arguments, wire,
                                     refusal=outcome.tool_output)
    # a replay of a closed answer that released nothing: the model sees the call as refused
    status = outcome.status if isinstance(outcome, Replayed) else "declined"
    cause = {"declined": "declined", "cancelled": "cancelled", "expired": "expired",
             "invalidated": "definition_changed"}.get(status, "unanswered")
    return ResumedCall(record.id, target, record.arguments, wire,
                       refusal=Decline.of(record, cause).tool_output)  # type: ignore[arg-type]


def _mcp_answer(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    """OpenAI's ``mcp_approval_response`` as the engine's ``elicitation_response``."""
    eid = item.get("approval_request_id")
    if not isinstance(eid, str) or not eid:
        raise _error(f"{param}.approval_request_id must be the id of an mcp_approval_request "
                     f"(a string), got {type_name(eid)}.", f"{param}.approval_request_id")
    approve = item.get("approve")
    if not isinstance(approve, bool):
        raise _error(f"{param}.approve must be true or false, got {type_name(approve)}.",
                     f"{param}.approve")
    reason = item.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise _error(f"{param}.reason must be a string, got {type_name(reason)}.", f"{param}.reason")
    rid = item.get("id")
    if rid is not None and not isinstance(rid, str):
        raise _error(f"{param}.id must be a string, got {type_name(rid)}.", f"{param}.id")
    # a retried answer is the same answer: its id is derived from what it says
    if rid is None:
        rid = "mcpresp_" + hashlib.sha256(f"{eid}:{approve}:{reason}".encode()).hexdigest()[:24]
    answer: dict[str, Any] = {"type": "elicitation_response", "id": rid, "elicitation_id": eid,
                              "action": "accept" if approve else "decline"}
    if reason is not None and not approve:
        answer["reason"] = reason
    return answer

