"""Approvals on the wire: pure functions over Responses JSON bodies and stream events (no vLLM).

The ASGI middleware calls these; everything here is testable without a server.

Request side (:func:`prepare_request`): the client's ``input`` may carry ``elicitation`` items (echoes
of what we sent) and ``elicitation_response`` items (its decisions). Responses are applied against
the server's own records (:meth:`ApprovalEngine.resolve_all`), never the client's echo. Then:

* an ``accept`` is released only if this request could have made the call: it has tools, the tool
  is among them with the approved definition, its ``tool_choice`` is not ``none`` and an allowlist
  or named choice includes the tool. Otherwise a 400 ``tool_not_allowed_this_turn`` (``param``:
  the response's ``input[i]``) before anything is consumed: the client resends the same answer with
  a ``tool_choice`` that allows the tool;
* if any response **accepted** a call just now, the request is answered directly with exactly the
  recorded call(s) as ``function_call`` items: no model call is needed (function tools run on the
  client). Declines in the same request reach the model on the next turn, from the history;
* answers are idempotent: the same answer again (same action and scope, the same or a new response
  id) to an accepted elicitation whose call is not in the history (a lost reply, a retry, the loser
  of a race, a request cut short by a store failure) is answered with the same release again:
  the same ``call_id``, arguments and item ``id`` (derived from the elicitation id), and no new
  grant. With the call in the history it is a no-op. A different answer to a closed elicitation is
  a 409 ``elicitation_consumed`` (also when it lost a race to the other answer);
* otherwise both item types are removed before vLLM sees the input (it would reject them), and each
  echoed elicitation becomes what the model should see: the proposed ``function_call`` and its
  decline as the ``function_call_output``. An **accepted** elicitation is never shown as declined:
  with its call in the history it is dropped (the call and its real output are there), with only
  its ``function_call_output`` in the history the call is shown before it, and with neither it is
  dropped (the server released the call but does not know its result; saying "declined" would be
  false). The model then continues with the declines in view.

Response side (:class:`ResponseApprovals`): every ``function_call`` leaving the server goes through
:meth:`ApprovalEngine.propose_all`: released calls pass, a gated call without a live grant is
replaced by its ``elicitation`` item (unary and streamed, at the same ``output_index``), and a call
that needs an approval no scope can give is withheld.

The grant store unavailable (:class:`~.errors.GrantStoreUnavailable`, 503): fail closed. The glue
answers a request that may call a gated tool (or carries approval items) with the 503 before any
generation when :meth:`ResponseApprovals.may_call_gated` and the store's ping say so; a store that
fails later, when a gated call is decided, turns a unary answer into the 503 and ends a stream with
one ``response.failed`` (:meth:`ApprovalStream.fail`, error code ``grant_store_unavailable``): the
gated call is never released. Requests that cannot call a gated tool do not touch the store.

Who is asking: the principal is derived from the request's credential (``Authorization: Bearer``,
an HMAC under the grant store's secret: :func:`principal_from_headers`), never from a field the
client can simply assert; without a credential, one documented anonymous principal. The session is
the Responses ``conversation`` id, else ``prompt_cache_key`` (Codex sends its session id there),
else none (then the ``session`` scope is not offered).
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..request import ToolIdentity, TurnAllowlist
from .engine import ApprovalEngine, Decline, ProposedCall, Rejected, Release, Replayed, \
    function_call_ids
from .errors import ApprovalInputError
from .items import ToolCallApproval, parse_input_items
from .hints import approval_hint

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
    released only if this turn could have made the call (see the module docstring)."""
    items = body.get("input")
    if not isinstance(items, list):
        return Prepared(body, None, False)
    parsed = parse_input_items(items)
    if not parsed.elicitations and not parsed.responses:
        return Prepared(body, None, False)
    present_calls = function_call_ids(items)
    outcomes = engine.resolve_all(parsed, principal=principal, session=session, catalog=catalog,
                                  turn=catalog, history_calls=present_calls)
    for outcome in outcomes:
        if isinstance(outcome, Rejected):   # another answer won a race for it: say so (409)
            raise outcome.error
    released = [o if isinstance(o, Release) else o.release for o in outcomes
                if isinstance(o, Release) or (isinstance(o, Replayed) and o.release is not None)]
    if released:
        return Prepared(body, [_with_id(r) for r in released], True)
    declined = {o.elicitation_id: o for o in outcomes if isinstance(o, Decline) and o.elicitation_id}
    present_outputs = {item.get("call_id") for item in items
                       if isinstance(item, Mapping) and item.get("type") == "function_call_output"}
    elicitation_at = dict(parsed.elicitations)
    response_at = {index for index, _ in parsed.responses}
    new_input: list[Any] = []
    for index, item in enumerate(items):
        if index in response_at:
            continue
        if index not in elicitation_at:
            new_input.append(item)
            continue
        echoed = elicitation_at[index]
        record = engine.store.get_elicitation(echoed.id)
        if record is None or record.principal != principal or record.session != session:
            continue   # not ours to show: nothing of it reaches the model
        if record.call_id in present_calls:
            continue   # accepted earlier: the released call and its real output are in the history
        call = {"type": "function_call", "call_id": record.call_id, "name": record.name,
                "arguments": record.arguments, "status": "completed"}
        if record.namespace is not None:
            call["namespace"] = record.namespace
        if record.status == "accepted":   # released: never shown as declined
            if record.call_id in present_outputs:
                new_input.append(call)     # its real output follows in the history
            continue                       # no result known: nothing rather than a false one
        new_input.append(call)
        decline = declined.get(record.id) or Decline.of(record, _cause(record.status))
        new_input.append(decline.function_call_output_item())
    return Prepared({**body, "input": new_input}, None, True)


