"""The approval decisions: which proposed calls go out, which wait for a person, what answers do.

Two steps, both free of vLLM:

:meth:`ApprovalEngine.propose` (a model turn produced calls)
    For each call: the operator's policy (tightened by the tool definition's ``approval`` hint)
    says whether it needs approval. Not gated -> :class:`Release` (``via="policy"``). Gated and a
    live grant matches (same subject; ``always``, or ``session`` of this session; same tool
    identity; same definition digest; its argument digest, if it has one, equal; a scope the
    current policy still offers) -> :class:`Release` (``via="grant"``, with ``grant_id``). Otherwise
    the server records the exact call and returns its :class:`ToolCallApproval` item, to be sent to
    the client instead of the call. :meth:`propose_all` does a turn's parallel calls: each gated call
    gets its own elicitation, all in one batch (one transaction).

:meth:`ApprovalEngine.resolve_all` (a follow-up request carries ``elicitation_response`` items)
    Every response is checked against the server's own record (never the client's echo): it must
    exist for this principal and session, match any binding fields the response repeats, satisfy its
    type's rules (``scope`` with ``accept``, and one of the offered scopes); the tool must still have
    the same definition in this request's catalog; and, when the caller passes this request's
    ``turn`` (its :class:`~vllm_allowed_tools.request.allowlist.TurnAllowlist`, or None for a request without
    tools), an ``accept`` must name a call this turn could have made: the request has tools, its
    ``tool_choice`` is not ``none``, and an allowlist (``allowed_tools``) or a named choice includes
    the tool; otherwise a 400 ``tool_not_allowed_this_turn`` (``param``: the response's
    ``input[i]``). All checks run **before anything is consumed**: a bad response is an
    :class:`ApprovalInputError` (4xx) and the client may correct and resend (the elicitation stays
    answerable). Then each record is consumed atomically (single use):

    * ``accept`` -> :class:`Release` of exactly the recorded call (its call id and arguments from the
      record); ``session`` / ``always`` also mint a :class:`~.store.Grant` in the same transaction;
    * ``decline`` -> :class:`Decline` whose ``tool_output`` the model sees, with the reason;
    * ``cancel`` -> :class:`Decline` without a reason (a reason sent with cancel is dropped);
    * past ``expires_at`` -> :class:`Decline` (``cause="expired"``), the record becomes terminal;
    * the tool's definition changed (or it left the catalog) -> :class:`Decline`
      (``cause="definition_changed"``);
    * the same answer again -> :class:`Replayed`: nothing new happens (nothing is consumed, no grant
      is minted). "The same answer" is the same principal and session, the same ``action`` and, for
      ``accept``, the same ``scope``; the response ``id`` may be the same (an SDK retry resends the
      identical body) or new (a client that rebuilt its answer after a lost reply); a record closed
      without an answer of its own (expired, unanswered, definition changed) only matches its own
      response id. For a repeated ``accept`` whose call is not yet in the request's history
      (``function_call`` items with that call id), :attr:`Replayed.release` is the release the
      first answer made, identical (call id, arguments, grant): a lost reply, a client disconnect,
      the loser of a race or a request cut short by a store failure gets the same call again,
      never a second grant and never a false "declined". With the call in the history (a
      transcript that keeps its history), ``release`` is None: a no-op;
    * another response consumed it first (a race) with the same answer -> as above; with another
      answer -> :class:`Rejected`: nothing;
    * a different answer to an already-consumed elicitation (``decline`` after ``accept``,
      ``accept`` with another scope, or any answer under another response id to a record closed
      without one), seen before consuming -> :class:`ApprovalInputError` 409
      ``elicitation_consumed``.

    Then every still-pending elicitation of the batches just answered, and every echoed
    ``elicitation`` item still pending, is declined (``cause="unanswered"``): parallel calls without
    an answer are declined.

Decisions where the texts are silent:

* Elicitations are bound to ``(principal, session)``: another principal or session answering one
  gets ``unknown_elicitation`` (whether it exists is not revealed).
* A revoked or expired grant never releases anything; the next matching call is asked about again
  (a new elicitation), so revocation is observable as a fresh question, and a decline after it is
  observable by the model. Grants are never widened or upgraded: no code path changes a grant's
  scope, session, tool, definition or argument constraint; a changed definition simply matches no
  old grant.
* A grant applies only while the current policy still offers its scope and, when the policy now
  binds arguments, only if the grant is bound to these arguments.
* With no session (``session=None``) the ``session`` scope is not offered.
* A call whose policy offers no usable scope (e.g. only ``session`` without a session) is declined
  at once (``cause="not_approvable"``).
* The store unavailable (:class:`~.errors.GrantStoreUnavailable`, HTTP 503): fail closed. A
  proposal that needs the store (a gated call: grant lookup, elicitation record) raises it, so no
  gated call is released and none is elicited without a record; calls that need no approval are
  released without touching the store. A follow-up raises it before or while consuming: each
  consumption is one transaction, so a response is either fully applied or not at all, and the
  client may resend it unchanged once the store is back (one applied before the failure is then
  a :class:`Replayed`: its call is not released twice).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..request import FunctionSpec, ToolIdentity, TurnAllowlist
from .digests import arguments_digest as compute_arguments_digest
from .digests import definition_digest as compute_definition_digest
from .errors import (
    CODE_ELICITATION_CONSUMED,
    CODE_ELICITATION_MISMATCH,
    CODE_INVALID_ELICITATION_RESPONSE,
    CODE_UNKNOWN_ELICITATION,
    ApprovalInputError,
)
from .items import (
    ApprovalItems,
    ElicitationResponse,
    ToolCallApproval,
    parse_elicitation_response,
    parse_input_items,
)
from .policy import ApprovalPolicy
from .store import ElicitationRecord, Grant, GrantStore

__all__ = [
    "CODE_TOOL_NOT_ALLOWED_THIS_TURN",
    "ApprovalEngine",
    "Decline",
    "Outcome",
    "ProposedCall",
    "Rejected",
    "Release",
    "Replayed",
]


#: An ``accept`` names a call this request could not have made (no tools, ``tool_choice: none``, an
#: allowlist or named choice without the tool): 400, nothing consumed. A stable ``code`` string.
CODE_TOOL_NOT_ALLOWED_THIS_TURN = "tool_not_allowed_this_turn"


@dataclass(frozen=True)
class ProposedCall:
    """One tool call a model produced, with the definition it was produced against.

    ``arguments`` is the JSON text exactly as the model emitted it (it is what a release hands on).
    ``hint`` is the tool definition's ``approval`` object (:func:`~.policy.approval_hint`), and
    ``hint_param`` where it sits in the request (for 400 messages).
    """

    call_id: str
    identity: ToolIdentity
    arguments: str
    definition_digest: str
    hint: Mapping[str, Any] | None = None
    hint_param: str = "approval"

    @classmethod
    def from_spec(cls, spec: FunctionSpec, *, call_id: str, arguments: str,
                  hint: Mapping[str, Any] | None = None, hint_param: str = "approval") -> ProposedCall:
        return cls(call_id=call_id, identity=spec.identity, arguments=arguments,
                   definition_digest=compute_definition_digest(spec), hint=hint,
                   hint_param=hint_param)

    @property
    def flat_name(self) -> str:
        return self.identity.flat_name


@dataclass(frozen=True)
class Release:
    """The call may go out (be executed, or be handed to the client that executes it).

    ``via``: ``policy`` (not gated), ``grant`` (a live grant, ``grant_id``), ``approval`` (an
    ``accept`` just consumed; ``scope``, ``elicitation_id``, and ``grant_id`` when one was minted).
    The call fields come from the server's record, never from the client.
    """

    call_id: str
    name: str
    namespace: str | None
    arguments: str
    arguments_digest: str
    definition_digest: str
    via: Literal["policy", "grant", "approval"]
    scope: str | None = None
    grant_id: str | None = None
    elicitation_id: str | None = None

    executes: bool = field(default=True, init=False)

    @property
    def flat_name(self) -> str:
        return ToolIdentity(self.namespace, self.name).flat_name

    def function_call_item(self) -> dict[str, Any]:
        """A Responses ``function_call`` item for the released call (no ``id``: the glue adds one)."""
        item: dict[str, Any] = {"type": "function_call", "call_id": self.call_id, "name": self.name,
                                "arguments": self.arguments, "status": "completed"}
        if self.namespace is not None:
            item["namespace"] = self.namespace
        return item


DeclineCause = Literal["declined", "cancelled", "expired", "unanswered", "definition_changed",
                       "not_approvable"]

_DECLINE_TEXT: Mapping[str, str] = {
    "declined": "The user declined this tool call; it was not executed.",
    "cancelled": "The user declined this tool call; it was not executed.",
    "unanswered": "The user did not approve this tool call; it was not executed.",
    "expired": "The approval request for this tool call expired before it was approved; the tool "
               "call was not executed.",
    "definition_changed": "The tool's definition changed after approval was requested; the tool "
                          "call was not executed.",
    "not_approvable": "This tool call needs an approval that cannot be given here; it was not "
                      "executed.",
}


@dataclass(frozen=True)
class Decline:
    """A terminal refusal the model must see as the call's result (``tool_output``)."""

    call_id: str
    name: str
    namespace: str | None
    arguments: str
    cause: DeclineCause
    reason: str | None
    tool_output: str
    elicitation_id: str | None = None

    executes: bool = field(default=False, init=False)

    @classmethod
    def of(cls, record: ElicitationRecord | None, cause: DeclineCause, reason: str | None = None, *,
           call: ProposedCall | None = None) -> Decline:
        text = _DECLINE_TEXT[cause]
        if reason and cause == "declined":
            text += f" Reason given: {reason}"
        if record is not None:
            return cls(call_id=record.call_id, name=record.name, namespace=record.namespace,
                       arguments=record.arguments, cause=cause,
                       reason=reason if cause == "declined" else None, tool_output=text,
                       elicitation_id=record.id)
        assert call is not None
        return cls(call_id=call.call_id, name=call.identity.name, namespace=call.identity.namespace,
                   arguments=call.arguments, cause=cause, reason=None, tool_output=text)

    def function_call_output_item(self) -> dict[str, Any]:
        """The Responses ``function_call_output`` item the model sees for this call."""
        return {"type": "function_call_output", "call_id": self.call_id, "output": self.tool_output}

    def chat_tool_message(self) -> dict[str, Any]:
        """The same, as a Chat Completions ``tool`` message."""
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.tool_output}


