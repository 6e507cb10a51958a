"""The approval decisions: which proposed calls go out, which wait for a person, what answers do.

:meth:`ApprovalEngine.propose_all` decides a model turn's calls (release, or record and elicit);
:meth:`ApprovalEngine.resolve_all` applies a follow-up's answers, each consumed once, atomically.
Free of vLLM and blocking (it calls the store). The rules it enforces, including those the
proposal leaves open, are in ``docs/approvals.md``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from ..request import FunctionSpec, ToolIdentity, TurnAllowlist
from .answers import CheckedAnswer, check_answer, function_call_ids, release_of, same_answer
from .digests import call_arguments_digest
from .approval_errors import CODE_ELICITATION_CONSUMED, ApprovalInputError
from .items import ApprovalItems, ElicitationResponse, ToolCallApproval, parse_input_items
from .outcomes import Decline, Outcome, ProposedCall, Rejected, Release, Replayed
from .policy import ApprovalPolicy
from .store import ElicitationRecord, Grant, GrantStore

__all__ = [
    "ApprovalEngine",
    "Decline",
    "Outcome",
    "ProposedCall",
    "Rejected",
    "Release",
    "Replayed",
    "function_call_ids",
]

#: What a follow-up's answers are checked against: the request's tools now (its turn allowlist, a
#: map of identities to definition digests, or the specs themselves).
CurrentDefinitions = TurnAllowlist | Mapping[ToolIdentity, str] | Iterable[FunctionSpec]

#: an arguments digest no call has: :meth:`ApprovalEngine.matching_grants` asks the store for it
#: to get only the grants not bound to arguments
_NO_ARGUMENTS = "unbound-only"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _catalog_digests(
        catalog: CurrentDefinitions | None) -> Mapping[ToolIdentity, FunctionSpec | str] | None:
    """Each current tool's definition: its spec where known (it matches a record under either
    digest rule, :func:`~.digests.definition_matches`), else the digest the caller gave."""
    if catalog is None:
        return None
    if isinstance(catalog, TurnAllowlist):
        catalog = catalog.catalog
    if isinstance(catalog, Mapping):
        return dict(catalog)
    return {spec.identity: spec for spec in catalog}


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
        args_digest = call_arguments_digest(call.arguments, call.kind)

        def release(via: Literal["policy", "grant"], grant: Grant | None = None) -> Release:
            return Release(call_id=call.call_id, name=call.identity.name,
                           namespace=call.identity.namespace, arguments=call.arguments,
                           arguments_digest=args_digest, definition_digest=call.definition_digest,
                           via=via, scope=grant.scope if grant else None,
                           grant_id=grant.id if grant else None, tool_type=call.kind)

        if not effective.required:
            return release("policy")
        for grant in self.matching_grants(call, principal=principal, session=session, now=now,
                                          arguments_digest=args_digest):
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
            expires_at=float(int(now) + effective.expires_in), tool_type=call.kind)

    # ------------------------------------------------------------------------------ resolve

    def resolve(self, response: ElicitationResponse | Mapping[str, Any], *, principal: str,
                session: str | None = None, now: float | None = None,
                catalog: CurrentDefinitions | None = None, param: str = "item",
                turn: TurnAllowlist | None | Literal[False],
                history_calls: Collection[str] = ()) -> Outcome:
        """Apply one ``elicitation_response`` (see :meth:`resolve_all`; no sibling declines)."""
        _check_principal(principal)
        now = self.clock() if now is None else now
        checked = check_answer(self.store, response, param, principal, session,
                               _catalog_digests(catalog), turn, history_calls)
        return self._apply(checked, principal, session, now)

    def resolve_all(self, items: ApprovalItems | Sequence[Any], *, principal: str,
                    session: str | None = None, now: float | None = None,
                    catalog: CurrentDefinitions | None = None,
                    turn: TurnAllowlist | None | Literal[False],
                    history_calls: Collection[str] | None = None) -> list[Outcome]:
        """Apply every ``elicitation_response`` of a follow-up request, then decline unanswered
        siblings. ``items`` is the request's ``input`` list or its :func:`parse_input_items`.

        ``turn``: this request's :class:`TurnAllowlist` (None: the request has no tools); an
        ``accept`` is then released only if this turn could have made the call (it has tools,
        ``tool_choice`` is not ``none``, and its allowlist or named choice includes the tool).
        False: not checked (required, so that skipping the check is always said at the call). ``history_calls``: the call ids of the request's
        ``function_call`` items (read from ``items`` when it is the raw list); a repeated
        ``accept`` of a call among them releases nothing again.

        Returns the responses' outcomes in input order, then one :class:`Decline`
        (``cause="unanswered"``) per unanswered pending elicitation of the answered batches and
        of the echoed ``elicitation`` items. Raises :class:`ApprovalInputError` before consuming
        anything when any response is invalid.
        """
        now = self.clock() if now is None else now
        parsed = items if isinstance(items, ApprovalItems) else parse_input_items(items)
        if history_calls is None:
            history_calls = set() if isinstance(items, ApprovalItems) else function_call_ids(items)
        checked = self.check_all(parsed, principal=principal, session=session, catalog=catalog,
                                 turn=turn, history_calls=history_calls)
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

    def check_all(self, items: ApprovalItems | Sequence[Any], *, principal: str,
                  session: str | None = None, catalog: CurrentDefinitions | None = None,
                  turn: TurnAllowlist | None | Literal[False],
                  history_calls: Collection[str] | None = None) -> list[CheckedAnswer]:
        """Check every ``elicitation_response`` as :meth:`resolve_all` does, changing nothing:
        the checked answers in input order, or :class:`ApprovalInputError` for the first bad one."""
        _check_principal(principal)
        parsed = items if isinstance(items, ApprovalItems) else parse_input_items(items)
        if history_calls is None:
            history_calls = set() if isinstance(items, ApprovalItems) else function_call_ids(items)
        digests = _catalog_digests(catalog)
        return [check_answer(self.store, response, f"{parsed.param}[{index}]", principal,
                             session, digests, turn, history_calls)
                for index, response in parsed.responses]

    # -- internals

    def _apply(self, checked: CheckedAnswer, principal: str, session: str | None, now: float) -> Outcome:
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
            return release_of(done)
        return Decline.of(done, "declined" if status == "declined" else "cancelled", reason)

    @staticmethod
    def _lost(record: ElicitationRecord | None, checked: CheckedAnswer) -> Outcome:
        """Another response consumed the record between the check and this consumption."""
        response = checked.response
        if record is not None and same_answer(record, response):
            # the same answer won (e.g. a retry racing its original): the same result, no new grant;
            # this response passed the turn and definition checks while the record was pending
            release = release_of(record) if (record.status == "accepted" and not checked.stale
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

    def matching_grants(self, call: ProposedCall, *, principal: str, session: str | None,
                        now: float, arguments_digest: str | None = None,
                        unbound_only: bool = False) -> Iterator[Grant]:
        """The store's live grants for ``call`` (see :meth:`GrantStore.find_grants`), lazily.
        ``unbound_only``: only grants not bound to arguments. ``arguments_digest``: the call's, when
        the caller has it already."""
        arguments = _NO_ARGUMENTS if unbound_only else (
            arguments_digest or call_arguments_digest(call.arguments, call.kind))
        yield from self.store.find_grants(subject=principal, session=session, identity=call.identity,
                                          definition_digest=call.definition_digest,
                                          arguments_digest=arguments, now=now)

    def revoke(self, grant_id: str, *, reason: str | None = None, now: float | None = None) -> bool:
        """Revoke a grant (effective for every later proposal, in every process sharing the store)."""
        return self.store.revoke_grant(grant_id, now=self.clock() if now is None else now,
                                       reason=reason)


def _check_principal(principal: str) -> None:
    if not isinstance(principal, str) or not principal:
        raise ValueError("principal must be the non-empty id of the authenticated caller")