def _cause(status: str) -> str:
    return {"declined": "declined", "cancelled": "cancelled", "expired": "expired",
            "unanswered": "unanswered", "invalidated": "definition_changed"}.get(
        status, "unanswered")


def _with_id(release: Release) -> dict[str, Any]:
    """The released call as an output item. Its ``id`` is derived from the elicitation id, so the
    same accept answered again yields an identical item (a random one without an elicitation)."""
    if release.elicitation_id:
        digest = hashlib.sha256(f"function_call:{release.elicitation_id}".encode()).hexdigest()
        item_id = "fc_" + digest[:24]
    else:
        item_id = "fc_" + secrets.token_hex(12)
    return {"id": item_id, **release.function_call_item()}


class ResponseApprovals:
    """Decides, per response, which function calls go out and which become elicitations."""

    def __init__(self, engine: ApprovalEngine, body: Mapping[str, Any], catalog: TurnAllowlist, *,
                 principal: str, session: str | None) -> None:
        self.engine = engine
        self.catalog = catalog
        self.principal = principal
        self.session = session
        self.hints = _hints(body)

    def may_call_gated(self) -> bool:
        """Whether this turn can produce a call the policy gates (then it may need the store): a
        gated function in the allowlist (or in the catalog when there is none); not with
        ``tool_choice: none``."""
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
        """call_id -> the item to send instead (an elicitation), None (withhold), absent (as is)."""
        proposed = []
        for call in calls:
            name, namespace = call.get("name"), call.get("namespace")
            flat = ToolIdentity(namespace, name).flat_name if namespace else name
            spec = self.catalog.lookup(flat) if isinstance(flat, str) else None
            if spec is None:
                continue   # not a catalog function: the output guard's business
            hint, where = self.hints.get(flat, (None, "approval"))
            proposed.append(ProposedCall.from_spec(spec, call_id=str(call.get("call_id")),
                                                   arguments=str(call.get("arguments") or ""),
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
                 and item.get("type") == "function_call"]
        if decisions is None:
            decisions = self.decide(calls)
        new_output = []
        for item in output:
            call_id = item.get("call_id") if isinstance(item, Mapping) else None
            if isinstance(item, Mapping) and item.get("type") == "function_call" \
                    and call_id in decisions:
                replacement = decisions[call_id]
                if replacement is not None:
                    new_output.append(replacement)
                continue
            new_output.append(item)
        response["output"] = new_output
        return response


class ApprovalStream:
    """Streaming: hold each function_call item's events until its ``output_item.done``, then send
    it as is, as an ``elicitation`` (added + done at the same output_index), or not at all.
    Sequence numbers are renumbered so they stay strictly increasing; output indexes of later items
    shift down when a call is withheld.

    Decisions may need the grant store. An async caller asks :meth:`pending_calls` first, decides
    those calls off the event loop (``ResponseApprovals.decide`` in a thread) and hands the result
    to :meth:`feed`; on :class:`~.errors.GrantStoreUnavailable` it sends :meth:`fail` instead and
    ends the stream. Without decisions, :meth:`feed` decides inline."""

    def __init__(self, approvals: ResponseApprovals) -> None:
        self.approvals = approvals
        self._held: dict[int, list[dict[str, Any]]] = {}
        self._decisions: dict[str, dict[str, Any] | None] = {}
        self._passed: set[str] = set()          # call ids sent as they were (no approval needed)
        self._next_seq: int | None = None
        self._withheld_before: list[int] = []   # output indexes withheld so far
        self._snapshot: dict[str, Any] | None = None
        self._sent: dict[int, dict[str, Any]] = {}   # output index -> item as last sent
        self._done: set[int] = set()

    def pending_calls(self, event: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The function calls that feeding ``event`` will decide: the held call its
        ``output_item.done`` completes, or calls a terminal snapshot carries that no event
        announced (never passed unchecked)."""
        kind = event.get("type", "")
        index = event.get("output_index")
        if kind == "response.output_item.done" and index in self._held:
            item = event.get("item")
            return [dict(item)] if isinstance(item, Mapping) else []
        response = event.get("response")
        if isinstance(response, Mapping) and kind in ("response.completed", "response.incomplete",
                                                      "response.failed"):
            return [dict(item) for item in response.get("output") or ()
                    if isinstance(item, Mapping) and item.get("type") == "function_call"
                    and item.get("call_id") not in self._decisions
                    and item.get("call_id") not in self._passed]
        return []

    def feed(self, event: dict[str, Any],
             decisions: Mapping[str, dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
        kind = event.get("type", "")
        index = event.get("output_index")
        item = event.get("item") if isinstance(event.get("item"), Mapping) else None
        if kind in ("response.created", "response.in_progress", "response.queued") \
                and isinstance(event.get("response"), dict):
            self._snapshot = event["response"]
        if kind == "response.output_item.added" and item and item.get("type") == "function_call":
            self._held[index] = [event]
            return []
        if index in self._held:
            self._held[index].append(event)
            if kind != "response.output_item.done":
                return []
            events = self._held.pop(index)
            decision = dict(decisions) if decisions is not None else self.approvals.decide([item])
            self._decisions.update(decision)
            call_id = item.get("call_id")
            if call_id not in decision:
                self._passed.add(call_id)
                return [self._track(self._number(e)) for e in events]
            replacement = decision[call_id]
            if replacement is None:
                self._withheld_before.append(index)
                return []
            out_index = self._shift(index)
            return [self._track(self._number({"type": "response.output_item.added",
                                              "output_index": out_index, "item": replacement})),
                    self._track(self._number({"type": "response.output_item.done",
                                              "output_index": out_index, "item": replacement}))]
        if isinstance(event.get("response"), dict) and kind in (
                "response.completed", "response.incomplete", "response.failed"):
            event = copy.copy(event)
            late = self.pending_calls(event)
            if late:   # calls only the snapshot carries: decided now, never passed unchecked
                self._decisions.update(dict(decisions) if decisions is not None
                                       else self.approvals.decide(late))
                self._passed.update(str(call.get("call_id")) for call in late
                                    if call.get("call_id") not in self._decisions)
            event["response"] = self.approvals.apply_to_response(dict(event["response"]),
                                                                 self._decisions)
        if isinstance(index, int) and self._withheld_before:
            event = {**event, "output_index": self._shift(index)}
        return [self._track(self._number(event))]

    def fail(self, error: Exception) -> list[dict[str, Any]]:
        """The events that end the stream when a decision could not be made (the store is down):
        items the client saw open are closed as ``incomplete``, then one ``response.failed`` with
        the error (``code``, ``message``). Held calls are never shown."""
        out: list[dict[str, Any]] = []
        output: list[dict[str, Any]] = []
        for index in sorted(self._sent):
            item = dict(self._sent[index])
            if index not in self._done:
                item["status"] = "incomplete"
                out.append(self._number({"type": "response.output_item.done",
                                         "output_index": index, "item": item}))
            output.append(item)
        response = copy.deepcopy(self._snapshot) if self._snapshot is not None else {
            "object": "response"}
        response.update(status="failed", output=output, incomplete_details=None,
                        error={"code": getattr(error, "code", "server_error"),
                               "message": getattr(error, "message", str(error))})
        out.append(self._number({"type": "response.failed", "response": response}))
        return out

    def _track(self, event: dict[str, Any]) -> dict[str, Any]:
        kind, index, item = event.get("type"), event.get("output_index"), event.get("item")
        if isinstance(index, int) and isinstance(item, Mapping):
            if kind == "response.output_item.added":
                self._sent[index] = dict(item)
            elif kind == "response.output_item.done":
                self._sent[index] = dict(item)
                self._done.add(index)
        return event

    def _shift(self, index: int) -> int:
        return index - sum(1 for withheld in self._withheld_before if withheld < index)

    def _number(self, event: dict[str, Any]) -> dict[str, Any]:
        if "sequence_number" not in event and self._next_seq is None:
            return event
        if self._next_seq is None:
            self._next_seq = int(event["sequence_number"])
        event = {**event, "sequence_number": self._next_seq}
        self._next_seq += 1
        return event


class WithoutGated:
    """Chat Completions cannot carry elicitations: there, a tool that needs approval is simply not
    callable (the output guard refuses it), so no gated call is ever released unasked."""

    def __init__(self, base: Any, engine: ApprovalEngine, body: Mapping[str, Any]) -> None:
        self.base = base
        self.gated: set[str] = set()
        for tool in body.get("tools") or []:
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if isinstance(name, str):
                try:
                    required = engine.policy.effective(ToolIdentity(None, name),
                                                       approval_hint(tool)).required
                except ApprovalInputError:   # check_hints refuses these before generation;
                    required = True          # should one get here anyway: fail closed
                if required:
                    self.gated.add(name)

    def is_allowed(self, flat_name: str | None) -> bool:
        return flat_name not in self.gated and self.base.is_allowed(flat_name)


def direct_response(body: Mapping[str, Any], output: list[dict[str, Any]],
                    original_tool_choice: Any) -> dict[str, Any]:
    """A complete Responses object for calls released by an approval (no model call was made)."""
    import time
    return {
        "id": "resp_" + secrets.token_hex(12), "object": "response", "created_at": int(time.time()),
        "status": "completed", "model": body.get("model"), "output": output,
        "tool_choice": original_tool_choice if original_tool_choice is not None else "auto",
        "tools": body.get("tools") or [], "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
        "metadata": body.get("metadata"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
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
