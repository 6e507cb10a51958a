"""Tool-call approvals: policy, wire items, digests, the engine, the grant store, the CLI.

Every acceptance case of the proposal's discussion has a test here (search for "ACCEPTANCE"), plus
the concurrency (two processes consuming one elicitation: exactly one release) and durability
(a writer SIGKILLed inside a transaction) checks. No vLLM, no servers; a few seconds in all.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_allowed_tools.approvals import (
    TOOL_CALL_APPROVAL_RESPONSE_SCHEMA,
    TOOL_CALL_APPROVAL_SCHEMA,
    ApprovalEngine,
    ApprovalInputError,
    ApprovalPolicy,
    Decline,
    ElicitationType,
    PolicyFileError,
    ProposedCall,
    Rejected,
    Release,
    Replayed,
    SQLiteGrantStore,
    ToolCallApproval,
    approval_hint,
    arguments_digest,
    definition_digest,
    elicitation_response_schema,
    elicitation_schema,
    engine_from_settings,
    load_policy,
    open_engine,
    parse_elicitation,
    parse_elicitation_response,
    parse_input_items,
    register_elicitation_type,
)
from vllm_allowed_tools.approvals import cli as approvals_cli
from vllm_allowed_tools.approvals.elicitation_types import unregister_elicitation_type
from vllm_allowed_tools.request import FunctionSpec, ToolIdentity
from vllm_allowed_tools.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_800_000_000.0

# --------------------------------------------------------------------------------------------------
# helpers


def spec(name: str = "add_pr_comment", namespace: str | None = None,
         description: str | None = "Comment on a pull request.",
         parameters: dict[str, Any] | None = None) -> FunctionSpec:
    params = parameters or {"type": "object", "properties": {"pr": {"type": "integer"},
                                                             "body": {"type": "string"}}}
    return FunctionSpec.build(ToolIdentity(namespace, name), description, params)


def call(call_id: str = "call_1", arguments: str = '{"pr": 123, "body": "Looks good!"}',
         s: FunctionSpec | None = None, hint: dict[str, Any] | None = None) -> ProposedCall:
    return ProposedCall.from_spec(s or spec(), call_id=call_id, arguments=arguments, hint=hint)


def respond(elicitation: ToolCallApproval | str, action: str = "accept", scope: str | None = "once",
            rid: str = "resp_1", reason: str | None = None, **extra: Any) -> dict[str, Any]:
    eid = elicitation if isinstance(elicitation, str) else elicitation.id
    item: dict[str, Any] = {"id": rid, "type": "elicitation_response", "elicitation_id": eid,
                            "action": action}
    if action == "accept" and scope is not None:
        item["scope"] = scope
    if reason is not None:
        item["reason"] = reason
    item.update(extra)
    return item


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "grants.db"


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_engine(db: Path, clock: Clock, policy: ApprovalPolicy | None = None) -> ApprovalEngine:
    return ApprovalEngine(policy or ApprovalPolicy.require_all(), SQLiteGrantStore(db), clock=clock)


@pytest.fixture
def engine(db: Path, clock: Clock) -> ApprovalEngine:
    eng = make_engine(db, clock)
    yield eng
    eng.store.close()


def elicit(engine: ApprovalEngine, c: ProposedCall | None = None, *, principal: str = "alice",
           session: str | None = "s1") -> ToolCallApproval:
    out = engine.propose(c or call(), principal=principal, session=session)
    assert isinstance(out, ToolCallApproval), out
    return out


def resolve(engine: ApprovalEngine, *items: dict[str, Any], principal: str = "alice",
            session: str | None = "s1", **kw: Any) -> list[Any]:
    return engine.resolve_all(list(items), principal=principal, session=session, **kw, turn=False)


# --------------------------------------------------------------------------------------------------
# digests


def test_arguments_digest_is_canonical_and_changes_with_any_value() -> None:
    a = arguments_digest('{"pr": 123, "body": "Looks good!"}')
    assert a == arguments_digest('{ "body" : "Looks good!",\n "pr":123 }')
    assert a == arguments_digest({"body": "Looks good!", "pr": 123})
    assert a.startswith("sha256:") and len(a) == len("sha256:") + 64
    # ACCEPTANCE: changed arguments produce a different digest
    assert a != arguments_digest('{"pr": 124, "body": "Looks good!"}')
    assert a != arguments_digest('{"pr": 123, "body": "Looks good"}')
    assert a != arguments_digest('{"pr": "123", "body": "Looks good!"}')
    # RFC 8785 reads numbers as doubles: 1 and 1.0 are one number (tests/test_digests.py)
    assert arguments_digest('{"x": 1}') == arguments_digest('{"x": 1.0}')
    assert arguments_digest('{"x": 1}') != arguments_digest('{"x": 1.5}')
    assert a != arguments_digest('{"pr": 123, "body": "Looks good!", "extra": null}')


def test_ambiguous_arguments_are_digested_byte_for_byte() -> None:
    dup = '{"pr": 1, "pr": 2}'  # parsers disagree on which value wins: never canonicalized
    assert arguments_digest(dup) != arguments_digest('{"pr": 2}')
    assert arguments_digest(dup) != arguments_digest('{"pr": 1}')
    assert arguments_digest(dup) != arguments_digest('{"pr":1,"pr":2}')
    assert arguments_digest('{"x": NaN}') != arguments_digest('{"x":NaN}')
    assert arguments_digest("not json") == arguments_digest("not json")
    assert arguments_digest("not json") != arguments_digest("not json ")


def test_definition_digest_binds_description_and_parameters() -> None:
    base = spec()
    assert definition_digest(base) == "sha256:" + base.digest
    assert definition_digest(base) == definition_digest(
        identity=base.identity, description=base.description, parameters=base.parameters)
    assert definition_digest(base) != definition_digest(spec(description="Comment on a PR."))
    assert definition_digest(base) != definition_digest(spec(parameters={"type": "object"}))
    assert definition_digest(base) != definition_digest(spec(namespace="gh"))
    strict = FunctionSpec.build(base.identity, base.description, base.parameters, strict=True)
    assert definition_digest(strict) == definition_digest(base)  # strict is request noise


# --------------------------------------------------------------------------------------------------
# the operator's policy

POLICY_TOML = """
default_approval = "none"
expires_in = 600

[grant_expires_in]
session = 3600
always = 86400

[[rules]]
tools = ["gh__get_*"]
approval = "none"

[[rules]]
tools = ["gh__*", "send_email"]
approval = "required"
scopes = ["once", "session"]
expires_in = 120
message = "GitHub writes need approval."