@dataclass(frozen=True)
class Replayed:
    """The same answer again (kept in the transcript's history, or retried): nothing new happens.

    ``release``: for a repeated ``accept`` whose call is not in the request's history, the release
    the first answer made, identical (same call id, arguments and grant id; no new grant): the
    wire answers with it again, so a lost reply loses nothing. None otherwise."""

    elicitation_id: str
    response_id: str
    status: str
    release: Release | None = None
    executes: bool = field(default=False, init=False)


@dataclass(frozen=True)
class Rejected:
    """A response that lost the race for its elicitation: nothing happens (``error`` says why)."""

    elicitation_id: str
    response_id: str
    error: ApprovalInputError
    executes: bool = field(default=False, init=False)


Outcome = Release | Decline | Replayed | Rejected
Catalog = TurnAllowlist | Mapping[ToolIdentity, str] | Iterable[FunctionSpec]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _catalog_digests(catalog: Catalog | None) -> Mapping[ToolIdentity, str] | None:
    if catalog is None:
        return None
    if isinstance(catalog, TurnAllowlist):
        catalog = catalog.catalog
    if isinstance(catalog, Mapping):
        return dict(catalog)
    return {spec.identity: compute_definition_digest(spec) for spec in catalog}


class ApprovalEngine:
    """The decision logic over an :class:`ApprovalPolicy` and a :class:`GrantStore`.

    Blocking (it calls the store): run it in a worker thread from async code. ``clock`` and
    ``new_id`` are injectable for tests. ``principal`` must be the authenticated caller (never a
    field the client asserts); ``session`` the conversation it belongs to, or None.
    """

    def __init__(self, policy: ApprovalPolicy, store: GrantStore, *,
                 clock: Callable[[], float] = time.time,
                 new_id: Callable[[str], str] = _new_id) -> None:
        self.policy = policy
        self.store = store
        self.clock = clock
        self.new_id = new_id

    # ------------------------------------------------------------------------------ propose

    def propose(self, call: ProposedCall, *, principal: str, session: str | None = None,
                now: float | None = None,
                batch_id: str | None = None) -> Release | ToolCallApproval | Decline:
        """Decide one call: :class:`Release`, or the elicitation item to send instead (recorded as
        pending), or (rarely) a :class:`Decline` when no approval could ever be given."""
        return self.propose_all([call], principal=principal, session=session, now=now,
                                batch_id=batch_id)[0]

    def propose_all(self, calls: Sequence[ProposedCall], *, principal: str,
                    session: str | None = None, now: float | None = None,
                    batch_id: str | None = None) -> list[Release | ToolCallApproval | Decline]:
        """Decide a turn's calls (parallel calls): one result per call, in order. Each gated call
        gets its own elicitation; all of them share one batch and are recorded in one transaction."""
        _check_principal(principal)
        now = self.clock() if now is None else now
        batch = batch_id or self.new_id("batch")
        out: list[Release | ToolCallApproval | Decline] = []
        records: list[ElicitationRecord] = []
        for call in calls:
            result = self._decide(call, principal, session, now, batch)
            if isinstance(result, ElicitationRecord):
                records.append(result)
                out.append(result.to_item())
            else:
                out.append(result)
        if records:
            self.store.add_elicitations(records)
        return out

    def _decide(self, call: ProposedCall, principal: str, session: str | None, now: float,
                batch: str) -> Release | ElicitationRecord | Decline:
        effective = self.policy.effective(call.identity, call.hint, hint_param=call.hint_param)
        args_digest = compute_arguments_digest(call.arguments)

        def release(via: Literal["policy", "grant"], grant: Grant | None = None) -> Release:
            return Release(call_id=call.call_id, name=call.identity.name,
                           namespace=call.identity.namespace, arguments=call.arguments,
                           arguments_digest=args_digest, definition_digest=call.definition_digest,
                           via=via, scope=grant.scope if grant else None,
                           grant_id=grant.id if grant else None)

        if not effective.required:
            return release("policy")
        for grant in self.store.find_grants(subject=principal, session=session,
                                            identity=call.identity,
                                            definition_digest=call.definition_digest,
                                            arguments_digest=args_digest, now=now):
            if grant.is_live(now) and effective.allows_grant(grant.scope,
                                                             grant.arguments_digest is not None):
                return release("grant", grant)
        scopes = effective.offered_scopes(session is not None)
        if not scopes:
            return Decline.of(None, "not_approvable", call=call)
        message = f"The assistant wants to call {call.flat_name}."
        if effective.message:
            message = f"{effective.message} {message}"
        return ElicitationRecord(
            id=self.new_id("elicit"), principal=principal, session=session, batch_id=batch,
            call_id=call.call_id, namespace=call.identity.namespace, name=call.identity.name,
            arguments=call.arguments, arguments_digest=args_digest,
            definition_digest=call.definition_digest, requested_scopes=scopes,
            bind_arguments=effective.bind_arguments,
            grant_expires_in=dict(effective.grant_expires_in), message=message, created_at=now,
            expires_at=float(int(now) + effective.expires_in))

    # ------------------------------------------------------------------------------ resolve

    def resolve(self, response: ElicitationResponse | Mapping[str, Any], *, principal: str,
                session: str | None = None, now: float | None = None,
                catalog: Catalog | None = None, param: str = "item",
                turn: TurnAllowlist | None | Literal[False] = False,
                history_calls: Collection[str] = ()) -> Outcome:
        """Apply one ``elicitation_response`` (see :meth:`resolve_all`; no sibling declines)."""
        _check_principal(principal)
        now = self.clock() if now is None else now
        checked = self._check(response, param, principal, session, _catalog_digests(catalog),
                              turn, history_calls)
        return self._apply(checked, principal, session, now)

    def resolve_all(self, items: ApprovalItems | Sequence[Any], *, principal: str,
                    session: str | None = None, now: float | None = None,
                    catalog: Catalog | None = None,
                    turn: TurnAllowlist | None | Literal[False] = False,
                    history_calls: Collection[str] | None = None) -> list[Outcome]:
        """Apply every ``elicitation_response`` of a follow-up request, then decline unanswered
        siblings. ``items`` is the request's ``input`` list or its :func:`parse_input_items`.

        ``turn``: this request's tool policy (None: the request has no tools); an ``accept`` is
        then released only if this turn could have made the call (see the module docstring).
        False (the default): not checked. ``history_calls``: the call ids of the request's
        ``function_call`` items (read from ``items`` when it is the raw list); a repeated
        ``accept`` of a call among them releases nothing again.

        Returns the responses' outcomes in input order, then one :class:`Decline`
        (``cause="unanswered"``) per unanswered pending elicitation of the answered batches and
        of the echoed ``elicitation`` items. Raises :class:`ApprovalInputError` before consuming
        anything when any response is invalid.
        """
        _check_principal(principal)
        now = self.clock() if now is None else now
        parsed = items if isinstance(items, ApprovalItems) else parse_input_items(items)
        if history_calls is None:
            history_calls = set() if isinstance(items, ApprovalItems) else function_call_ids(items)
        digests = _catalog_digests(catalog)
        checked = [self._check(response, f"{parsed.param}[{index}]", principal, session, digests,
                               turn, history_calls)
                   for index, response in parsed.responses]
        outcomes: list[Outcome] = [self._apply(c, principal, session, now) for c in checked]

        answered = {c.response.elicitation_id for c in checked}
        batches = {c.record.batch_id for c in checked}
        echoed: list[ElicitationRecord] = []
        for _, item in parsed.elicitations:
            if item.id in answered:
                continue
            record = self.store.get_elicitation(item.id)
            if (record is not None and record.status == "pending"
                    and record.principal == principal and record.session == session):
                echoed.append(record)
        seen: set[str] = set()
        marker = checked[0].response.id if checked else self.new_id("followup")
        for record in [*self.store.pending_in_batches(sorted(batches)), *echoed]:
            if record.id in answered or record.id in seen:
                continue
            seen.add(record.id)
            if record.principal != principal or record.session != session:
                continue
            result = self.store.consume(record.id, principal=principal, session=session,
                                        response_id=f"unanswered:{marker}", status="unanswered",
                                        scope=None, reason=None, now=now, ignore_expiry=True)
            if result.outcome == "consumed":
                outcomes.append(Decline.of(result.record, "unanswered"))
        return outcomes

    # -- internals

    def _check(self, response: ElicitationResponse | Mapping[str, Any], param: str, principal: str,
               session: str | None, catalog: Mapping[ToolIdentity, str] | None,
               turn: TurnAllowlist | None | Literal[False] = False,
               history_calls: Collection[str] = ()) -> _Checked:
        raw = response.to_json() if isinstance(response, ElicitationResponse) else response
        common = parse_elicitation_response(raw, param=param)
        record = self.store.get_elicitation(common.elicitation_id)
        if record is None or record.principal != principal or record.session != session:
            raise ApprovalInputError(
                f"{param}.elicitation_id {common.elicitation_id!r} does not name an elicitation "
                "that is waiting for this caller in this session.",
                param=f"{param}.elicitation_id", code=CODE_UNKNOWN_ELICITATION)
        typed = parse_elicitation_response(raw, param=param, elicitation_type=record.elicitation_type)
        if record.status != "pending" and not _same_answer(record, typed):
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
                return _Checked(typed, record, param, replay=True, in_history=in_history)
            if turn is not False:         # released again: only if this turn could make the call
                _check_turn(record, param, turn)
            return _Checked(typed, record, param, replay=True, release=_release_of(record))
        if typed.action == "accept" and typed.scope not in record.requested_scopes:
            raise ApprovalInputError(
                f"{param}.scope {typed.scope!r} was not offered for this call; choose one of "
                f"{list(record.requested_scopes)} (the elicitation's requested_scopes).",
                param=f"{param}.scope", code=CODE_INVALID_ELICITATION_RESPONSE)
        stale = False
        if catalog is not None:
            current = catalog.get(record.identity)
            stale = current is None or current != record.definition_digest
        if typed.action == "accept" and turn is not False:
            _check_turn(record, param, turn, stale=stale)
        return _Checked(typed, record, param, stale=stale, in_history=in_history)

    def _apply(self, checked: _Checked, principal: str, session: str | None, now: float) -> Outcome:
        response, record = checked.response, checked.record
        if checked.replay:
            return Replayed(record.id, response.id, record.status, checked.release)
        if checked.stale:
            result = self.store.consume(record.id, principal=principal, session=session,
                                        response_id=response.id, status="invalidated", scope=None,
                                        reason=None, now=now, ignore_expiry=True)
            if result.outcome == "consumed":
                return Decline.of(result.record, "definition_changed")
            return self._lost(result.record, checked)
        grant = None
        status = {"accept": "accepted", "decline": "declined", "cancel": "cancelled"}[response.action]
        reason = response.reason if response.action == "decline" else None
        scope = response.scope if response.action == "accept" else None
        if scope in ("session", "always"):
            ttl = record.grant_expires_in.get(scope)
            grant = Grant(
                id=self.new_id("grant"), subject=principal,
                session=session if scope == "session" else None,
                namespace=record.namespace, name=record.name,
                definition_digest=record.definition_digest,
                arguments_digest=record.arguments_digest if record.bind_arguments else None,
                scope=scope, origin_elicitation_id=record.id, origin_response_id=response.id,
                origin_session=session, created_at=now,
                expires_at=None if ttl is None else now + ttl)
        result = self.store.consume(record.id, principal=principal, session=session,
                                    response_id=response.id, status=status, scope=scope,
                                    reason=reason, now=now, grant=grant)
        if result.outcome == "expired":
            return Decline.of(result.record, "expired")
        if result.outcome != "consumed":
            return self._lost(result.record, checked)
        done = result.record
        assert done is not None
        if status == "accepted":
            return _release_of(done)
        return Decline.of(done, "declined" if status == "declined" else "cancelled", reason)

    @staticmethod
    def _lost(record: ElicitationRecord | None, checked: _Checked) -> Outcome:
        """Another response consumed the record between the check and this consumption."""
        response = checked.response
        if record is not None and _same_answer(record, response):
            # the same answer won (e.g. a retry racing its original): the same result, no new grant;
            # this response passed the turn and definition checks while the record was pending
            release = _release_of(record) if (record.status == "accepted" and not checked.stale
                                              and not checked.in_history) else None
            return Replayed(record.id, response.id, record.status, release)
        return Rejected(response.elicitation_id, response.id, ApprovalInputError(
            f"{checked.param}.elicitation_id {response.elicitation_id!r} was answered by another "
            "response at the same time (its answer differs from this one and stands); nothing was "
            "applied for this one.",
            param=f"{checked.param}.elicitation_id", code=CODE_ELICITATION_CONSUMED, status=409))

    # ------------------------------------------------------------------------------ store

    def needs_approval(self, call: ProposedCall) -> bool:
        """Whether the policy gates ``call`` (a malformed hint counts as gated: fail closed)."""
        try:
            return self.policy.effective(call.identity, call.hint,
                                         hint_param=call.hint_param).required
        except ApprovalInputError:
            return True

    def check_store(self) -> None:
        """Raise :class:`~.errors.GrantStoreUnavailable` when the store cannot be read now (a cheap
        read; stores without ``ping`` are assumed up)."""
        ping = getattr(self.store, "ping", None)
        if ping is not None:
            ping()

    # ------------------------------------------------------------------------------ grants

    def revoke(self, grant_id: str, *, reason: str | None = None, now: float | None = None) -> bool:
        """Revoke a grant (effective for every later proposal, in every process sharing the store)."""
        return self.store.revoke_grant(grant_id, now=self.clock() if now is None else now,
                                       reason=reason)


