"""Approvals on the wire (pure): what the middleware does to requests, responses and streams."""

from __future__ import annotations

import json

import pytest

from vllm_allowed_tools.approvals import ApprovalInputError, ApprovalPolicy, open_engine
from vllm_allowed_tools.approvals.stream import ApprovalStream
from vllm_allowed_tools.approvals.response_bodies import (
    ResponseApprovals,
    direct_events,
    direct_response,
    prepare_request,
    principal_from_headers,
    session_of,
    strip_approval_hints,
)
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import resolve_allowlist

GATED, FREE = "send_email", "get_weather"
POLICY = {"rules": [{"tools": [GATED], "approval": "required",
                     "scopes": ["once", "session", "always"]}]}


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(POLICY), tmp_path / "grants.db")


def _body(*items, stream=False):
    return {"model": "tiny", "input": list(items) or "hi", "stream": stream,
            "tools": [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]}


def _call(name, call_id="call_1"):
    args = json.dumps(POOL_BY_NAME[name].random_arguments(__import__("random").Random(1)))
    return {"id": "fc_1", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": args, "status": "completed"}


def _approvals(engine, body, session="s1"):
    return ResponseApprovals(engine, body, resolve_allowlist(body, "responses"), principal="alice",
                             session=session)


def test_principal_comes_from_the_credential_not_the_body(engine):
    secret = engine.store.principal_secret
    assert principal_from_headers([], secret) == "anonymous"
    one = principal_from_headers([(b"authorization", b"Bearer secret-1")], secret)
    assert one.startswith("key:") and "secret" not in one
    assert one != principal_from_headers([(b"authorization", b"Bearer secret-2")], secret)
    assert session_of({"conversation": {"id": "c1"}}) == "conversation:c1"
    assert session_of({"prompt_cache_key": "k"}) == "cache_key:k" and session_of({}) is None


def test_gated_call_becomes_an_elicitation_and_free_call_passes(engine):
    body = _body()
    response = {"object": "response", "output": [_call(GATED, "c1"), _call(FREE, "c2")]}
    _approvals(engine, body).apply_to_response(response)
    kinds = [(item["type"], item.get("name")) for item in response["output"]]
    assert kinds == [("elicitation", GATED), ("function_call", FREE)]
    elicitation = response["output"][0]
    assert elicitation["elicitation_type"] == "tool_call_approval" and elicitation["call_id"] == "c1"
    assert elicitation["arguments_digest"].startswith("sha256:")
    assert set(elicitation["requested_scopes"]) == {"once", "session", "always"}


def test_accept_releases_exactly_the_recorded_call_without_the_model(engine):
    body = _body()
    response = {"object": "response", "output": [_call(GATED, "c1")]}
    _approvals(engine, body).apply_to_response(response)
    elicitation = response["output"][0]
    tampered = {**elicitation, "arguments": '{"to": "mallory"}'}   # the client's echo is not trusted
    answer = {"id": "er_1", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "accept", "scope": "once"}
    follow = _body({"role": "user", "content": "hi"}, tampered, answer)
    prepared = prepare_request(engine, follow, principal="alice", session="s1",
                               catalog=resolve_allowlist(follow, "responses"))
    assert prepared.direct_output is not None
    [released] = prepared.direct_output
    assert released["call_id"] == "c1" and released["arguments"] == elicitation["arguments"]
    # the same follow-up again without the released call (a lost reply, a retry): the same call,
    # identical item
    retried = prepare_request(engine, follow, principal="alice", session="s1",
                              catalog=resolve_allowlist(follow, "responses"))
    assert retried.direct_output == prepared.direct_output
    # the history kept (the released call and its output follow): nothing is released again
    kept = _body(*follow["input"], released,
                 {"type": "function_call_output", "call_id": "c1", "output": "sent"})
    again = prepare_request(engine, kept, principal="alice", session="s1",
                            catalog=resolve_allowlist(kept, "responses"))
    assert again.direct_output is None
    assert all(item.get("type") not in ("elicitation", "elicitation_response")
               for item in again.body["input"])
    assert [item.get("type", "message") for item in again.body["input"]] == \
        ["message", "function_call", "function_call_output"]


def test_decline_reaches_the_model_as_the_calls_result(engine):
    body = _body()
    response = {"object": "response", "output": [_call(GATED, "c1")]}
    _approvals(engine, body).apply_to_response(response)
    elicitation = response["output"][0]
    answer = {"id": "er_1", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "decline", "reason": "not now"}
    follow = _body({"role": "user", "content": "hi"}, elicitation, answer)
    prepared = prepare_request(engine, follow, principal="alice", session="s1",
                               catalog=resolve_allowlist(follow, "responses"))
    assert prepared.direct_output is None
    kinds = [item.get("type", "message") for item in prepared.body["input"]]
    assert kinds == ["message", "function_call", "function_call_output"]
    assert "not now" in prepared.body["input"][2]["output"]


def _accepted_follow_up(engine, scope: str) -> dict:
    """Alice's next request after the server asked about a gated call and she accepted it."""
    response = {"object": "response", "output": [_call(GATED, "c1")]}
    _approvals(engine, _body()).apply_to_response(response)
    return _body({"id": "er_1", "type": "elicitation_response",
                  "elicitation_id": response["output"][0]["id"], "action": "accept",
                  "scope": scope})


def test_another_principal_cannot_answer(engine):
    follow = _accepted_follow_up(engine, "once")
    with pytest.raises(ApprovalInputError):
        prepare_request(engine, follow, principal="mallory", session="s1",
                        catalog=resolve_allowlist(follow, "responses"))


def test_session_grant_releases_later_calls_in_that_session_only(engine):
    follow = _accepted_follow_up(engine, "session")
    assert prepare_request(engine, follow, principal="alice", session="s1",
                           catalog=resolve_allowlist(follow, "responses")).direct_output
    later = {"object": "response", "output": [_call(GATED, "c2")]}
    _approvals(engine, _body()).apply_to_response(later)
    assert later["output"][0]["type"] == "function_call"        # the live session grant
    elsewhere = {"object": "response", "output": [_call(GATED, "c3")]}
    _approvals(engine, _body(), session="s2").apply_to_response(elsewhere)
    assert elsewhere["output"][0]["type"] == "elicitation"      # another session asks again


def test_unknown_elicitation_type_is_a_400_naming_the_field(engine):
    follow = _body({"id": "e1", "type": "elicitation", "elicitation_type": "telepathy",
                    "message": "?"})
    with pytest.raises(ApprovalInputError) as error:
        prepare_request(engine, follow, principal="alice", session="s1",
                        catalog=resolve_allowlist(follow, "responses"))
    assert error.value.status == 400 and error.value.param.startswith("input[0]")


def _stream_events(call):
    added = {**call, "arguments": "", "status": "in_progress"}
    events = [{"type": "response.created", "response": {"output": []}},
              {"type": "response.output_item.added", "output_index": 0, "item": added},
              {"type": "response.function_call_arguments.delta", "output_index": 0,
               "delta": call["arguments"]},
              {"type": "response.function_call_arguments.done", "output_index": 0,
               "arguments": call["arguments"]},
              {"type": "response.output_item.done", "output_index": 0, "item": call},
              {"type": "response.completed", "response": {"object": "response", "output": [call]}}]
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def test_stream_turns_a_gated_call_into_elicitation_events(engine):
    stream = ApprovalStream(_approvals(engine, _body()))
    out = [event for raw in _stream_events(_call(GATED, "c1")) for event in stream.feed(raw)]
    types = [event["type"] for event in out]
    assert types == ["response.created", "response.output_item.added", "response.output_item.done",
                     "response.completed"]
    assert out[1]["item"]["type"] == "elicitation" and out[1]["output_index"] == 0
    assert [event["sequence_number"] for event in out] == [0, 1, 2, 3]
    assert out[-1]["response"]["output"][0]["type"] == "elicitation"
    assert not any(event.get("delta") for event in out)   # no argument delta of the held call


def test_stream_passes_a_free_call_unchanged(engine):
    stream = ApprovalStream(_approvals(engine, _body()))
    raw = _stream_events(_call(FREE, "c1"))
    out = [event for event in raw for event in stream.feed(event)]
    assert [e["type"] for e in out] == [e["type"] for e in raw]
    assert out[-1]["response"]["output"][0]["type"] == "function_call"


def test_approval_hints_are_stripped_for_vllm_and_direct_responses_validate():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    body = _body()
    body["tools"][1] = {**body["tools"][1], "approval": {"required": True}}
    stripped = strip_approval_hints(body)
    assert "approval" not in stripped["tools"][1] and "approval" in body["tools"][1]
    response = direct_response(body, [_call(FREE)], "auto")
    Response.model_validate(response)
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in direct_events(response):
        adapter.validate_python(event)


# --------------------------------------------------------------------------------------------------
# answering an elicitation: idempotent accepts, and only what this turn could call


def _prepare(engine, body, principal="alice", session="s1"):
    return prepare_request(engine, body, principal=principal, session=session,
                           catalog=resolve_allowlist(body, "responses"))


def test_a_retried_accept_returns_identical_items_and_mints_no_second_grant(engine):
    follow = _accepted_follow_up(engine, "session")
    first = _prepare(engine, follow).direct_output
    [call] = first
    assert call["id"].startswith("fc_") and call["type"] == "function_call"
    # an SDK retry (the identical body), and a rebuilt answer under a new response id
    rebuilt = _body({**follow["input"][0], "id": "er_2"})
    for body in (follow, follow, rebuilt):
        assert _prepare(engine, body).direct_output == first   # same item id, call_id, arguments
    assert len(engine.store.list_grants(include_inactive=True, now=0)) == 1
    # with the released call in the history: a no-op, the model is asked as usual
    kept = _body(*follow["input"], call, {"type": "function_call_output",
                                          "call_id": call["call_id"], "output": "sent"})
    assert _prepare(engine, kept).direct_output is None
    # a different answer to the accepted elicitation: 409
    answer = {k: v for k, v in follow["input"][0].items() if k != "scope"}
    for other in ({"action": "decline", "id": "er_3"}, {"action": "accept", "scope": "always"},
                  {"action": "accept", "scope": "once", "id": "er_1"}):
        changed = _body({**answer, **other})
        with pytest.raises(ApprovalInputError) as error:
            _prepare(engine, changed)
        assert error.value.status == 409 and error.value.code == "elicitation_consumed"


def test_two_threads_racing_the_same_accept_get_the_same_release(engine):
    import threading
    follow = _accepted_follow_up(engine, "session")
    barrier, results = threading.Barrier(2), []

    def worker():
        barrier.wait()
        results.append(_prepare(engine, follow).direct_output)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 2 and results[0] == results[1] and len(results[0]) == 1
    assert len(engine.store.list_grants(include_inactive=True, now=0)) == 1


def test_a_race_lost_to_another_answer_is_a_409(engine):
    follow = _accepted_follow_up(engine, "once")
    answer = follow["input"][0]
    consume = engine.store.consume

    def accept_wins_first(elicitation_id, **kw):   # the accept lands between check and consume
        engine.store.consume = consume
        assert _prepare(engine, follow).direct_output
        return consume(elicitation_id, **kw)

    engine.store.consume = accept_wins_first
    declined = _body({**{k: v for k, v in answer.items() if k != "scope"}, "id": "er_9",
                      "action": "decline"})
    prepared = _prepare(engine, declined)   # checked; applied once vLLM accepts the request
    with pytest.raises(ApprovalInputError) as error:
        prepared.commit()
    assert error.value.status == 409 and error.value.param == "input[0].elicitation_id"


NOT_THIS_TURN = {
    "tool_choice none": {"tool_choice": "none"},
    "allowlist without the tool": {"tool_choice": {
        "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": FREE}]}},
    "named choice of another tool": {"tool_choice": {"type": "function", "name": FREE}},
    "no tools": {"tools": None},
}


