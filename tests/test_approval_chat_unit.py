"""The approval chat's rules without a browser or a model server (examples/approval_chat): only
the holder of an API key sees and revokes its grants, answers wait for every approval unless the
person submits explicitly, each prompt's options say what they do under the policy, each turn's
note says which tools it allows and which ask first, and a gated call is labelled with what let it
run (the person's accept or a grant of theirs)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from vllm_allowed_tools.approvals.policy import load_policy
from vllm_allowed_tools.approvals.store import ElicitationRecord, Grant, SQLiteGrantStore

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "approval_chat"
if str(EXAMPLE) not in sys.path:   # the example's modules import each other as scripts do
    sys.path.insert(0, str(EXAMPLE))

from agent import Agent, AnswerError  # noqa: E402
from approval_options import ApprovalOptions  # noqa: E402
from conversation import Conversation  # noqa: E402
from desk_tools import DeskTools, tool_definitions  # noqa: E402
from my_grants import GrantView, MyGrants, NotYourGrant  # noqa: E402
from tool_rule import must_call, tools_asked_for  # noqa: E402
from turn_notes import released_by, turn_note  # noqa: E402

from vllm_allowed_tools.approvals.response_bodies import session_of  # noqa: E402

POLICY = ApprovalOptions(load_policy(EXAMPLE / "policy.toml"))


def _mint(store: SQLiteGrantStore, principal: str, name: str = "send_email") -> str:
    """A session grant of ``principal``, minted as the server mints one (an accepted record)."""
    now = time.time()
    record = ElicitationRecord(
        id=f"elicit_{principal[-6:]}_{name}", principal=principal, session="cache_key:chat-1",
        batch_id="batch", call_id="call_1", namespace=None, name=name, arguments="{}",
        arguments_digest="sha256:" + "0" * 64, definition_digest="sha256:" + "1" * 64,
        requested_scopes=("once", "session"), bind_arguments=False, grant_expires_in={},
        created_at=now, expires_at=now + 600)
    store.add_elicitations([record])
    grant = Grant(id=f"grant_{record.id}", subject=principal, session="cache_key:chat-1",
                  namespace=None, name=name, definition_digest=record.definition_digest,
                  arguments_digest=None, scope="session", origin_elicitation_id=record.id,
                  origin_response_id="er_1", origin_session="cache_key:chat-1", created_at=now,
                  expires_at=now + 3600)
    done = store.consume(record.id, principal=principal, session=record.session,
                         response_id="er_1", status="accepted", scope="session", reason=None,
                         now=now, grant=grant)
    assert done.outcome == "consumed"
    return grant.id


def test_only_the_holder_of_a_key_sees_and_revokes_its_grants(tmp_path):
    store = SQLiteGrantStore(tmp_path / "grants.db")
    grants = MyGrants(store)
    mine = _mint(store, grants.principal_of("key-a"))
    theirs = _mint(store, grants.principal_of("key-b"), "delete_file")
    assert grants.principal_of("key-a") != grants.principal_of("key-b")

    assert [g.id for g in grants.live("key-a")] == [mine]
    assert [g.id for g in grants.live("key-b")] == [theirs]
    [view] = grants.live("key-a")
    shown = view.to_json("chat-1")
    assert shown["in_this_chat"] is True and "subject" not in shown   # no principal leaves
    assert view.to_json("chat-2")["in_this_chat"] is False

    with pytest.raises(NotYourGrant):
        grants.revoke("key-a", theirs)
    assert store.get_grant(theirs).revoked_at is None, "another person's grant stays"
    grants.revoke("key-a", mine)
    assert grants.live("key-a") == []
    with pytest.raises(NotYourGrant):
        grants.revoke("key-a", mine)   # already revoked
    with pytest.raises(ValueError, match="sign in"):
        grants.principal_of("")


def _pending(name: str, scopes: list[str]) -> dict:
    return {"id": f"elicit_{name}", "type": "elicitation", "name": name, "call_id": f"call_{name}",
            "arguments_digest": "sha256:" + "2" * 64, "tool_definition_digest": "sha256:" + "3" * 64,
            "requested_scopes": scopes}


def test_answers_are_sent_only_when_all_are_given_or_the_person_submits():
    chat = Conversation()
    chat.pending = [_pending("send_email", ["once", "session"]), _pending("delete_file", ["once"])]
    one = [{"elicitation_id": "elicit_send_email", "action": "accept", "scope": "session"}]
    with pytest.raises(AnswerError, match="delete_file"):
        Agent._responses(chat, one, submit_now=False)
    [response] = Agent._responses(chat, one, submit_now=True)
    assert response["scope"] == "session" and response["call_id"] == "call_send_email"
    assert response["arguments_digest"] == "sha256:" + "2" * 64   # the binding the server checks
    both = one + [{"elicitation_id": "elicit_delete_file", "action": "decline",
                   "reason": " not now "}]
    declined = Agent._responses(chat, both, submit_now=False)[1]
    assert declined["reason"] == "not now" and "scope" not in declined
    for bad in ([{"elicitation_id": "elicit_delete_file", "action": "accept", "scope": "always"}],
                [{"elicitation_id": "elicit_other", "action": "cancel"}],
                [{"elicitation_id": "elicit_delete_file", "action": "approve"}],
                one + one):
        with pytest.raises(AnswerError):
            Agent._responses(chat, bad, submit_now=True)
    with pytest.raises(AnswerError, match="Nothing is waiting"):
        Agent._responses(Conversation(), one, submit_now=True)


def test_the_tool_rule_forces_the_named_tools_and_otherwise_asks_for_text():
    assert tools_asked_for("Please EMAIL Bob and check the weather.") == ["get_weather",
                                                                          "send_email"]
    assert tools_asked_for("Please email the meeting notes to Bob.") == ["send_email"]
    assert tools_asked_for("Hello there") == [] and must_call([]) == "none"
    assert must_call(["send_email"]) == {"type": "allowed_tools", "mode": "required",
                                         "tools": [{"type": "function", "name": "send_email"}]}


def test_each_option_says_what_it_does_under_the_policy():
    known = ApprovalOptions(load_policy(EXAMPLE / "policy.toml"))
    options = {o.scope or o.action: o for o in known.for_prompt("send_email", None,
                                                                 ["once", "session", "always"])}
    assert list(options) == ["once", "session", "always", "decline", "cancel"]
    assert "for 1 hour" in options["session"].meaning and "in this chat" in options["session"].meaning
    assert "for 1 week" in options["always"].meaning and "every chat" in options["always"].meaning
    assert "any arguments" in options["session"].meaning
    unknown = ApprovalOptions(None).for_prompt("delete_file", None, ["once"])
    assert [o.label for o in unknown] == ["Allow once", "Decline", "Cancel"]


def _grant(tool: str, scope: str, chat: str | None) -> GrantView:
    session = session_of({"prompt_cache_key": chat}) if chat else None
    return GrantView(id=f"grant_{tool}_{scope}", tool=tool, scope=scope, session=session,
                     bound_to_arguments=False, created_at=time.time(), expires_at=None)


def test_a_turns_note_names_its_tools_and_which_ask_first():
    note = turn_note(["get_weather", "send_email"], "required", POLICY, [], "chat-1")
    assert note["tools"] == [{"name": "get_weather", "gate": "free"},
                             {"name": "send_email", "gate": "asks"}]
    assert note["gated"] == ["send_email"] and note["mode"] == "required"
    granted = turn_note(["send_email"], "required", POLICY,
                        [_grant("send_email", "session", "chat-1")], "chat-1")
    assert granted["tools"] == [{"name": "send_email", "gate": "session"}]
    elsewhere = turn_note(["send_email"], "required", POLICY,
                          [_grant("send_email", "session", "chat-2")], "chat-1")
    assert elsewhere["tools"][0]["gate"] == "asks", "another chat's session grant does not apply"
    unknown = turn_note(["send_email"], "required", ApprovalOptions(None), [], "chat-1")
    assert unknown["tools"][0]["gate"] == "unknown"
    assert turn_note([], "none", POLICY, [], "chat-1")["tools"] == []


def test_a_gated_call_is_labelled_with_what_let_it_run():
    call = {"type": "function_call", "call_id": "call_1", "name": "send_email", "arguments": "{}"}
    asked = {"type": "elicitation", "id": "elicit_1", "call_id": "call_1", "name": "send_email"}
    accepted = {"type": "elicitation_response", "elicitation_id": "elicit_1", "action": "accept",
                "scope": "session"}
    session = [_grant("send_email", "session", "chat-1")]
    assert released_by(call, [asked, accepted], POLICY, session, "chat-1")["via"] == "approval"
    under = released_by(call, [], POLICY, session, "chat-1")
    assert under["via"] == "grant" and under["scope"] == "session"
    assert "session grant" in under["text"]
    always = released_by(call, [], POLICY, [_grant("send_email", "always", None)], "chat-9")
    assert always["scope"] == "always"
    assert released_by(call, [], POLICY, [], "chat-1") is None
    weather = {**call, "name": "get_weather"}
    assert released_by(weather, [], POLICY, [_grant("get_weather", "always", None)],
                       "chat-1") is None, "a tool that never asks ran under no grant"


def test_the_tools_have_arguments_a_person_reads_and_run_behind_the_guard():
    tools = {tool["name"]: tool for tool in tool_definitions()}
    assert set(tools["send_email"]["parameters"]["required"]) == {"recipient", "subject", "body"}
    assert tools["get_weather"]["parameters"]["required"] == ["city"]
    desk = DeskTools("person")
    body = {"model": "m", "input": [], "tools": tool_definitions(), "tool_choice": must_call(
        ["send_email"])}
    call = {"type": "function_call", "call_id": "c1", "name": "send_email",
            "arguments": '{"recipient": "Bob", "subject": "Notes", "body": "Here they are."}'}
    assert desk.run(call, body, "s").ok and desk.desk.outbox == ["To Bob: Notes — Here they are."]
    refused = desk.run({**call, "call_id": "c2", "name": "delete_file",
                        "arguments": '{"path": "a.txt"}'}, body, "s")
    assert not refused.ok and desk.desk.deleted == [], "a tool this turn did not allow never runs"
    wrong = desk.run({**call, "call_id": "c3", "arguments": '{"recipient": "Bob"}'}, body, "s")
    assert not wrong.ok and len(desk.desk.outbox) == 1, "arguments off the schema never run"