[[rules]]
tools = ["delete_?"]
approval = "required"
bind_arguments = true
"""


def test_policy_file_toml_and_json(tmp_path: Path) -> None:
    toml_path = tmp_path / "approvals.toml"
    toml_path.write_text(POLICY_TOML)
    policy = load_policy(toml_path)
    import tomllib
    json_path = tmp_path / "approvals.json"
    json_path.write_text(json.dumps(tomllib.loads(POLICY_TOML)))
    assert load_policy(json_path) == policy

    assert not policy.effective("gh__get_issue").required  # first match wins
    e = policy.effective(spec("add_comment", namespace="gh"))  # namespaced: flat name gh__add_comment
    assert e.required and e.scopes == ("once", "session") and e.expires_in == 120
    assert e.message == "GitHub writes need approval." and e.source == "rules[1]"
    assert e.grant_expires_in == {"session": 3600, "always": 86400}
    assert policy.effective("send_email").required
    assert policy.effective(ToolIdentity(None, "delete_x")).bind_arguments
    assert not policy.effective("delete_xy").required  # ? is one character
    assert not policy.effective("GH__push").required  # case-sensitive on every OS
    d = policy.effective("anything_else")
    assert not d.required and d.source == "default" and d.expires_in == 600
    assert d.scopes == ("once", "session", "always")


@pytest.mark.parametrize("doc, key", [
    ({"rulez": []}, "rulez"),
    ({"default_approval": "maybe"}, "default_approval"),
    ({"expires_in": 0}, "expires_in"),
    ({"expires_in": True}, "expires_in"),
    ({"grant_expires_in": {"forever": 1}}, "grant_expires_in.forever"),
    ({"rules": [{"tools": ["a"], "approval": "required"}, {"tools": ["b"], "approval": "required",
                                                            "scopes": ["once", "forever"]}]},
     "rules[1].scopes[1]"),
    ({"rules": [{"tools": [], "approval": "required"}]}, "rules[0].tools"),
    ({"rules": [{"tools": ["a"]}]}, "rules[0].approval"),
    ({"rules": [{"tools": ["a"], "approval": "required", "scope": ["once"]}]}, "rules[0].scope"),
    ({"scopes": []}, "scopes"),
])
def test_policy_errors_name_the_key(doc: dict[str, Any], key: str) -> None:
    with pytest.raises(PolicyFileError) as info:
        ApprovalPolicy.from_mapping(doc)
    assert info.value.key == key
    assert key in str(info.value)


def test_policy_file_unreadable_or_unparsable(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError, match="cannot read"):
        load_policy(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("rules = [")
    with pytest.raises(PolicyFileError, match="not valid TOML"):
        load_policy(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(PolicyFileError, match="not valid JSON"):
        load_policy(bad_json)


def test_tool_definition_can_only_tighten() -> None:
    policy = ApprovalPolicy.from_mapping({"rules": [
        {"tools": ["gated"], "approval": "required", "scopes": ["once", "session"],
         "expires_in": 300}]})
    # a definition may ask for approval where the operator does not
    e = policy.effective("free", {"required": True})
    assert e.required and e.source == "default+definition"
    # ... but never lift the operator's requirement, widen scopes or extend expiry
    e = policy.effective("gated", {"required": False, "scopes": ["once", "session", "always"],
                                   "expires_in": 10_000})
    assert e.required and e.scopes == ("once", "session") and e.expires_in == 300
    e = policy.effective("gated", {"scopes": ["once"], "expires_in": 30, "bind_arguments": True})
    assert e.scopes == ("once",) and e.expires_in == 30 and e.bind_arguments
    with pytest.raises(ApprovalInputError) as info:
        policy.effective("gated", {"scopes": ["always"]}, hint_param="tools[2].approval")
    assert info.value.param == "tools[2].approval.scopes" and info.value.status == 400
    for hint, param in [({"required": "yes"}, "approval.required"),
                        ({"scopes": ["sometimes"]}, "approval.scopes"),
                        ({"expires_in": -1}, "approval.expires_in"),
                        ({"approve": True}, "approval.approve"),
                        ([], "approval")]:
        with pytest.raises(ApprovalInputError) as info:
            policy.effective("gated", hint)
        assert info.value.param == param, hint


def test_approval_hint_positions() -> None:
    assert approval_hint({"type": "function", "name": "f", "approval": {"required": True}}) == \
        {"required": True}
    assert approval_hint({"type": "function", "function": {"name": "f",
                                                           "approval": {"scopes": ["once"]}}}) == \
        {"scopes": ["once"]}
    assert approval_hint({"type": "function", "name": "f"}) is None


# --------------------------------------------------------------------------------------------------
# wire items and schemas

PROPOSAL_ELICITATION = {
    "id": "elicit_123", "type": "elicitation", "elicitation_type": "tool_call_approval",
    "message": "The agent wants to add a comment to PR #123", "name": "add_pr_comment",
    "arguments": "{\"pr_number\": 123, \"body\": \"Looks good!\"}",
}
PROPOSAL_RESPONSES = [
    {"id": "elicit_resp_123", "type": "elicitation_response", "elicitation_id": "elicit_123",
     "action": "accept", "scope": "once", "reason": "optional reason for approving or declining"},
    {"id": "elicit_resp_123", "type": "elicitation_response", "elicitation_id": "elicit_123",
     "action": "decline", "reason": "I don't want to comment on this PR"},
    {"id": "elicit_resp_123", "type": "elicitation_response", "elicitation_id": "elicit_123",
     "action": "cancel"},
]


def test_schemas_are_valid_json_schema_and_match_emitted_items(engine: ApprovalEngine) -> None:
    from jsonschema import Draft202012Validator

    for schema in (TOOL_CALL_APPROVAL_SCHEMA, TOOL_CALL_APPROVAL_RESPONSE_SCHEMA,
                   elicitation_schema(), elicitation_response_schema()):
        Draft202012Validator.check_schema(schema)
    json.dumps(TOOL_CALL_APPROVAL_SCHEMA)  # plain data
    item = elicit(engine, call(s=spec("push", namespace="gh"))).to_json()
    assert item["name"] == "push" and item["namespace"] == "gh"
    Draft202012Validator(TOOL_CALL_APPROVAL_SCHEMA).validate(item)
    Draft202012Validator(elicitation_schema()).validate(item)
    assert parse_elicitation(item) == ToolCallApproval.from_json(item)
    for response in PROPOSAL_RESPONSES:
        Draft202012Validator(TOOL_CALL_APPROVAL_RESPONSE_SCHEMA).validate(response)
        assert parse_elicitation_response(response, elicitation_type="tool_call_approval").id


def test_proposal_sample_elicitation_lacks_the_binding_fields() -> None:
    with pytest.raises(ApprovalInputError) as info:
        parse_elicitation(PROPOSAL_ELICITATION, param="input[1]")
    assert info.value.param in {f"input[1].{k}" for k in (
        "call_id", "arguments_digest", "tool_definition_digest", "requested_scopes", "expires_at")}


@pytest.mark.parametrize("mutate, param, code", [
    (lambda r: r.pop("scope"), "input[0].scope", "invalid_elicitation_response"),
    (lambda r: r.update(scope="forever"), "input[0].scope", "invalid_elicitation_response"),
    (lambda r: r.update(action="approve"), "input[0].action", "invalid_elicitation_response"),
    (lambda r: r.update(scpoe="once"), "input[0].scpoe", "invalid_elicitation_response"),
    (lambda r: r.pop("elicitation_id"), "input[0].elicitation_id", "invalid_elicitation_response"),
    (lambda r: r.update(id=""), "input[0].id", "invalid_elicitation_response"),
    (lambda r: r.update(reason=7), "input[0].reason", "invalid_elicitation_response"),
    (lambda r: r.update(action="decline"), "input[0].scope", "invalid_elicitation_response"),
    (lambda r: r.update(call_id=5), "input[0].call_id", "invalid_elicitation_response"),
])
def test_response_validation_names_the_field(engine: ApprovalEngine, mutate: Any, param: str,
                                             code: str) -> None:
    item = respond(elicit(engine), "accept", "once")
    mutate(item)
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, item)
    assert (info.value.param, info.value.code, info.value.status) == (param, code, 400)
    assert info.value.to_openai()["error"]["param"] == param


def test_unknown_elicitation_type_is_a_400_naming_the_field() -> None:
    item = {"id": "e1", "type": "elicitation", "elicitation_type": "oauth_login", "message": "m"}
    with pytest.raises(ApprovalInputError) as info:
        parse_input_items([{"role": "user", "content": "hi"}, item])
    assert info.value.param == "input[1].elicitation_type"
    assert info.value.code == "unknown_elicitation_type" and info.value.status == 400
    assert "tool_call_approval" in info.value.message
    with pytest.raises(ApprovalInputError) as info:
        parse_input_items([{**item, "elicitation_type": 3}])
    assert info.value.param == "input[0].elicitation_type"


def test_registry_accepts_a_new_type_without_breaking_tool_call_approval(
        engine: ApprovalEngine) -> None:
    oauth = ElicitationType(
        name="oauth_login",
        item_properties={"authorization_url": {"type": "string"}},
        item_required=("authorization_url",),
        response_properties={"state": {"type": "string"}})
    register_elicitation_type(oauth)
    try:
        with pytest.raises(ValueError):
            register_elicitation_type(oauth)
        item = {"id": "e1", "type": "elicitation", "elicitation_type": "oauth_login",
                "message": "Log in to GitHub", "authorization_url": "https://example.test/auth"}
        parsed = parse_input_items([item, respond("e1", "accept", None, state="xyz")])
        assert parsed.elicitations[0][1].fields == {"authorization_url": "https://example.test/auth"}
        assert parsed.responses[0][1].fields == {"state": "xyz"}
        assert set(elicitation_schema()["properties"]["elicitation_type"]["enum"]) == {
            "oauth_login", "tool_call_approval"}
        with pytest.raises(ApprovalInputError) as info:
            parse_elicitation({**item, "authorization_url": 1}, param="input[0]")
        assert info.value.param == "input[0].authorization_url"
        # tool_call_approval is unchanged
        e = elicit(engine)
        assert parse_elicitation(e.to_json()) == e
        assert isinstance(resolve(engine, respond(e))[0], Release)
    finally:
        unregister_elicitation_type("oauth_login")
    with pytest.raises(ApprovalInputError):
        parse_elicitation({"id": "e", "type": "elicitation", "elicitation_type": "oauth_login",
                           "message": "m", "authorization_url": "u"})


def test_two_responses_to_one_elicitation_in_one_request() -> None:
    with pytest.raises(ApprovalInputError) as info:
        parse_input_items([respond("e1", rid="a"), respond("e1", rid="b")])
    assert info.value.param == "input[1].elicitation_id"


# --------------------------------------------------------------------------------------------------
# the engine: propose


def test_ungated_calls_are_released_without_a_record(db: Path, clock: Clock) -> None:
    eng = make_engine(db, clock, ApprovalPolicy())
    out = eng.propose(call(), principal="alice", session="s1")
    assert isinstance(out, Release) and out.via == "policy" and out.arguments == call().arguments
    assert sqlite3.connect(db).execute("SELECT count(*) FROM elicitations").fetchone() == (0,)


def test_elicitation_item_carries_the_binding_fields(engine: ApprovalEngine, clock: Clock) -> None:
    c = call()
    e = elicit(engine, c)
    assert e.call_id == "call_1" and e.name == "add_pr_comment" and e.arguments == c.arguments
    assert e.arguments_digest == arguments_digest(c.arguments)
    assert e.tool_definition_digest == definition_digest(spec())
    assert e.requested_scopes == ("once", "session", "always")
    assert e.expires_at == int(clock.now) + 900
    assert e.id.startswith("elicit_") and len(e.id) > 30  # unguessable
    # no session: the session scope is not offered
    assert elicit(engine, call("call_2"), session=None).requested_scopes == ("once", "always")


def test_parallel_calls_each_carry_their_own_elicitation(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: parallel calls each carry their own elicitation
    calls = [call("call_1", '{"pr": 1}'), call("call_2", '{"pr": 2}'), call("call_3", '{"pr": 3}')]
    items = engine.propose_all(calls, principal="alice", session="s1")
    assert all(isinstance(i, ToolCallApproval) for i in items)
    assert len({i.id for i in items}) == 3
    assert [i.call_id for i in items] == ["call_1", "call_2", "call_3"]
    assert len({i.arguments_digest for i in items}) == 3
    # one answered accept, one declined, one left unanswered: each gets its own outcome
    out = resolve(engine, *[i.to_json() for i in items],
                  respond(items[0], "accept", "once", rid="r1"),
                  respond(items[1], "decline", rid="r2", reason="not this one"))
    assert isinstance(out[0], Release) and out[0].call_id == "call_1"
    assert isinstance(out[1], Decline) and out[1].call_id == "call_2"
    assert out[1].cause == "declined" and "not this one" in out[1].tool_output
    assert isinstance(out[2], Decline) and out[2].call_id == "call_3" and out[2].cause == "unanswered"
    assert len(out) == 3


# --------------------------------------------------------------------------------------------------
# the engine: resolve (ACCEPTANCE cases)


def test_approval_cannot_authorize_a_different_call(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: an approval for one proposed call cannot authorize a different call
    a, b = engine.propose_all([call("call_a", '{"pr": 1}'), call("call_b", '{"pr": 2}')],
                              principal="alice", session="s1")
    # a response that says it is for call_b but answers a's elicitation: refused, nothing consumed
    for field, value in [("call_id", "call_b"), ("arguments_digest", b.arguments_digest)]:
        with pytest.raises(ApprovalInputError) as info:
            resolve(engine, respond(a, rid="r0", **{field: value}))
        assert info.value.code == "elicitation_mismatch" and info.value.param == f"input[0].{field}"
    # the client's echo is never trusted: tampered arguments in the echoed item change nothing
    tampered = {**a.to_json(), "arguments": '{"pr": 999}', "call_id": "call_b"}
    out = resolve(engine, tampered, respond(a, rid="r1", call_id="call_a",
                                            arguments_digest=a.arguments_digest,
                                            tool_definition_digest=a.tool_definition_digest))
    assert isinstance(out[0], Release)
    assert (out[0].call_id, out[0].arguments) == ("call_a", '{"pr": 1}')
    assert out[0].elicitation_id == a.id and out[0].via == "approval" and out[0].grant_id is None
    # b was not approved by it: declined as unanswered, never released
    assert [type(o) for o in out] == [Release, Decline] and out[1].call_id == "call_b"
    assert not any(isinstance(o, Release) and o.call_id == "call_b" for o in out)


def test_session_approval_never_becomes_persistent(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: session approval cannot silently become persistent approval
    e = elicit(engine)
    (out,) = resolve(engine, respond(e, "accept", "session"))
    assert isinstance(out, Release) and out.scope == "session" and out.grant_id
    grant = engine.store.get_grant(out.grant_id)
    assert grant.scope == "session" and grant.session == "s1" and grant.subject == "alice"
    assert grant.origin_elicitation_id == e.id and grant.origin_response_id == "resp_1"
    # later calls in the same session: released through the grant, still a session grant
    later = engine.propose(call("call_2", '{"pr": 5}'), principal="alice", session="s1")
    assert isinstance(later, Release) and later.via == "grant" and later.grant_id == grant.id
    assert later.scope == "session"
    # another session, no session, another principal: asked again
    assert isinstance(engine.propose(call("c3"), principal="alice", session="s2"), ToolCallApproval)
    assert isinstance(engine.propose(call("c4"), principal="alice", session=None), ToolCallApproval)
    assert isinstance(engine.propose(call("c5"), principal="bob", session="s1"), ToolCallApproval)
    # the history replayed in a later turn does not upgrade anything
    assert isinstance(resolve(engine, e.to_json(), respond(e, "accept", "session"))[0], Replayed)
    grants = engine.store.list_grants(now=T0, include_inactive=True)
    assert [(g.scope, g.session) for g in grants] == [("session", "s1")]


def test_a_scope_the_policy_does_not_offer_is_refused(db: Path, clock: Clock) -> None:
    eng = make_engine(db, clock, ApprovalPolicy.require_all(scopes=("once", "session")))
    e = elicit(eng)
    assert e.requested_scopes == ("once", "session")
    with pytest.raises(ApprovalInputError) as info:
        resolve(eng, respond(e, "accept", "always"))
    assert info.value.param == "input[0].scope"
    assert engine_status(eng, e.id) == "pending"  # nothing consumed: the client may correct it
    assert isinstance(resolve(eng, respond(e, "accept", "session"))[0], Release)
    assert {g.scope for g in eng.store.list_grants(now=T0)} == {"session"}


def engine_status(engine: ApprovalEngine, elicitation_id: str) -> str:
    return engine.store.get_elicitation(elicitation_id).status


def test_denial_is_a_terminal_result_the_model_can_observe(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: denial returns a terminal result that the model can observe
    e = elicit(engine)
    (out,) = resolve(engine, respond(e, "decline", rid="r1", reason="I don't want to comment"))
    assert isinstance(out, Decline) and not out.executes
    assert out.cause == "declined" and out.reason == "I don't want to comment"
    assert out.function_call_output_item() == {
        "type": "function_call_output", "call_id": "call_1", "output": out.tool_output}
    assert "declined" in out.tool_output and "I don't want to comment" in out.tool_output
    assert out.chat_tool_message()["tool_call_id"] == "call_1"
    assert engine_status(engine, e.id) == "declined"
    # terminal: a later accept cannot turn it into an execution
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, respond(e, "accept", "once", rid="r2"))
    assert info.value.code == "elicitation_consumed" and info.value.status == 409
    assert isinstance(resolve(engine, respond(e, "decline", rid="r1"))[0], Replayed)


def test_cancel_is_a_decline_without_a_reason(engine: ApprovalEngine) -> None:
    e = elicit(engine)
    (out,) = resolve(engine, respond(e, "cancel", reason="closed the dialog"))
    assert isinstance(out, Decline) and out.cause == "cancelled" and out.reason is None
    assert "closed the dialog" not in out.tool_output
    assert out.tool_output == Decline.of(engine.store.get_elicitation(e.id), "declined").tool_output


def test_expired_approval_cannot_resume(engine: ApprovalEngine, clock: Clock) -> None:
    # ACCEPTANCE: expired approval cannot resume execution
    e = elicit(engine)
    clock.now = e.expires_at
    (out,) = resolve(engine, respond(e, "accept", "always"))
    assert isinstance(out, Decline) and out.cause == "expired" and "expired" in out.tool_output
    assert engine_status(engine, e.id) == "expired"
    assert engine.store.list_grants(now=clock.now, include_inactive=True) == []
    # and stays terminal
    with pytest.raises(ApprovalInputError):
        resolve(engine, respond(e, "accept", "once", rid="r2"))


def test_expired_or_revoked_grant_releases_nothing(engine: ApprovalEngine, clock: Clock) -> None:
    e = elicit(engine)
    (out,) = resolve(engine, respond(e, "accept", "session"))
    grant = engine.store.get_grant(out.grant_id)
    assert grant.expires_at == T0 + 86_400
    assert isinstance(engine.propose(call("c2"), principal="alice", session="s1"), Release)
    clock.now = grant.expires_at
    assert isinstance(engine.propose(call("c3"), principal="alice", session="s1"), ToolCallApproval)
    clock.now = T0 + 10
    assert engine.revoke(grant.id, reason="user withdrew consent")
    assert not engine.revoke(grant.id)
    again = engine.propose(call("c4"), principal="alice", session="s1")
    assert isinstance(again, ToolCallApproval)  # asked again, never released by the revoked grant
    revoked = engine.store.get_grant(grant.id)
    assert revoked.revoked_at == T0 + 10 and revoked.revoked_reason == "user withdrew consent"
    # the revoked grant's origin response replayed: nothing, and the grant stays revoked
    assert isinstance(resolve(engine, respond(e, "accept", "session"))[0], Replayed)
    assert engine.store.list_grants(now=clock.now) == []


def test_changed_arguments_are_a_different_call(db: Path, clock: Clock) -> None:
    # ACCEPTANCE: changed args produce a different digest, and a bound grant does not cover them
    eng = make_engine(db, clock, ApprovalPolicy.from_mapping(
        {"default_approval": "required", "bind_arguments": True}))
    e = elicit(eng, call(arguments='{"pr": 1}'))
    (out,) = resolve(eng, respond(e, "accept", "always"))
    assert eng.store.get_grant(out.grant_id).arguments_digest == e.arguments_digest
    same = eng.propose(call("c2", '{ "pr" : 1 }'), principal="alice", session="s9")
    assert isinstance(same, Release) and same.via == "grant"
    changed = eng.propose(call("c3", '{"pr": 2}'), principal="alice", session="s1")
    assert isinstance(changed, ToolCallApproval) and changed.arguments_digest != e.arguments_digest


def test_grant_stops_applying_when_the_policy_tightens(engine: ApprovalEngine, db: Path,
                                                       clock: Clock) -> None:
    e = elicit(engine)
    resolve(engine, respond(e, "accept", "always"))
    assert isinstance(engine.propose(call("c2"), principal="alice", session="s1"), Release)
    # the tool definition now asks for per-call approval only: the always grant no longer applies
    hinted = engine.propose(call("c3", hint={"scopes": ["once"]}), principal="alice", session="s1")
    assert isinstance(hinted, ToolCallApproval) and hinted.requested_scopes == ("once",)
    # the operator now binds arguments: an unbound grant no longer applies
    stricter = make_engine(db, clock, ApprovalPolicy(default_required=True, bind_arguments=True))
    assert isinstance(stricter.propose(call("c4"), principal="alice", session="s1"), ToolCallApproval)


def test_replaying_a_consumed_elicitation_executes_nothing(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: replaying a transcript with a consumed elicitation must not re-execute the tool
    e = elicit(engine)
    transcript = [{"role": "user", "content": "comment please"}, e.to_json(),
                  respond(e, "accept", "once")]
    first = resolve(engine, *transcript)
    assert [type(o) for o in first] == [Release]
    for _ in range(3):
        again = resolve(engine, *transcript, {"role": "user", "content": "and now?"})
        assert [type(o) for o in again] == [Replayed]
        assert not any(o.executes for o in again)


def test_a_retried_accept_gets_the_same_release_and_no_second_grant(engine: ApprovalEngine) -> None:
    # a lost reply: the same answer again (the same or a new response id) gets the same release
    e = elicit(engine)
    (first,) = resolve(engine, respond(e, "accept", "session", rid="r1"))
    assert isinstance(first, Release) and first.grant_id
    for rid in ("r1", "r1", "r2"):
        (again,) = resolve(engine, e.to_json(), respond(e, "accept", "session", rid=rid))
        assert isinstance(again, Replayed) and not again.executes
        assert again.release == first   # same call id, arguments, scope and grant
    assert [g.id for g in engine.store.list_grants(now=T0, include_inactive=True)] == \
        [first.grant_id]
    # the call in the history (a transcript that keeps it): a no-op
    released = {**first.function_call_item(), "id": "fc_1"}
    (kept,) = resolve(engine, e.to_json(), respond(e, "accept", "session", rid="r1"), released)
    assert isinstance(kept, Replayed) and kept.release is None
    # a different answer to the closed elicitation: 409, whatever the response id
    for other in (respond(e, "decline", rid="r3"), respond(e, "decline", rid="r1"),
                  respond(e, "accept", "once", rid="r4"), respond(e, "cancel", rid="r5")):
        with pytest.raises(ApprovalInputError) as info:
            resolve(engine, other)
        assert info.value.code == "elicitation_consumed" and info.value.status == 409
    assert engine_status(engine, e.id) == "accepted"


def test_a_race_loser_with_the_same_answer_gets_the_same_release(engine: ApprovalEngine) -> None:
    # the loser passed its checks while the record was pending, then found it consumed
    consume = engine.store.consume

    def race(loser: dict[str, Any], winner: dict[str, Any]) -> tuple[Any, Any]:
        won: list[Any] = []

        def winner_first(elicitation_id: str, **kw: Any) -> Any:
            engine.store.consume = consume   # type: ignore[method-assign]
            won.extend(resolve(engine, winner))
            return consume(elicitation_id, **kw)

        engine.store.consume = winner_first   # type: ignore[method-assign]
        try:
            (lost,) = resolve(engine, loser)
        finally:
            engine.store.consume = consume   # type: ignore[method-assign]
        return won[0], lost

    e = elicit(engine)
    winner, loser = race(respond(e, "accept", "once", rid="loser"),
                         respond(e, "accept", "once", rid="winner"))
    assert isinstance(winner, Release) and isinstance(loser, Replayed) and loser.release == winner
    assert engine.store.list_grants(now=T0, include_inactive=True) == []
    # a loser with another answer is rejected (409): the winner's answer stands
    other = elicit(engine, call("call_2"))
    winner, lost = race(respond(other, "decline", rid="l2"),
                        respond(other, "accept", "once", rid="w2"))
    assert isinstance(winner, Release)
    assert isinstance(lost, Rejected) and lost.error.status == 409
    assert lost.error.param == "input[0].elicitation_id"
    assert engine_status(engine, other.id) == "accepted"


def test_a_reused_response_on_a_new_call_id_fails(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: a reused approval response on a new call id
    first = elicit(engine, call("call_1"))
    old = respond(first, "accept", "once", rid="resp_1")
    assert isinstance(resolve(engine, old)[0], Release)
    second = elicit(engine, call("call_2"))
    # the old response as is: history, releases nothing new (call_2 stays pending); at most the
    # same release of call_1 again (an idempotent retry), never call_2
    (again,) = resolve(engine, old)
    assert isinstance(again, Replayed) and again.release.call_id == "call_1"
    assert engine_status(engine, second.id) == "pending"
    # re-sent under a new id: the same answer to the same elicitation, so again call_1 or nothing
    (again,) = resolve(engine, {**old, "id": "resp_2"})
    assert isinstance(again, Replayed) and again.release.call_id == "call_1"
    assert engine_status(engine, second.id) == "pending"
    # pointed at the new call id, or a different answer: refused
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, {**old, "id": "resp_3", "call_id": "call_2"})
    assert info.value.code in {"elicitation_consumed", "elicitation_mismatch"}
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, {**old, "id": "resp_4", "scope": "session"})
    assert info.value.code == "elicitation_consumed"
    # the old response id on the new elicitation is a fresh response: fine, and binds to call_2
    (out,) = resolve(engine, respond(second, "accept", "once", rid="resp_1", call_id="call_2"))
    assert isinstance(out, Release) and out.call_id == "call_2"


def test_a_session_grant_on_a_changed_tool_definition_fails(engine: ApprovalEngine) -> None:
    # ACCEPTANCE: a session grant applied to a different tool definition version
    v1, v2 = spec(), spec(description="Comment on a pull request, and merge it.")
    e = elicit(engine, call(s=v1))
    resolve(engine, respond(e, "accept", "session"))
    assert isinstance(engine.propose(call("c2", s=v1), principal="alice", session="s1"), Release)
    changed = engine.propose(call("c3", s=v2), principal="alice", session="s1")
    assert isinstance(changed, ToolCallApproval)
    assert changed.tool_definition_digest == definition_digest(v2) != e.tool_definition_digest
    # and an approval given for v1 does not release a call once the catalog says v2
    pending = elicit(engine, call("c4", s=v1), session="s2")
    (out,) = resolve(engine, respond(pending, "accept", "once"), session="s2", catalog=[v2])
    assert isinstance(out, Decline) and out.cause == "definition_changed"
    assert engine_status(engine, pending.id) == "invalidated"
    # the tool left the catalog: likewise
    gone = elicit(engine, call("c5", s=v1), session="s3")
    (out,) = resolve(engine, respond(gone, "accept", "once"), session="s3",
                     catalog=[spec("other_tool")])
    assert isinstance(out, Decline) and out.cause == "definition_changed"
    # the same definition in the catalog: released
    ok = elicit(engine, call("c6", s=v2), session="s4")
    assert isinstance(resolve(engine, respond(ok), session="s4", catalog=[v1, v2])[0], Release)


def test_only_the_asked_principal_and_session_can_answer(engine: ApprovalEngine) -> None:
    e = elicit(engine)
    for principal, session in [("mallory", "s1"), ("alice", "s2"), ("alice", None)]:
        with pytest.raises(ApprovalInputError) as info:
            resolve(engine, respond(e), principal=principal, session=session)
        assert info.value.code == "unknown_elicitation" and info.value.param == "input[0].elicitation_id"
    with pytest.raises(ApprovalInputError):
        resolve(engine, respond("elicit_does_not_exist"))
    assert isinstance(resolve(engine, respond(e))[0], Release)
    with pytest.raises(ValueError):
        engine.propose(call(), principal="", session="s1")


def test_an_invalid_response_consumes_nothing_in_the_request(engine: ApprovalEngine) -> None:
    a, b = engine.propose_all([call("a"), call("b")], principal="alice", session="s1")
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, respond(a, rid="r1"), respond(b, "accept", None, rid="r2"))
    assert info.value.param == "input[1].scope"
    assert engine_status(engine, a.id) == engine_status(engine, b.id) == "pending"


def test_an_echoed_elicitation_without_response_is_declined(engine: ApprovalEngine) -> None:
    e = elicit(engine)
    out = resolve(engine, {"role": "user", "content": "never mind"}, e.to_json())
    assert len(out) == 1 and isinstance(out[0], Decline) and out[0].cause == "unanswered"
    # a forged echo (unknown id) is ignored: nothing happens
    assert resolve(engine, {**e.to_json(), "id": "elicit_forged"}) == []


def test_a_call_that_can_never_be_approved_is_declined(db: Path, clock: Clock) -> None:
    eng = make_engine(db, clock, ApprovalPolicy.require_all(scopes=("session",)))
    out = eng.propose(call(), principal="alice", session=None)
    assert isinstance(out, Decline) and out.cause == "not_approvable"


def test_open_engine_and_env(tmp_path: Path) -> None:
    policy = tmp_path / "approvals.toml"
    policy.write_text(POLICY_TOML)
    eng = open_engine(policy, tmp_path / "g.db")
    assert isinstance(eng.propose(call(s=spec("send_email")), principal="a", session="s"),
                      ToolCallApproval)
    assert engine_from_settings(Settings.from_environ({})) is None
    env_engine = engine_from_settings(
        Settings.from_environ({"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)}))
    assert env_engine.store.path == tmp_path / "grants.db"
    for e in (eng, env_engine):
        e.store.close()


# --------------------------------------------------------------------------------------------------
# the store


def test_store_is_wal_with_full_sync_and_refuses_memory(db: Path) -> None:
    store = SQLiteGrantStore(db)
    conn = store._conn()
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.close()
    with pytest.raises(ValueError):
        SQLiteGrantStore(":memory:")


def test_store_consume_is_single_use(engine: ApprovalEngine) -> None:
    e = elicit(engine)
    kw: dict[str, Any] = {"principal": "alice", "session": "s1", "status": "accepted", "scope": "once",
                          "reason": None, "now": T0}
    assert engine.store.consume(e.id, response_id="r1", **kw).outcome == "consumed"
    second = engine.store.consume(e.id, response_id="r2", **kw)
    assert second.outcome == "already" and second.record.response_id == "r1"
    assert engine.store.consume("nope", response_id="r3", **kw).outcome == "missing"
    assert engine.store.consume(e.id, response_id="r4", **{**kw, "principal": "bob"}).outcome == \
        "missing"


def test_threads_racing_on_one_elicitation_release_once(engine: ApprovalEngine) -> None:
    for round_ in range(5):
        session = f"s{round_}"  # a fresh session each round (the session grant would release)
        e = elicit(engine, call(f"call_{round_}"), session=session)
        barrier = threading.Barrier(4)
        results: list[Any] = []

        def worker(i: int, e: ToolCallApproval, session: str, barrier: threading.Barrier,
                   results: list[Any]) -> None:
            barrier.wait()
            try:
                results.extend(resolve(engine, respond(e, "accept", "session", rid=f"r{i}"),
                                       session=session))
            except Exception as exc:  # noqa: BLE001 - anything but ApprovalInputError fails below
                results.append(exc)

        threads = [threading.Thread(target=worker, args=(i, e, session, barrier, results))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # one consumption; every other thread sent the same answer, so it gets the same release
        [fresh] = [r for r in results if isinstance(r, Release)]
        assert all(isinstance(r, Replayed) and r.release == fresh for r in results
                   if r is not fresh), results
    grants = engine.store.list_grants(now=T0)
    assert len(grants) == 5 and len({g.origin_elicitation_id for g in grants}) == 5


def _race_worker(db: str, ids: list[str], worker: int, barrier: Any, queue: Any) -> None:
    store = SQLiteGrantStore(db)
    eng = ApprovalEngine(ApprovalPolicy.require_all(), store, clock=lambda: T0)
    for eid in ids:
        barrier.wait()
        try:
            out = eng.resolve(respond(eid, "accept", "session", rid=f"resp_w{worker}_{eid}"),
                              principal="alice", session="s1", turn=False)
            release = out if isinstance(out, Release) else getattr(out, "release", None)
            queue.put((eid, worker, type(out).__name__, release and release.grant_id))
        except ApprovalInputError as exc:
            queue.put((eid, worker, exc.code))
    store.close()


def test_two_processes_consuming_one_elicitation_release_it_exactly_once(
        engine: ApprovalEngine, db: Path) -> None:
    # CONCURRENCY: two simultaneous follow-ups (separate processes and connections), one release
    n = 12
    items = engine.propose_all([call(f"call_{i}") for i in range(n)], principal="alice",
                               session="s1")
    ids = [i.id for i in items]
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(str(db), ids, w, barrier, queue))
             for w in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in range(2 * n)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for eid in ids:
        kinds = sorted(kind for e, _, kind, _ in results if e == eid)
        # one consumption; the loser sent the same answer: the same release (same grant), no other
        assert kinds == ["Release", "Replayed"], (eid, kinds)
        assert len({grant for e, _, _, grant in results if e == eid}) == 1
    grants = engine.store.list_grants(now=T0)
    assert sorted(g.origin_elicitation_id for g in grants) == sorted(ids)
    for eid in ids:
        rec = engine.store.get_elicitation(eid)
        assert rec.status == "accepted"
        assert engine.store.get_grant(rec.grant_id).origin_response_id == rec.response_id


# --------------------------------------------------------------------------------------------------
# durability: a writer killed with SIGKILL in the middle of a transaction

_WRITER = textwrap.dedent("""
    import sys, time
    from vllm_allowed_tools.approvals import ApprovalEngine, ApprovalPolicy, ProposedCall, SQLiteGrantStore
    from vllm_allowed_tools.request import FunctionSpec, ToolIdentity

    db, mode, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    spec = FunctionSpec.build(ToolIdentity(None, "deploy"), "Deploy.", None)
    store = SQLiteGrantStore(db)
    engine = ApprovalEngine(ApprovalPolicy.require_all(), store)

    def one(i):
        e = engine.propose(ProposedCall.from_spec(spec, call_id=f"c{i}", arguments="{}"),
                           principal=f"p{i}", session=f"s{i}")
        (out,) = engine.resolve_all([{"id": f"r{i}", "type": "elicitation_response",
                                      "elicitation_id": e.id, "action": "accept",
                                      "scope": "always" if i % 2 else "session"}],
                                     principal=f"p{i}", session=f"s{i}", turn=False)
        print("COMMITTED", out.grant_id, e.id, flush=True)

    i = 0
    while mode == "loop" or i < count:
        one(i)
        i += 1
    def hang():
        print("IN_TX", flush=True)
        time.sleep(60)
    store.before_commit = hang
    one(i)