@pytest.mark.parametrize("change", NOT_THIS_TURN.values(), ids=NOT_THIS_TURN.keys())
def test_an_accept_this_turn_cannot_make_is_a_400_and_stays_answerable(engine, change):
    follow = _accepted_follow_up(engine, "session")
    elicitation_id = follow["input"][0]["elicitation_id"]
    question = {k: v for k, v in {**follow, **change}.items() if v is not None}
    with pytest.raises(ApprovalInputError) as error:
        _prepare(engine, question)
    assert error.value.status == 400 and error.value.code == "tool_not_allowed_this_turn"
    assert error.value.param == "input[0]"
    assert GATED in error.value.message and "tool_choice" in error.value.message
    assert engine.store.get_elicitation(elicitation_id).status == "pending"
    assert engine.store.list_grants(include_inactive=True, now=0) == []
    # resent with a tool_choice that allows the tool: released
    allowing = {**follow, "tool_choice": {"type": "allowed_tools", "mode": "required",
                                          "tools": [{"type": "function", "name": GATED}]}}
    [released] = _prepare(engine, allowing).direct_output
    assert released["name"] == GATED
    # a retry of that accept is held to its own turn too (and is not declined by it)
    with pytest.raises(ApprovalInputError) as error:
        _prepare(engine, question)
    assert error.value.code == "tool_not_allowed_this_turn"
    assert _prepare(engine, follow).direct_output == [released]


