"""A server upgraded to RFC 8785 digests honours what an earlier server stored (no vLLM): grants
and pending elicitations written with the earlier digests into a real SQLite store still release
the very calls they released before, and nothing else; new grants carry today's digests.

The earlier digests below are what the earlier server computed (recorded from it), so these tests
also pin :mod:`vllm_allowed_tools.approvals.legacy_digests` to the rule it must reproduce."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_allowed_tools.approvals import (
    ApprovalEngine,
    ApprovalPolicy,
    Decline,
    ProposedCall,
    Release,
    SQLiteGrantStore,
    ToolCallApproval,
    arguments_digest,
    definition_digest,
)
from vllm_allowed_tools.approvals.chat import decide_chat_turn
from vllm_allowed_tools.approvals.legacy_digests import legacy_arguments_digest, legacy_definition_digest
from vllm_allowed_tools.approvals.store import ElicitationRecord, Grant
from vllm_allowed_tools.request import FunctionSpec, ToolIdentity, resolve_allowlist

T0 = 1_800_000_000.0
NAME, DESCRIPTION = "add_pr_comment", "Comment on a pull request."
#: a schema with a float: the two rules give this definition different digests
PARAMS = {"type": "object", "properties": {"pr": {"type": "integer", "minimum": 1.0},
                                           "body": {"type": "string"}}}
PLAIN_PARAMS = {"type": "object", "properties": {"pr": {"type": "integer"}, "body": {"type": "string"}}}
ARGUMENTS = '{"pr": 123, "body": "Looks good!", "weight": 1.0}'

# recorded from the server before RFC 8785 digests
EARLIER_DEFINITION = "sha256:3818173781a84e5e0ceabd946bc4c76de6a4c4bd5376eba5a8e87aeeb614eb3a"
EARLIER_PLAIN_DEFINITION = "sha256:9f9dfc07e37d1752f5a6edf324fcdf8d971731e8d9506164149d0edf1a424412"
EARLIER_ARGUMENTS = "sha256:d010d54954420a270f1ebafc53d0ce5b4e5932b1738af2897d14d3195fcbcc76"
EARLIER_PLAIN_ARGUMENTS = "sha256:dc22d4962d9849e0b34dd522f4f9d3e6116cb66fb246f05c07f2304bfa8db82f"
EARLIER_RAW_ARGUMENTS = "sha256:7b398dcf5c17e3bb9b436fe36b45ff3a4591d4ee58fc9fe3e668d71860866636"


def spec(params: dict = PARAMS, description: str = DESCRIPTION) -> FunctionSpec:
    return FunctionSpec.build(ToolIdentity(None, NAME), description, params)


def call(arguments: str = ARGUMENTS, s: FunctionSpec | None = None, call_id: str = "c2") -> ProposedCall:
    return ProposedCall.from_spec(s or spec(), call_id=call_id, arguments=arguments)


def earlier_record(eid: str = "elicit_old", *, session: str | None = "s1", bind: bool = True,
                   definition: str = EARLIER_DEFINITION) -> ElicitationRecord:
    return ElicitationRecord(
        id=eid, principal="alice", session=session, batch_id="batch_old", call_id="c1",
        namespace=None, name=NAME, arguments=ARGUMENTS, arguments_digest=EARLIER_ARGUMENTS,
        definition_digest=definition, requested_scopes=("once", "session", "always"),
        bind_arguments=bind, grant_expires_in={}, message="The assistant wants to call it.",
        created_at=T0 - 100, expires_at=T0 + 3600)


def store_as_the_earlier_server(db: Path, scope: str, *, bind: bool = True,
                                definition: str = EARLIER_DEFINITION) -> str:
    """Rows as a server before RFC 8785 wrote them: the accepted elicitation and its grant."""
    store = SQLiteGrantStore(db)
    record = earlier_record(bind=bind, definition=definition)
    store.add_elicitations([record])
    grant = Grant(id="grant_old", subject="alice", session="s1" if scope == "session" else None,
                  namespace=None, name=NAME, definition_digest=definition,
                  arguments_digest=EARLIER_ARGUMENTS if bind else None, scope=scope,  # type: ignore[arg-type]
                  origin_elicitation_id=record.id, origin_response_id="resp_old",
                  origin_session="s1", created_at=T0 - 50, expires_at=None)
    done = store.consume(record.id, principal="alice", session="s1", response_id="resp_old",
                         status="accepted", scope=scope, reason=None, now=T0 - 50, grant=grant)
    assert done.outcome == "consumed"
    store.close()
    return grant.id


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "grants.db"


def upgraded(db: Path, policy: ApprovalPolicy | None = None) -> ApprovalEngine:
    return ApprovalEngine(policy or ApprovalPolicy.require_all(), SQLiteGrantStore(db),
                          clock=lambda: T0)


def test_the_earlier_digests_are_reproduced_exactly() -> None:
    assert legacy_definition_digest(spec()) == EARLIER_DEFINITION
    assert legacy_definition_digest(spec(PLAIN_PARAMS)) == EARLIER_PLAIN_DEFINITION
    assert legacy_arguments_digest(ARGUMENTS) == EARLIER_ARGUMENTS
    assert legacy_arguments_digest('{"pr": 123, "body": "Looks good!"}') == EARLIER_PLAIN_ARGUMENTS
    assert legacy_arguments_digest("not json") == EARLIER_RAW_ARGUMENTS
    # today's differ (so the lookup must ask for both), except a definition without a float
    assert definition_digest(spec()) != EARLIER_DEFINITION
    assert arguments_digest(ARGUMENTS) != EARLIER_ARGUMENTS
    assert definition_digest(spec(PLAIN_PARAMS)) == EARLIER_PLAIN_DEFINITION


@pytest.mark.parametrize("scope", ["session", "always"])
def test_a_bound_grant_stored_by_an_earlier_server_releases_the_same_call(db: Path, scope: str) -> None:
    grant_id = store_as_the_earlier_server(db, scope)
    engine = upgraded(db)
    reformatted = '{"weight": 1.0,\n "body": "Looks good!", "pr": 123}'  # same value, other text
    out = engine.propose(call(reformatted), principal="alice", session="s1")
    assert isinstance(out, Release) and out.via == "grant" and out.grant_id == grant_id
    assert out.arguments == reformatted and out.arguments_digest == arguments_digest(ARGUMENTS)


@pytest.mark.parametrize("arguments", [
    '{"pr": 124, "body": "Looks good!", "weight": 1.0}',
    '{"pr": 123, "body": "Looks good!", "weight": 1.5}',
    '{"pr": 123, "body": "Looks good!", "weight": 1}',   # one number today; two under the grant's rule
    '{"pr": 123, "body": "Looks good!"}',
])
def test_an_earlier_bound_grant_releases_nothing_else(db: Path, arguments: str) -> None:
    store_as_the_earlier_server(db, "always")
    out = upgraded(db).propose(call(arguments), principal="alice", session="s1")
    assert isinstance(out, ToolCallApproval)
    # and what is asked for now carries today's digests
    assert out.arguments_digest == arguments_digest(arguments)
    assert out.tool_definition_digest == definition_digest(spec())


def test_an_earlier_grant_keeps_its_subject_session_and_definition(db: Path) -> None:
    store_as_the_earlier_server(db, "session")
    engine = upgraded(db)
    assert isinstance(engine.propose(call(), principal="bob", session="s1"), ToolCallApproval)
    assert isinstance(engine.propose(call(), principal="alice", session="s2"), ToolCallApproval)
    changed = spec(description="Comment on a pull request, loudly.")
    assert isinstance(engine.propose(call(s=changed), principal="alice", session="s1"), ToolCallApproval)


def test_an_earlier_unbound_grant_releases_any_arguments_on_both_apis(db: Path) -> None:
    grant_id = store_as_the_earlier_server(db, "always", bind=False)
    engine = upgraded(db)
    out = engine.propose(call('{"pr": 7, "body": "x"}'), principal="alice", session="s9")
    assert isinstance(out, Release) and out.grant_id == grant_id
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": NAME, "description": DESCRIPTION,
                                                        "parameters": PARAMS}}]}
    turn = resolve_allowlist(body, "chat")
    decided = decide_chat_turn(engine, body, turn, principal="alice", session="s9", now=T0)
    assert decided.granted == {NAME: grant_id} and not decided.blocked


def test_an_earlier_grant_of_a_definition_both_rules_agree_on_is_found_too(db: Path) -> None:
    # a grant pairs the earlier arguments digest with a definition digest equal under both rules
    grant_id = store_as_the_earlier_server(db, "always", definition=EARLIER_PLAIN_DEFINITION)
    plain = spec(PLAIN_PARAMS)
    engine = upgraded(db)
    bare = ProposedCall(call_id="c2", identity=plain.identity, arguments=ARGUMENTS,
                        definition_digest=definition_digest(plain))  # no spec: today's digest only
    for proposed in (call(s=plain), bare):
        out = engine.propose(proposed, principal="alice", session="s1")
        assert isinstance(out, Release) and out.grant_id == grant_id


def test_an_elicitation_pending_across_the_upgrade_can_still_be_accepted(db: Path) -> None:
    store = SQLiteGrantStore(db)
    store.add_elicitations([earlier_record()])
    store.close()
    engine = upgraded(db)
    body = {"model": "m", "input": "hi", "tools": [{"type": "function", "name": NAME,
                                                     "description": DESCRIPTION, "parameters": PARAMS}]}
    turn = resolve_allowlist(body, "responses")
    [out] = engine.resolve_all([{"id": "resp_new", "type": "elicitation_response",
                                 "elicitation_id": "elicit_old", "action": "accept",
                                 "scope": "always", "arguments_digest": EARLIER_ARGUMENTS,
                                 "tool_definition_digest": EARLIER_DEFINITION}],
                               principal="alice", session="s1", catalog=turn, turn=turn)
    assert isinstance(out, Release) and out.via == "approval" and out.arguments == ARGUMENTS
    again = engine.propose(call(), principal="alice", session="s1")
    assert isinstance(again, Release) and again.via == "grant" and again.grant_id == out.grant_id


def test_a_pending_elicitation_of_a_changed_definition_is_still_declined(db: Path) -> None:
    store = SQLiteGrantStore(db)
    store.add_elicitations([earlier_record()])
    store.close()
    engine = upgraded(db)
    [out] = engine.resolve_all([{"id": "resp_new", "type": "elicitation_response",
                                 "elicitation_id": "elicit_old", "action": "accept",
                                 "scope": "once"}],
                               principal="alice", session="s1",
                               catalog=[spec(description="Another description.")], turn=False)
    assert isinstance(out, Decline) and out.cause == "definition_changed"