""")


def _run_writer(db: Path, mode: str, count: int, kill_after: int | None = None) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(db), mode, str(count)],
                            stdout=subprocess.PIPE, text=True, env=env)
    committed: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("COMMITTED"):
                committed.append(line.split()[1])
                if kill_after is not None and len(committed) >= kill_after:
                    break
            elif line.startswith("IN_TX"):
                break
        proc.send_signal(signal.SIGKILL)  # mid-transaction (IN_TX) or mid-loop
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return committed


def _check_no_half_record(db: Path) -> tuple[set[str], list[Any]]:
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    grants = {row[0]: row for row in conn.execute(
        "SELECT id, origin_elicitation_id, scope FROM grants")}
    rows = conn.execute("SELECT id, status, scope, grant_id, response_id FROM elicitations").fetchall()
    by_id = {row[0]: row for row in rows}
    for gid, origin, _ in grants.values():  # every grant: its elicitation was consumed by it
        assert by_id[origin][1] == "accepted" and by_id[origin][3] == gid
    for eid, status, scope, gid, rid in rows:  # every consumed elicitation: complete
        if status == "accepted" and scope in ("session", "always"):
            assert gid in grants, eid
        assert (status == "pending") == (rid is None)
    conn.close()
    return set(grants), rows


def test_writer_killed_mid_transaction_loses_nothing_committed(db: Path) -> None:
    # DURABILITY: SIGKILL between the writes of a transaction and its COMMIT
    committed = _run_writer(db, "count", 6)
    assert len(committed) == 6
    grants, rows = _check_no_half_record(db)
    assert grants == set(committed)  # every committed grant, and not the in-flight one
    pending = [r for r in rows if r[1] == "pending"]
    assert len(pending) == 1  # the in-flight elicitation's consumption was rolled back whole
    # the store opens and works again after the crash (the hot WAL is recovered)
    store = SQLiteGrantStore(db)
    eng = ApprovalEngine(ApprovalPolicy.require_all(), store)
    spec_ = FunctionSpec.build(ToolIdentity(None, "deploy"), "Deploy.", None)
    out = eng.resolve(respond(pending[0][0], "accept", "once", rid="late"), principal="p6",
                      session="s6", turn=False)
    assert isinstance(out, Release) and out.call_id == "c6"
    assert isinstance(eng.propose(ProposedCall.from_spec(spec_, call_id="x", arguments="{}"),
                                  principal="p5", session="zzz"), Release)  # an always grant
    store.close()


def test_writer_killed_at_a_random_point_leaves_a_consistent_store(db: Path) -> None:
    committed = _run_writer(db, "loop", 0, kill_after=15)
    grants, _ = _check_no_half_record(db)
    assert set(committed) <= grants


def test_purge_drops_only_dead_records(engine: ApprovalEngine, clock: Clock, db: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    old = elicit(engine, call("c1"), session="old")
    (r_old,) = resolve(engine, respond(old, "accept", "session"), session="old")
    done = elicit(engine, call("c2"), session="done")
    resolve(engine, respond(done, "decline", rid="r2"), session="done")
    stale = elicit(engine, call("c3"), session="stale")  # pending, will expire unanswered
    clock.now = T0 + 86_400 + 10  # the session grant and the stale elicitation expired
    live = elicit(engine, call("c4"), session="live")  # pending, not expired
    # the grant, both terminal elicitations and the expired pending one
    assert engine.store.purge(before=clock.now) == 4
    assert engine.store.get_elicitation(stale.id) is None
    assert engine.store.get_grant(r_old.grant_id) is None
    assert engine.store.get_elicitation(done.id) is None
    assert engine.store.get_elicitation(live.id).status == "pending"
    # a purged elicitation answered again is unknown: still nothing executes
    with pytest.raises(ApprovalInputError) as info:
        resolve(engine, respond(done, "accept", "once", rid="r3"), session="done")
    assert info.value.code == "unknown_elicitation"
    assert approvals_cli.main(["--db", str(db), "purge", "--older-than-days", "0"]) == 0
    assert "removed" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# the CLI


def test_cli_list_and_revoke(engine: ApprovalEngine, db: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    e1 = elicit(engine, call("c1"))
    (r1,) = resolve(engine, respond(e1, "accept", "session", rid="r1"))
    e2 = elicit(engine, call("c2", s=spec("push", namespace="gh")), principal="bob")
    (r2,) = resolve(engine, respond(e2, "accept", "always", rid="r2"), principal="bob")
    cli = approvals_cli.main

    assert cli(["--db", str(db), "list"]) == 0
    out = capsys.readouterr().out
    assert r1.grant_id in out and r2.grant_id in out and "gh__push" in out and "session" in out
    assert cli(["--db", str(db), "list", "--subject", "bob", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [(g["id"], g["scope"], g["state"]) for g in lines] == [(r2.grant_id, "always", "live")]

    assert cli(["--db", str(db), "revoke", r1.grant_id, "--reason", "left the team"]) == 0
    assert f"revoked {r1.grant_id}" in capsys.readouterr().out
    # the engine (another connection, as another server process would be) sees it at once
    assert isinstance(engine.propose(call("c3"), principal="alice", session="s1"), ToolCallApproval)
    assert cli(["--db", str(db), "revoke", r1.grant_id]) == 1
    assert "already revoked" in capsys.readouterr().err
    assert cli(["--db", str(db), "revoke", "grant_nope"]) == 1
    assert "no grant" in capsys.readouterr().err
    assert cli(["--db", str(db), "list"]) == 0
    assert r1.grant_id not in capsys.readouterr().out
    assert cli(["--db", str(db), "list", "--all", "--json"]) == 0
    states = {json.loads(x)["id"]: json.loads(x)["state"] for x in capsys.readouterr().out.split("\n")
              if x}
    assert states == {r1.grant_id: "revoked", r2.grant_id: "live"}
    assert cli(["--db", str(db / "missing"), "list"]) == 2


def test_cli_runs_as_a_module(engine: ApprovalEngine, db: Path) -> None:
    e = elicit(engine)
    (r,) = resolve(engine, respond(e, "accept", "always"))
    proc = subprocess.run([sys.executable, "-m", "vllm_allowed_tools.approvals.cli", "--db", str(db),
                           "revoke", r.grant_id], capture_output=True, text=True, cwd=ROOT,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert engine.store.get_grant(r.grant_id).revoked_at is not None


# --------------------------------------------------------------------------------------------------
# PostgreSQL (several hosts): the same engine behaviour, when a server can be had


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_dsn() -> Any:
    """A DSN: $VLLM_ALLOWED_TOOLS_TEST_POSTGRES, or a throwaway server started with initdb/pg_ctl
    (needs psycopg, the PostgreSQL binaries and a non-root user or root's `su`)."""
    try:
        import psycopg  # noqa: F401
    except ModuleNotFoundError:
        pytest.skip("PostgreSQL store not tested: psycopg is not installed "
                    "(pip install 'psycopg[binary]')")
    dsn = os.environ.get("VLLM_ALLOWED_TOOLS_TEST_POSTGRES")
    if dsn:
        yield dsn
        return
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("PostgreSQL store not tested: no PostgreSQL server binaries (initdb, pg_ctl) "
                    "and VLLM_ALLOWED_TOOLS_TEST_POSTGRES is unset")
    tmp = tempfile.mkdtemp(prefix="vat-pg-")
    os.chmod(tmp, 0o777)
    data, port = os.path.join(tmp, "data"), _free_port()
    prefix: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        user = "postgres"
        if subprocess.run(["id", user], capture_output=True, check=False).returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            pytest.skip("PostgreSQL store not tested: running as root without a `postgres` user")
        prefix = ["su", user, "-s", "/bin/sh", "-c"]

    def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
        if prefix:
            cmd = [*prefix, " ".join(f"'{c}'" for c in cmd)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)

    proc = run([initdb, "-D", data, "-A", "trust", "-U", "vat", "--no-sync"])
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"PostgreSQL store not tested: initdb failed: {proc.stderr.strip()[:300]}")
    proc = run([pg_ctl, "-D", data, "-l", os.path.join(tmp, "log"), "-w", "-o",
                f"-p {port} -k {tmp} -c listen_addresses= -c fsync=off", "start"])
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(f"PostgreSQL store not tested: server did not start: {proc.stderr.strip()[:300]}")
    try:
        yield f"postgresql://vat@/postgres?host={tmp}&port={port}"
    finally:
        run([pg_ctl, "-D", data, "-m", "immediate", "stop"])
        shutil.rmtree(tmp, ignore_errors=True)