def test_a_decline_needs_no_callable_tool(engine):
    follow = _accepted_follow_up(engine, "once")
    answer = {k: v for k, v in follow["input"][0].items() if k != "scope"}
    declined = {**follow, "tool_choice": "none", "input": [{**answer, "action": "decline"}]}
    prepared = _prepare(engine, declined)
    assert prepared.direct_output is None
    assert engine.store.get_elicitation(answer["elicitation_id"]).status == "pending"
    prepared.commit()   # vLLM accepted the request
    assert engine.store.get_elicitation(answer["elicitation_id"]).status == "declined"


def test_an_echoed_accepted_elicitation_is_never_shown_as_declined(engine):
    follow = _accepted_follow_up(engine, "once")
    [released] = _prepare(engine, follow).direct_output
    elicitation = engine.store.get_elicitation(follow["input"][0]["elicitation_id"]).to_item()
    # echoed without its answer and without the released call: nothing of it reaches the model
    echoed = _body({"role": "user", "content": "hi"}, elicitation.to_json())
    prepared = _prepare(engine, echoed)
    assert prepared.direct_output is None
    assert [item.get("type", "message") for item in prepared.body["input"]] == ["message"]
    # with the call's output in the history: the call is shown before it, never a decline
    output = {"type": "function_call_output", "call_id": released["call_id"], "output": "sent"}
    prepared = _prepare(engine, _body(elicitation.to_json(), output))
    assert prepared.body["input"] == [{k: v for k, v in released.items() if k != "id"}, output]
