"""A request that goes to the model changes the grant store only once vLLM accepts it: its declines
and the elicitations it leaves unanswered are written when vLLM's answer starts with a 2xx status,
before any of that answer goes out. A request vLLM refuses (400) leaves every elicitation
answerable; an answer another request changed meanwhile, or a store that is down then, is answered
(409, 503) instead of vLLM's answer. Accepts are applied at once, as before (answered without the
model). No server: ``prepare_request`` and the middleware's ``GuardedSend`` with a fake app.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from support.guard import send_plan

from vllm_allowed_tools.approvals import ApprovalInputError, ApprovalPolicy, GrantStoreUnavailable, \
    open_engine
from vllm_allowed_tools.approvals.response_bodies import ResponseApprovals, prepare_request
from vllm_allowed_tools.asgi.guarded_send import GuardedSend, StopSignal
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import resolve_allowlist

GATED, FREE = "send_email", "get_weather"
POLICY = {"rules": [{"tools": [GATED], "approval": "required", "scopes": ["once", "session"]}]}
USER = {"role": "user", "content": "hi"}


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(POLICY), tmp_path / "grants.db")


def _body(*items: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": list(items),
            "tools": [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]}


def _elicit(engine) -> dict[str, Any]:
    args = json.dumps(POOL_BY_NAME[GATED].random_arguments(random.Random(1)))
    response = {"object": "response", "output": [
        {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": GATED,
         "arguments": args, "status": "completed"}]}
    ResponseApprovals(engine, _body(), resolve_allowlist(_body(), "responses"),
                      principal="alice", session="s1").apply_to_response(response)
    [elicitation] = response["output"]
    return elicitation


def _answer(elicitation: dict[str, Any], action: str, response_id: str = "er_1",
            **fields: Any) -> dict[str, Any]:
    return {"id": response_id, "type": "elicitation_response",
            "elicitation_id": elicitation["id"], "action": action, **fields}


def _prepare(engine, body: dict[str, Any]):
    return prepare_request(engine, body, principal="alice", session="s1",
                           catalog=resolve_allowlist(body, "responses"))


def _status(engine, elicitation: dict[str, Any]) -> str:
    return engine.store.get_elicitation(elicitation["id"]).status


@pytest.mark.parametrize("answer", [None, "decline", "cancel"])
def test_a_forwarded_request_changes_nothing_until_vllm_accepts_it(engine, answer):
    elicitation = _elicit(engine)
    items = [USER, elicitation] + ([_answer(elicitation, answer, reason="no")] if answer else [])
    prepared = _prepare(engine, _body(*items))
    assert prepared.direct_output is None and prepared.commit is not None
    # what the model sees is decided already: the call and its decline
    [call, output] = prepared.body["input"][1:]
    assert call["call_id"] == output["call_id"] == elicitation["call_id"]
    assert _status(engine, elicitation) == "pending"
    prepared.commit()
    assert _status(engine, elicitation) == {None: "unanswered", "decline": "declined",
                                            "cancel": "cancelled"}[answer]


def test_a_request_vllm_refuses_leaves_the_elicitation_answerable(engine):
    elicitation = _elicit(engine)
    # echoed next to an item vLLM cannot read: prepared, never committed (vLLM answered 400)
    typo = {**_answer(elicitation, "accept", scope="once"), "type": "Elicitation_Response"}
    _prepare(engine, _body(USER, elicitation, typo))
    _prepare(engine, _body(USER, elicitation, _answer(elicitation, "decline")))
    assert _status(engine, elicitation) == "pending"
    [released] = _prepare(engine, _body(USER, elicitation,
                                        _answer(elicitation, "accept", scope="once"))).direct_output
    assert released["call_id"] == elicitation["call_id"]


def test_two_forwarded_answers_exactly_one_is_applied(engine):
    elicitation = _elicit(engine)
    decline = _prepare(engine, _body(USER, elicitation, _answer(elicitation, "decline")))
    cancel = _prepare(engine, _body(USER, elicitation, _answer(elicitation, "cancel", "er_2")))
    decline.commit()
    with pytest.raises(ApprovalInputError) as error:
        cancel.commit()
    assert error.value.status == 409 and error.value.code == "elicitation_consumed"
    assert _status(engine, elicitation) == "declined"


def test_an_accept_while_a_decline_waits_for_vllm_wins_and_the_decline_is_a_409(engine):
    elicitation = _elicit(engine)
    decline = _prepare(engine, _body(USER, elicitation, _answer(elicitation, "decline")))
    accept = _body(USER, elicitation, _answer(elicitation, "accept", "er_2", scope="once"))
    first = _prepare(engine, accept).direct_output
    with pytest.raises(ApprovalInputError) as error:
        decline.commit()
    assert error.value.status == 409
    assert _prepare(engine, accept).direct_output == first   # released once, the same again


def test_an_expired_accept_goes_to_the_model_as_expired_and_is_written_on_commit(engine):
    elicitation = _elicit(engine)
    later = elicitation["expires_at"] + 1
    engine.clock = lambda: later
    prepared = _prepare(engine, _body(USER, elicitation,
                                      _answer(elicitation, "accept", scope="once")))
    assert prepared.direct_output is None and _status(engine, elicitation) == "pending"
    assert "expired" in prepared.body["input"][-1]["output"]
    prepared.commit()
    assert _status(engine, elicitation) == "expired"


def test_accepts_are_applied_at_once(engine):
    elicitation = _elicit(engine)
    prepared = _prepare(engine, _body(USER, elicitation,
                                      _answer(elicitation, "accept", scope="session")))
    assert prepared.direct_output and prepared.commit is None
    assert _status(engine, elicitation) == "accepted"


# ------------------------------------------------------------------ GuardedSend runs the commit


def _serve(status: int, commit) -> tuple[list[dict[str, Any]], bool]:
    """A fake app answering ``status`` (a two-part JSON body) through GuardedSend with ``commit``:
    (what the client got, whether the app was told the client left)."""
    stop, sent = StopSignal(), []

    async def client_send(message):
        sent.append(message)

    async def client_receive():
        await asyncio.sleep(3600)

    async def app():
        send = GuardedSend(client_send, send_plan("responses", None, commit=commit), stop, (2, 4))
        receive = stop.receive(b"{}", client_receive)
        await receive()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"a":', "more_body": True})
        await send({"type": "http.response.body", "body": b"1}", "more_body": False})
        return stop.event.is_set() and (await receive())["type"] == "http.disconnect"

    told_to_stop = asyncio.run(app())
    return sent, told_to_stop


def test_the_commit_runs_on_a_2xx_start_before_anything_goes_out():
    calls: list[str] = []
    sent, stopped = _serve(200, lambda: calls.append("commit"))
    assert calls == ["commit"] and not stopped
    assert sent[0]["status"] == 200 and b"".join(m.get("body", b"") for m in sent) == b'{"a":1}'
    calls.clear()
    sent, stopped = _serve(400, lambda: calls.append("commit"))
    assert calls == [] and sent[0]["status"] == 400   # vLLM refused it: nothing written


@pytest.mark.parametrize("error", [
    ApprovalInputError("answered by another response", param="input[2].elicitation_id",
                       code="elicitation_consumed", status=409),
    GrantStoreUnavailable("missing", store="SQLite file")])
def test_a_failed_commit_is_answered_instead_and_the_app_stopped(error):
    def commit():
        raise error

    sent, stopped = _serve(200, commit)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == error.status and stopped
    assert json.loads(sent[1]["body"])["error"]["code"] == error.code
