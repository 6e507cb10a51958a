"""Approvals over custom tools (pure, no vLLM): a gated ``custom_tool_call`` leaves as a
``tool_call_approval`` elicitation (unary and streamed, its input deltas withheld), an accept
releases exactly the recorded ``custom_tool_call``, a decline or cancel reaches the model as that
call's ``custom_tool_call_output``, answers are idempotent, grants match the same input digest
under the scopes functions use, and Chat decides custom tools before generation."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest
import rfc8785

from vllm_allowed_tools.approvals import ApprovalInputError, ApprovalPolicy, ProposedCall, \
    SQLiteGrantStore, open_engine
from vllm_allowed_tools.approvals.chat import CODE_TOOL_NEEDS_APPROVAL, ChatCallFilter, \
    decide_chat_turn
from vllm_allowed_tools.approvals.digests import definition_digest, input_digest
from vllm_allowed_tools.approvals.store.sql import SCHEMA, SCHEMA_VERSION
from vllm_allowed_tools.approvals.stream import ApprovalStream
from vllm_allowed_tools.approvals.response_bodies import ResponseApprovals, direct_events, direct_response, \
    prepare_request
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import FunctionSpec, TurnAllowlist, resolve_allowlist
from vllm_allowed_tools.response import AllowedNames

CUSTOM, FREE = "apply_patch", "get_weather"
POLICY = {"rules": [{"tools": [CUSTOM], "approval": "required",
                     "scopes": ["once", "session", "always"]}]}
GRAMMAR = 'start: "*** Begin Patch\\n" /[^*]+/ "*** End Patch"'
CUSTOM_TOOL = {"type": "custom", "name": CUSTOM, "description": "Apply a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
PATCH = "*** Begin Patch\n+hello \"world\"\n*** End Patch"


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(POLICY), tmp_path / "grants.db")


def _body(*items, tool=CUSTOM_TOOL):
    return {"model": "tiny", "input": list(items) or "hi",
            "tools": [tool, POOL_BY_NAME[FREE].responses_tool()]}


def _call(call_id="c1", patch=PATCH):
    return {"id": "ctc_up", "type": "custom_tool_call", "call_id": call_id, "name": CUSTOM,
            "input": patch, "status": "completed"}


def _approvals(engine, body=None, session="s1"):
    body = body or _body()
    return ResponseApprovals(engine, body, resolve_allowlist(body, "responses"), principal="alice",
                             session=session)


def _elicit(engine, call_id="c1", patch=PATCH, session="s1"):
    response = {"object": "response", "output": [_call(call_id, patch)]}
    _approvals(engine, session=session).apply_to_response(response)
    [item] = response["output"]
    return item


def _answer(elicitation, action="accept", scope="once", rid="er_1", **fields):
    item = {"id": rid, "type": "elicitation_response", "elicitation_id": elicitation["id"],
            "action": action, **fields}
    if action == "accept":
        item["scope"] = scope
    return item


def _prepare(engine, body, session="s1"):
    return prepare_request(engine, body, principal="alice", session=session,
                           catalog=resolve_allowlist(body, "responses"))


def _expected_input_digest(text):
    return "sha256:" + hashlib.sha256(rfc8785.dumps(text)).hexdigest()


# ------------------------------------------------------------------------------------- elicit


def test_a_gated_custom_call_becomes_a_tool_call_approval(engine):
    response = {"object": "response", "output": [_call("c1"), {
        "type": "function_call", "call_id": "c2", "name": FREE, "arguments": '{"city": "Oslo"}'}]}
    _approvals(engine).apply_to_response(response)
    elicitation, free = response["output"]
    assert elicitation["type"] == "elicitation" and free["type"] == "function_call"
    assert elicitation["elicitation_type"] == "tool_call_approval"
    assert (elicitation["call_id"], elicitation["name"]) == ("c1", CUSTOM)
    assert elicitation["tool_type"] == "custom" and elicitation["arguments"] == PATCH
    # the raw input, digested as the RFC 8785 JSON string holding it (never read as JSON)
    assert elicitation["arguments_digest"] == _expected_input_digest(PATCH) == input_digest(PATCH)
    spec = FunctionSpec.custom(CUSTOM, "Apply a patch.", ("lark", GRAMMAR))
    assert elicitation["tool_definition_digest"] == definition_digest(spec)
    record = engine.store.get_elicitation(elicitation["id"])
    assert record.tool_type == "custom" and record.arguments == PATCH


def test_input_digest_vector_and_what_the_definition_digest_binds():
    # the vector docs/approvals.md shows
    assert input_digest("*** Begin Patch\n*** End Patch") == \
        "sha256:" + hashlib.sha256(b'"*** Begin Patch\\n*** End Patch"').hexdigest()
    # a JSON-looking input is still a string: not the digest of the object it spells
    assert input_digest('{"a": 1}') != "sha256:" + hashlib.sha256(b'{"a":1}').hexdigest()
    base = FunctionSpec.custom(CUSTOM, "Apply a patch.", ("lark", GRAMMAR))
    others = [FunctionSpec.custom(CUSTOM, "Apply a diff.", ("lark", GRAMMAR)),
              FunctionSpec.custom(CUSTOM, "Apply a patch.", ("regex", GRAMMAR)),
              FunctionSpec.custom(CUSTOM, "Apply a patch.", ("lark", GRAMMAR + " ")),
              FunctionSpec.custom(CUSTOM, "Apply a patch.", None),
              FunctionSpec.custom("apply_diff", "Apply a patch.", ("lark", GRAMMAR))]
    assert len({definition_digest(s) for s in [base, *others]}) == 6
    assert definition_digest(base) == "sha256:" + hashlib.sha256(rfc8785.dumps({
        "type": "custom", "name": CUSTOM, "description": "Apply a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}})).hexdigest()


def test_changed_input_is_another_call_with_another_digest(engine):
    first = _elicit(engine, "c1")
    second = _elicit(engine, "c2", PATCH.replace("hello", "goodbye"))
    assert first["arguments_digest"] != second["arguments_digest"]
    assert first["tool_definition_digest"] == second["tool_definition_digest"]
    # an answer binding the first call's digest cannot answer the second
    with pytest.raises(ApprovalInputError) as error:
        _prepare(engine, _body(second, _answer(second, arguments_digest=first["arguments_digest"])))
    assert error.value.param.endswith("arguments_digest")


# ------------------------------------------------------------------------------------- accept


def test_accept_releases_exactly_the_recorded_custom_call(engine):
    elicitation = _elicit(engine)
    tampered = {**elicitation, "arguments": "*** Begin Patch\n+rm -rf /\n*** End Patch"}
    follow = _body({"role": "user", "content": "hi"}, tampered, _answer(elicitation))
    prepared = _prepare(engine, follow)
    [released] = prepared.direct_output
    assert {k: released[k] for k in ("type", "call_id", "name", "input", "status")} == {
        "type": "custom_tool_call", "call_id": "c1", "name": CUSTOM, "input": PATCH,
        "status": "completed"}
    assert released["id"].startswith("ctc_") and "arguments" not in released
    # streamed: the same item, as the direct answer's events
    events = direct_events(direct_response(follow, prepared.direct_output, None))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == [released] and events[-1]["response"]["output"] == [released]
    # a retry (lost reply): the identical item, nothing new recorded
    assert _prepare(engine, follow).direct_output == prepared.direct_output
    # the history kept: the released call and its output follow; nothing is released again
    kept = _body(*follow["input"], released,
                 {"type": "custom_tool_call_output", "call_id": "c1", "output": "applied"})
    again = _prepare(engine, kept)
    assert again.direct_output is None
    assert [item.get("type", "message") for item in again.body["input"]] == \
        ["message", "custom_tool_call", "custom_tool_call_output"]


def test_a_consumed_elicitation_executes_nothing_twice(engine):
    elicitation = _elicit(engine)
    follow = _body(elicitation, _answer(elicitation))
    assert _prepare(engine, follow).direct_output
    # another answer to the consumed elicitation: a 409, nothing released
    with pytest.raises(ApprovalInputError) as error:
        _prepare(engine, _body(elicitation, _answer(elicitation, "decline", rid="er_2")))
    assert error.value.status == 409
    # the same accept kept in a history with the released call: nothing is released
    released = _prepare(engine, follow).direct_output[0]
    replay = _body(elicitation, _answer(elicitation), released)
    assert _prepare(engine, replay).direct_output is None


# ------------------------------------------------------------------------ decline and cancel


@pytest.mark.parametrize("action", ["decline", "cancel"])
def test_decline_and_cancel_reach_the_model_as_the_custom_calls_output(engine, action):
    elicitation = _elicit(engine)
    fields = {"reason": "not this patch"} if action == "decline" else {}
    follow = _body({"role": "user", "content": "hi"}, elicitation,
                   _answer(elicitation, action, **fields))
    prepared = _prepare(engine, follow)
    assert prepared.direct_output is None
    _, call, output = prepared.body["input"]
    assert call == {"type": "custom_tool_call", "call_id": "c1", "name": CUSTOM, "input": PATCH,
                    "status": "completed"}
    assert output["type"] == "custom_tool_call_output" and output["call_id"] == "c1"
    assert "not executed" in output["output"]
    assert ("not this patch" in output["output"]) == (action == "decline")
    assert not any(item.get("type") == "function_call_output" for item in prepared.body["input"])
    prepared.commit()
    assert engine.store.get_elicitation(elicitation["id"]).status == \
        {"decline": "declined", "cancel": "cancelled"}[action]
    # the same answer again (replayed history): the same input to the model, no new store write
    again = _prepare(engine, follow)
    assert again.body["input"] == prepared.body["input"]


# ---------------------------------------------------------------------------------- streamed


def _stream_events(call):
    added = {**call, "input": "", "status": "in_progress"}
    pieces = [call["input"][:10], call["input"][10:]]
    events = [{"type": "response.created", "response": {"output": []}},
              {"type": "response.output_item.added", "output_index": 0, "item": added},
              *({"type": "response.custom_tool_call_input.delta", "output_index": 0,
                 "item_id": call["id"], "delta": piece} for piece in pieces),
              {"type": "response.custom_tool_call_input.done", "output_index": 0,
               "item_id": call["id"], "input": call["input"]},
              {"type": "response.output_item.done", "output_index": 0, "item": call},
              {"type": "response.completed", "response": {"object": "response", "output": [call]}}]
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def test_stream_withholds_the_custom_calls_input_and_sends_its_elicitation(engine):
    stream = ApprovalStream(_approvals(engine))
    out = [event for raw in _stream_events(_call()) for event in stream.feed(raw)]
    assert [event["type"] for event in out] == [
        "response.created", "response.output_item.added", "response.output_item.done",
        "response.completed"]
    assert out[1]["item"]["type"] == "elicitation" and out[1]["item"]["tool_type"] == "custom"
    assert out[1]["item"]["call_id"] == "c1" and out[1]["item"]["arguments"] == PATCH
    assert [event["sequence_number"] for event in out] == [0, 1, 2, 3]
    assert out[-1]["response"]["output"] == [out[2]["item"]]
    assert not any("custom_tool_call" in event["type"] for event in out)
    assert not any(event.get("item", {}).get("type") == "custom_tool_call" for event in out)


def test_stream_passes_an_ungated_custom_call_unchanged(tmp_path):
    engine = open_engine(ApprovalPolicy.from_mapping({"rules": []}), tmp_path / "g.db")
    stream = ApprovalStream(_approvals(engine))
    raw = _stream_events(_call())
    out = [event for event in raw for event in stream.feed(event)]
    assert [e["type"] for e in out] == [e["type"] for e in raw]


def test_stream_answer_after_accept_is_released_without_elicitation_by_a_session_grant(engine):
    elicitation = _elicit(engine)
    assert _prepare(engine, _body(elicitation, _answer(elicitation, scope="session"))).direct_output
    stream = ApprovalStream(_approvals(engine))
    raw = _stream_events(_call("c9"))
    out = [event for event in raw for event in stream.feed(event)]
    assert [e["type"] for e in out] == [e["type"] for e in raw]   # the grant releases it as is


# ------------------------------------------------------------------------------------- grants


@pytest.mark.parametrize("scope", ["session", "always"])
def test_grants_release_the_custom_tool_under_the_function_scope_rules(engine, scope):
    elicitation = _elicit(engine)
    assert _prepare(engine, _body(elicitation, _answer(elicitation, scope=scope))).direct_output
    same = {"object": "response", "output": [_call("c2")]}
    _approvals(engine).apply_to_response(same)
    assert same["output"][0]["type"] == "custom_tool_call"          # released by the grant
    elsewhere = {"object": "response", "output": [_call("c3")]}
    _approvals(engine, session="s2").apply_to_response(elsewhere)
    assert elsewhere["output"][0]["type"] == \
        ("custom_tool_call" if scope == "always" else "elicitation")
    # a changed definition (another grammar) is another tool: asked about again
    other = _body(tool={**CUSTOM_TOOL, "format": {"type": "text"}})
    changed = {"object": "response", "output": [_call("c4")]}
    _approvals(engine, other).apply_to_response(changed)
    assert changed["output"][0]["type"] == "elicitation"


def test_a_once_accept_mints_no_grant(engine):
    elicitation = _elicit(engine)
    assert _prepare(engine, _body(elicitation, _answer(elicitation))).direct_output
    later = {"object": "response", "output": [_call("c2")]}
    _approvals(engine).apply_to_response(later)
    assert later["output"][0]["type"] == "elicitation"


def test_a_grant_bound_to_the_input_releases_only_that_input(tmp_path):
    policy = {"rules": [{"tools": [CUSTOM], "approval": "required", "scopes": ["session"],
                         "bind_arguments": True}]}
    engine = open_engine(ApprovalPolicy.from_mapping(policy), tmp_path / "g.db")
    elicitation = _elicit(engine)
    assert _prepare(engine, _body(elicitation, _answer(elicitation, scope="session"))).direct_output
    same = _elicit(engine, "c2")
    changed = _elicit(engine, "c3", PATCH.replace("hello", "bye"))
    assert same["type"] == "custom_tool_call" and same["input"] == PATCH
    assert changed["type"] == "elicitation"


def test_a_function_call_named_like_the_custom_tool_is_not_its_call(engine):
    """A ``function_call`` item naming the custom tool is not decided (the guard refuses it)."""
    decisions = _approvals(engine).decide([{"type": "function_call", "call_id": "x",
                                            "name": CUSTOM, "arguments": "{}"}])
    assert decisions == {}


# ---------------------------------------------------------------------------------- the store


def test_an_earlier_store_file_gains_the_tool_type_column(tmp_path):
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as conn:   # as schema 2 had it: no tool_type column
        for statement in SCHEMA:
            conn.execute("\n".join(line for line in statement.splitlines()
                                   if "tool_type" not in line))
        conn.execute("PRAGMA user_version = 2")
        assert "tool_type" not in [row[1] for row in
                                   conn.execute("PRAGMA table_info(elicitations)")]
    store = SQLiteGrantStore(db)
    with sqlite3.connect(db) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(elicitations)")]
        assert "tool_type" in columns
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
    store.close()
    engine = open_engine(ApprovalPolicy.from_mapping(POLICY), db)
    assert engine.store.get_elicitation(_elicit(engine)["id"]).tool_type == "custom"


# --------------------------------------------------------------------------------------- Chat


def _chat_turn(choice="auto", mode=None, allowed=None):
    spec = FunctionSpec.custom(CUSTOM, "Apply a patch.", ("lark", GRAMMAR))
    free = resolve_allowlist({"model": "m", "messages": [], "tools": [
        POOL_BY_NAME[FREE].chat_tool()]}, "chat").catalog
    catalog = [spec] if choice == "required" else [spec, *free]
    return TurnAllowlist.build(api="chat", catalog=catalog, choice=choice, mode=mode,
                               allowed=allowed)


def test_chat_decides_a_gated_custom_tool_before_generation(engine):
    body = {"model": "m", "messages": [], "tools": []}
    decided = decide_chat_turn(engine, body, _chat_turn(), principal="alice", session="s1")
    assert decided.blocked == {CUSTOM}
    guard = decided.call_filter(AllowedNames([FREE], [CUSTOM]))
    assert not guard.allows("custom", CUSTOM) and guard.allows("function", FREE)
    assert "needs approval" in guard.refusal_message("custom", CUSTOM, public_name=True)
    assert isinstance(guard, ChatCallFilter)
    with pytest.raises(ApprovalInputError) as error:   # a forced call of only that tool
        decide_chat_turn(engine, body, _chat_turn("required"), principal="alice", session="s1")
    assert error.value.code == CODE_TOOL_NEEDS_APPROVAL


def test_chat_custom_tool_released_by_an_unbound_grant(engine):
    elicitation = _elicit(engine)
    assert _prepare(engine, _body(elicitation, _answer(elicitation, scope="always"))).direct_output
    decided = decide_chat_turn(engine, {"model": "m", "messages": [], "tools": []}, _chat_turn(),
                               principal="alice", session=None)
    assert decided.blocked == frozenset() and CUSTOM in decided.granted


def test_proposed_custom_call_digest_and_decline_kind(engine):
    spec = FunctionSpec.custom(CUSTOM, None, None)
    call = ProposedCall.from_spec(spec, call_id="c1", arguments="raw text")
    assert call.kind == "custom"
    [item] = engine.propose_all([call], principal="alice", session="s1")
    assert item.tool_type == "custom" and item.arguments_digest == input_digest("raw text")
    assert json.loads(json.dumps(item.to_json()))["tool_type"] == "custom"


def test_the_documented_custom_tool_vector_is_what_the_server_computes():
    import re
    import subprocess
    import sys
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "approvals.md").read_text()
    section = re.search(r"\n### Custom tools\n(.*?)(?=\n### )", doc, re.S).group(1)
    digests = dict(re.findall(r"`(input_digest|custom_definition_digest)`: `(sha256:[0-9a-f]{64})`",
                              section))
    text = "*** Begin Patch\n*** Add File: hello.txt\n+hi\n*** End Patch"
    assert input_digest(text) == digests["input_digest"]
    spec = FunctionSpec.custom("apply_patch", "Apply a patch.", ("lark", "start: /[a-z]+/"))
    assert definition_digest(spec) == digests["custom_definition_digest"]
    [command] = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    run = subprocess.run(["sh", "-c", command.replace("| python -c ", f"| {sys.executable} -c ")],
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == digests["input_digest"]
