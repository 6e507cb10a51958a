"""Approvals on the wire: pure functions over Responses request and response bodies (no vLLM).

The request side applies a client's elicitation answers (:func:`prepare_request`); the response
side decides which calls leave as elicitations (:class:`ResponseApprovals`). The rules:
``docs/response-path.md``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..request import ToolIdentity, TurnAllowlist
from .answers import CALL_ITEM_TYPES, CheckedAnswer
from .engine import ApprovalEngine, Decline, ProposedCall, Rejected, Release, Replayed, \
    function_call_ids
from .hints import approval_hint
from .items import ApprovalItems, ToolCallApproval, parse_input_items
from .outcomes import Outcome, call_item

ANONYMOUS = "anonymous"


def principal_from_headers(headers: Sequence[tuple[bytes, bytes]], secret: bytes) -> str:
    """The principal behind a request's credential: ``key:`` and the first 32 hex digits of
    HMAC-SHA256(``secret``, bearer token); :data:`ANONYMOUS` without a credential.

    ``secret`` is the grant store's :attr:`~.store.GrantStore.principal_secret`: every API server
    process and replica sharing the store derives the same principal from the same key. Keyed, not
    a bare hash: whoever sees a principal (a grant listing, a log, an audit export) cannot test
    guesses of a weak API key offline without also reading the store. Grants stored under the
    earlier format (``key:`` and a truncated sha256 of the token) match no caller any more: the
    next gated call of their holder is asked about again.
    """
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError("principal_from_headers needs the grant store's principal_secret (at least "
                         "16 bytes), e.g. engine.store.principal_secret")
    for key, value in headers:
        if key.lower() == b"authorization":
            token = value.decode("latin-1").strip()
            if token.lower().startswith("bearer "):
                token = token[7:].strip()
            if token:
                return "key:" + hmac.new(secret, token.encode("latin-1"), "sha256").hexdigest()[:32]
    return ANONYMOUS


def session_of(body: Mapping[str, Any]) -> str | None:
    conversation = body.get("conversation")
    if isinstance(conversation, Mapping):
        conversation = conversation.get("id")
    if isinstance(conversation, str) and conversation:
        return "conversation:" + conversation
    key = body.get("prompt_cache_key")
    return "cache_key:" + key if isinstance(key, str) and key else None


@dataclass(frozen=True)
class Prepared:
    body: dict[str, Any]                       # what vLLM gets (approval items converted)
    direct_output: list[dict[str, Any]] | None  # released calls: answer without the model
    changed: bool
    #: the request's store writes (its declines, unanswered elicitations closed), to run once vLLM
    #: accepts the request (a 2xx answer starts): raises ApprovalInputError / GrantStoreUnavailable
    commit: Callable[[], None] | None = None


def _hints(body: Mapping[str, Any]) -> dict[str, tuple[Mapping[str, Any] | None, str]]:
    """flat name -> (the tool definition's approval hint, where it sits), for Responses tools."""
    hints: dict[str, tuple[Mapping[str, Any] | None, str]] = {}
    for index, tool in enumerate(body.get("tools") or []):
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "function" and isinstance(tool.get("name"), str):
            hints[tool["name"]] = (approval_hint(tool), f"tools[{index}].approval")
        elif tool.get("type") == "namespace":
            for member_index, member in enumerate(tool.get("tools") or []):
                if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                    flat = ToolIdentity(tool.get("name"), member["name"]).flat_name
                    hints[flat] = (approval_hint(member),
                                   f"tools[{index}].tools[{member_index}].approval")
    return hints


def strip_approval_hints(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's tool models do not know the `approval` key of a definition: drop it on the way in."""
    tools = body.get("tools")
    if not isinstance(tools, list) or not any(
            isinstance(t, Mapping) and ("approval" in t or any(
                isinstance(m, Mapping) and "approval" in m for m in t.get("tools") or []))
            for t in tools):
        return body
    cleaned = []
    for tool in tools:
        if isinstance(tool, Mapping):
            tool = {k: v for k, v in tool.items() if k != "approval"}
            if isinstance(tool.get("tools"), list):
                tool["tools"] = [{k: v for k, v in m.items() if k != "approval"}
                                 if isinstance(m, Mapping) else m for m in tool["tools"]]
        cleaned.append(tool)
    return {**body, "tools": cleaned}


def prepare_request(engine: ApprovalEngine, body: dict[str, Any], *, principal: str,
                    session: str | None, catalog: TurnAllowlist | None) -> Prepared:
    """Apply the request's elicitation responses; raises ApprovalInputError (4xx) on bad items.

    ``catalog`` is this request's tool policy (None: the request has no tools): an ``accept`` is
    released only if this turn could have made the call. An accept is applied now (its call is
    answered without the model); a request that goes to the model changes the store only through
    :attr:`Prepared.commit`, once vLLM accepts it (``docs/response-path.md``)."""
    items = body.get("input")
    if not isinstance(items, list):
        return Prepared(body, None, False)
    parsed = parse_input_items(items)
    if not parsed.elicitations and not parsed.responses:
        return Prepared(body, None, False)
    present_calls = function_call_ids(items)
    resolve = functools.partial(engine.resolve_all, parsed, principal=principal, session=session,
                                catalog=catalog, turn=catalog, history_calls=present_calls)
    checked = engine.check_all(parsed, principal=principal, session=session, catalog=catalog,
                               turn=catalog, history_calls=present_calls)   # nothing changed yet
    model_input = functools.partial(_model_input, engine, items, parsed, principal=principal,
                                    session=session, present_calls=present_calls)
    now = engine.clock()
    if not any(_may_release(answer, now) for answer in checked):
        declined = _declines_of(checked, now)
        return Prepared({**body, "input": model_input(declined)}, None, True,
                        functools.partial(_commit, resolve))
    outcomes = _applied(resolve())
    released = [o if isinstance(o, Release) else o.release for o in outcomes
                if isinstance(o, Release) or (isinstance(o, Replayed) and o.release is not None)]
    if released:
        return Prepared(body, [_with_id(r) for r in released], True)
    declined = {o.elicitation_id: o for o in outcomes if isinstance(o, Decline) and o.elicitation_id}
    return Prepared({**body, "input": model_input(declined)}, None, True)


def _may_release(answer: CheckedAnswer, now: float) -> bool:
    """Whether applying ``answer`` can release a call (then it is applied before the answer)."""
    return answer.release is not None or (answer.response.action == "accept" and not answer.replay
                                          and not answer.stale and now < answer.record.expires_at)


def _declines_of(checked: Sequence[CheckedAnswer], now: float) -> dict[str, Decline]:
    """What applying answers that release nothing will decline, by elicitation id (as
    :meth:`ApprovalEngine.resolve_all` decides it; nothing is written)."""
    declined: dict[str, Decline] = {}
    for answer in checked:
        if answer.replay:
            continue   # closed already: shown by its recorded status
        record, response = answer.record, answer.response
        cause = ("definition_changed" if answer.stale else "expired" if now >= record.expires_at
                 else "declined" if response.action == "decline" else "cancelled")
        declined[record.id] = Decline.of(record, cause,  # type: ignore[arg-type]
                                         response.reason if cause == "declined" else None)
    return declined


def _applied(outcomes: list[Outcome]) -> list[Outcome]:
    for outcome in outcomes:
        if isinstance(outcome, Rejected):   # another answer won a race for it: say so (409)
            raise outcome.error
    return outcomes


def _commit(resolve: Callable[[], list[Outcome]]) -> None:
    """Apply a forwarded request's answers and close its unanswered elicitations (the checks run
    again: an answer another request changed meanwhile is a 409)."""
    _applied(resolve())


def _model_input(engine: ApprovalEngine, items: list[Any], parsed: ApprovalItems,
                 declined: Mapping[str, Decline], *, principal: str, session: str | None,
                 present_calls: set[str]) -> list[Any]:
    """The request's input as the model sees it: approval items removed, each echoed
    elicitation shown as its call and decline (``docs/response-path.md``)."""
    present_outputs = {item.get("call_id") for item in items if isinstance(item, Mapping)
                       and item.get("type") in ("function_call_output", "custom_tool_call_output")}
    elicitation_at = dict(parsed.elicitations)
    response_at = {index for index, _ in parsed.responses}
    new_input: list[Any] = []
    for index, item in enumerate(items):
        if index in response_at:
            continue
        if index not in elicitation_at:
            new_input.append(item)
            continue
        record = engine.store.get_elicitation(elicitation_at[index].id)
        if record is None or record.principal != principal or record.session != session:
            continue   # not ours to show: nothing of it reaches the model
        if record.call_id in present_calls:
            continue   # accepted earlier: the released call and its real output are in the history
        call = call_item(record.tool_type, record.call_id, record.name, record.namespace,
                         record.arguments)
        if record.status == "accepted":   # released: never shown as declined
            if record.call_id in present_outputs:
                new_input.append(call)     # its real output follows in the history
            continue                       # no result known: nothing rather than a false one
        new_input.append(call)
        cause = _cause(record.status)
        decline = declined.get(record.id) or Decline.of(   # a replay: the reason it was given
            record, cause, record.reason if cause == "declined" else None)  # type: ignore[arg-type]
        new_input.append(decline.output_item())   # a custom tool's: custom_tool_call_output
    return new_input


def _cause(status: str) -> str:
    return {"declined": "declined", "cancelled": "cancelled", "expired": "expired",
            "unanswered": "unanswered", "invalidated": "definition_changed"}.get(
        status, "unanswered")


def _with_id(release: Release) -> dict[str, Any]:
    """The released call as an output item (``function_call``, or ``custom_tool_call``). Its ``id``
    is derived from the elicitation id, so the same accept answered again yields an identical item
    (a random one without an elicitation)."""
    item = release.call_item()
    prefix = "ctc_" if item["type"] == "custom_tool_call" else "fc_"
    if release.elicitation_id:
        digest = hashlib.sha256(f"{item['type']}:{release.elicitation_id}".encode()).hexdigest()
        item_id = prefix + digest[:24]
    else:
        item_id = prefix + secrets.token_hex(12)
    return {"id": item_id, **item}


class ResponseApprovals:
    """Decides, per response, which tool calls (``function_call``, ``custom_tool_call``) go out
    and which become elicitations."""

    def __init__(self, engine: ApprovalEngine, body: Mapping[str, Any], catalog: TurnAllowlist, *,
                 principal: str, session: str | None) -> None:
        self.engine = engine
        self.catalog = catalog
        self.principal = principal
        self.session = session
        self.hints = _hints(body)

    def may_call_gated(self) -> bool:
        """Whether this turn can produce a call the policy gates (then it may need the store): a
        gated function or custom tool in the allowlist (or in the catalog when there is none);
        not with ``tool_choice: none``."""
        if self.catalog.choice == "none":
            return False
        for spec in self.catalog.catalog:
            if self.catalog.allowed is not None and spec.identity not in self.catalog.allowed:
                continue
            hint, where = self.hints.get(spec.identity.flat_name, (None, "approval"))
            if self.engine.needs_approval(ProposedCall(call_id="", identity=spec.identity,
                                                       arguments="", definition_digest="",
                                                       hint=hint, hint_param=where)):
                return True
        return False

    def decide(self, calls: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any] | None]:
        """call_id -> the item to send instead (an elicitation), None (withhold), absent (as is).
        ``calls``: ``function_call`` and ``custom_tool_call`` items (a custom call's ``input`` is
        what is approved)."""
        proposed = []
        for call in calls:
            name, namespace = call.get("name"), call.get("namespace")
            flat = ToolIdentity(namespace, name).flat_name if namespace else name
            spec = self.catalog.lookup(flat) if isinstance(flat, str) else None
            custom = call.get("type") == "custom_tool_call"
            if spec is None or (spec.kind == "custom") != custom:
                continue   # not a catalog tool of the item's kind: the output guard's business
            hint, where = self.hints.get(flat, (None, "approval"))
            payload = call.get("input") if custom else call.get("arguments")
            proposed.append(ProposedCall.from_spec(spec, call_id=str(call.get("call_id")),
                                                   arguments=str(payload or ""),
                                                   hint=hint, hint_param=where))
        if not proposed:
            return {}
        results = self.engine.propose_all(proposed, principal=self.principal, session=self.session)
        decisions: dict[str, dict[str, Any] | None] = {}
        for call, result in zip(proposed, results):
            if isinstance(result, ToolCallApproval):
                decisions[call.call_id] = result.to_json()
            elif isinstance(result, Decline):
                decisions[call.call_id] = None
        return decisions

    def apply_to_response(self, response: dict[str, Any],
                          decisions: Mapping[str, dict[str, Any] | None] | None = None) -> dict:
        """Rewrite a Responses object's output (unary, or a streamed terminal snapshot)."""
        output = response.get("output")
        if not isinstance(output, list):
            return response
        calls = [item for item in output if isinstance(item, Mapping)
                 and item.get("type") in CALL_ITEM_TYPES]
        if decisions is None:
            decisions = self.decide(calls)
        new_output = []
        for item in output:
            call_id = item.get("call_id") if isinstance(item, Mapping) else None
            if isinstance(item, Mapping) and item.get("type") in CALL_ITEM_TYPES \
                    and call_id in decisions:
                replacement = decisions[call_id]
                if replacement is not None:
                    new_output.append(replacement)
                continue
            new_output.append(item)
        response["output"] = new_output
        return response


def direct_response(body: Mapping[str, Any], output: list[dict[str, Any]],
                    original_tool_choice: Any) -> dict[str, Any]:
    """A complete Responses object for calls released by an approval (no model call was made):
    every field an Open Responses response object requires, the request's own values echoed."""
    import time
    now = int(time.time())

    def given(key: str, default: Any) -> Any:
        value = body.get(key)
        return default if value is None else value
    return {
        "id": "resp_" + secrets.token_hex(12), "object": "response", "created_at": now,
        "completed_at": now, "status": "completed", "incomplete_details": None,
        "model": body.get("model"), "previous_response_id": body.get("previous_response_id"),
        "instructions": body.get("instructions"), "output": output, "error": None,
        "tools": body.get("tools") or [],
        "tool_choice": original_tool_choice if original_tool_choice is not None else "auto",
        "truncation": given("truncation", "disabled"),
        "parallel_tool_calls": given("parallel_tool_calls", True),
        "text": given("text", {"format": {"type": "text"}}),
        "top_p": given("top_p", 1.0), "presence_penalty": given("presence_penalty", 0.0),
        "frequency_penalty": given("frequency_penalty", 0.0), "top_logprobs": given("top_logprobs", 0),
        "temperature": given("temperature", 1.0), "reasoning": body.get("reasoning"),
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "max_output_tokens": body.get("max_output_tokens"), "max_tool_calls": body.get("max_tool_calls"),
        "store": False, "background": False, "service_tier": given("service_tier", "default"),
        "metadata": given("metadata", {}), "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }


def direct_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The same as a minimal event stream."""
    in_progress = {**response, "status": "in_progress", "output": []}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": in_progress},
                                    {"type": "response.in_progress", "response": in_progress}]
    for index, item in enumerate(response["output"]):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": response})
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]