@dataclass(frozen=True)
class _Checked:
    response: ElicitationResponse
    record: ElicitationRecord
    param: str = "item"
    replay: bool = False
    stale: bool = False
    in_history: bool = False
    release: Release | None = None


def function_call_ids(items: Sequence[Any]) -> set[str]:
    """The call ids of the ``function_call`` items of a Responses ``input`` list (its history)."""
    return {item["call_id"] for item in items if isinstance(item, Mapping)
            and item.get("type") == "function_call" and isinstance(item.get("call_id"), str)}


def _same_answer(record: ElicitationRecord, response: ElicitationResponse) -> bool:
    """Is ``response`` the answer that closed ``record`` again (an idempotent resend)?

    Same action and, for ``accept``, the same scope, under any response id (an SDK retry keeps the
    id, a client that rebuilt its answer may not). A record closed without an answer of its own
    (expired, unanswered, definition changed: no ``action``) matches only its own response id."""
    if record.action is None:
        return record.response_id is not None and record.response_id == response.id
    return record.action == response.action and (response.action != "accept"
                                                 or record.scope == response.scope)


def _release_of(record: ElicitationRecord) -> Release:
    """The release of an accepted record: the recorded call, the scope and grant of its answer."""
    return Release(call_id=record.call_id, name=record.name, namespace=record.namespace,
                   arguments=record.arguments, arguments_digest=record.arguments_digest,
                   definition_digest=record.definition_digest, via="approval", scope=record.scope,
                   grant_id=record.grant_id, elicitation_id=record.id)


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
                 and compute_definition_digest(spec) == record.definition_digest
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


def _check_principal(principal: str) -> None:
    if not isinstance(principal, str) or not principal:
        raise ValueError("principal must be the non-empty id of the authenticated caller")


def describe(outcome: Outcome | ToolCallApproval) -> str:
    """A one-line description for logs (no arguments: they may be sensitive)."""
    if isinstance(outcome, ToolCallApproval):
        return f"elicit {outcome.id} for call {outcome.call_id} ({outcome.name})"
    if isinstance(outcome, Release):
        return f"release call {outcome.call_id} via {outcome.via}"
    if isinstance(outcome, Decline):
        return f"decline call {outcome.call_id} ({outcome.cause})"
    return json.dumps({"outcome": type(outcome).__name__, "elicitation_id": outcome.elicitation_id})