def test_postgres_store_behaves_like_sqlite(postgres_dsn: str, clock: Clock) -> None:
    from vllm_allowed_tools.approvals import PostgresGrantStore

    store = PostgresGrantStore(postgres_dsn)
    eng = ApprovalEngine(ApprovalPolicy.require_all(), store, clock=clock)
    session = f"pg-{time.time_ns()}"
    a, _b = eng.propose_all([call("a", '{"pr": 1}'), call("b", '{"pr": 2}')], principal="alice",
                            session=session)
    out = eng.resolve_all([respond(a, "accept", "session", rid=f"{a.id}-r")], principal="alice",
                          session=session, turn=False)
    assert [type(o) for o in out] == [Release, Decline] and out[0].call_id == "a"
    assert isinstance(eng.propose(call("c"), principal="alice", session=session), Release)
    assert isinstance(eng.resolve_all([respond(a, "accept", "session", rid=f"{a.id}-r")],
                                      principal="alice", session=session, turn=False)[0], Replayed)
    assert eng.revoke(out[0].grant_id)
    assert isinstance(eng.propose(call("d"), principal="alice", session=session), ToolCallApproval)
    # racing threads: one release
    e = eng.propose(call("e"), principal="alice", session=session)
    barrier, results = threading.Barrier(3), []

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results.extend(eng.resolve_all([respond(e, "accept", "once", rid=f"{e.id}-{i}")],
                                           principal="alice", session=session, turn=False))
        except ApprovalInputError as exc:
            results.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, Release) for r in results) == 1
    store.close()
