"""Approvals, black box over HTTP: one real ``vllm serve`` (random weights) with an approval policy
gating ``send_email`` and two API keys, driven with the official ``openai`` SDK (raw JSON: the
elicitation items are not SDK types) and httpx where a request must go without a credential.

Every test asserts what a client can observe (status, error ``code`` / ``param``, output items) and
that no ``send_email`` call leaves the server unapproved: forged and altered answers, replays,
retries, races, another principal or session answering, expiry, unauthenticated answers,
type-confused fields, the other tool-producing endpoints, and gated custom tools; and the plain
flow first: an accept releases exactly the recorded call with no model call, a decline reaches the
model, the digests are RFC 8785's.

Determinism: ``seed`` + ``temperature`` and an ``allowed_tools`` choice in ``required`` mode on the
gated tool make the random model call ``send_email`` on every turn, so every turn that is not an
approved release comes back as an elicitation.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hashlib

import httpx
import openai
import pytest
import rfc8785

from vllm_allowed_tools.approvals.engine import Decline, ProposedCall
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import ToolIdentity

from support.metrics import scrape_metric
from support.servers import start_cli_server, stop_cli_server

pytestmark = pytest.mark.server

GATED, FREE, SHORT = "send_email", "get_weather", "delete_file"   # SHORT: gated, expires in 2 s
CUSTOM = "send_email_raw"                                        # a gated custom tool
KEY_A, KEY_B = "key-a", "key-b"
TOOLS = [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool(),
         POOL_BY_NAME[SHORT].responses_tool()]
CHAT_TOOLS = [POOL_BY_NAME[GATED].chat_tool(), POOL_BY_NAME[FREE].chat_tool()]
USER = {"role": "user", "content": "Send it."}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("approvals-blackbox")
    policy = folder / "approvals.json"
    policy.write_text(json.dumps({"rules": [
        {"tools": [GATED, CUSTOM], "approval": "required", "scopes": ["once", "session"]},
        {"tools": [SHORT], "approval": "required", "scopes": ["once"], "expires_in": 2},
    ]}))
    store = folder / "grants.db"
    # vLLM's --api-key takes several values after one flag; a repeated flag keeps only the last
    running = start_cli_server("random", extra_args=["--api-key", KEY_A, KEY_B],
                               env={"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy),
                                    "VLLM_ALLOWED_TOOLS_GRANT_STORE": str(store)})
    running.grant_store = store
    yield running
    stop_cli_server(running)


def _client(server, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def _body(*history: Any, session: str | None, tool: str = GATED, **fields: Any) -> dict[str, Any]:
    """A Responses request that forces a call to ``tool`` (required allowlist of that tool)."""
    body: dict[str, Any] = {
        "model": "tiny", "input": list(history) or "Send it.", "tools": TOOLS,
        "tool_choice": {"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": tool}]},
        "parallel_tool_calls": False, "max_output_tokens": 60, "temperature": 1.0, "seed": 5}
    if session is not None:
        body["prompt_cache_key"] = session
    body.update(fields)
    return body


#: fields passed as the SDK's own arguments; the rest (seed, store, ...) go in extra_body
_SDK_KEYS = frozenset({"model", "input", "tools", "tool_choice", "parallel_tool_calls",
                       "max_output_tokens", "temperature", "prompt_cache_key", "conversation"})


def _send(server, body: dict[str, Any], key: str = KEY_A) -> tuple[int, dict[str, Any]]:
    """POST /v1/responses through the SDK (unary): (status, JSON body), errors included."""
    assert not body.get("stream"), "use _stream"
    kwargs = {k: v for k, v in body.items() if k in _SDK_KEYS}
    extra = {k: v for k, v in body.items() if k not in _SDK_KEYS}
    try:
        raw = _client(server, key).responses.with_raw_response.create(**kwargs, extra_body=extra)
    except openai.APIStatusError as error:
        return error.status_code, error.response.json()
    return raw.http_response.status_code, raw.http_response.json()


def _stream(server, body: dict[str, Any], key: str = KEY_A) -> tuple[int, list[dict[str, Any]]]:
    """The same, streamed: (status, the decoded events; an error body as a one-item list)."""
    kwargs = {k: v for k, v in body.items() if k in _SDK_KEYS}
    extra = {k: v for k, v in body.items() if k not in _SDK_KEYS | {"stream"}}
    try:
        with _client(server, key).responses.with_streaming_response.create(
                stream=True, **kwargs, extra_body=extra) as response:
            return response.status_code, [json.loads(line[6:]) for line in response.iter_lines()
                                          if line.startswith("data: ")]
    except openai.APIStatusError as error:
        return error.status_code, [error.response.json()]


def _ok(server, body: dict[str, Any], key: str = KEY_A) -> list[dict[str, Any]]:
    status, data = _send(server, body, key)
    assert status == 200, data
    return data["output"]


def _error(status_and_body: tuple[int, dict[str, Any]], status: int, code: str,
           param: str | None = None) -> dict[str, Any]:
    got_status, data = status_and_body
    assert got_status == status, data
    error = data["error"]
    assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def _elicit(server, session: str | None, key: str = KEY_A, tool: str = GATED) -> dict[str, Any]:
    """A fresh elicitation for a forced call to ``tool``."""
    output = _ok(server, _body(session=session, tool=tool), key)
    _assert_nothing_released(output)
    elicitations = [item for item in output if item["type"] == "elicitation"]
    assert len(elicitations) == 1 and elicitations[0]["name"] == tool, output
    return elicitations[0]


def _answer(elicitation: dict[str, Any], action: str = "accept", scope: str | None = "once",
            response_id: str = "er_1", **fields: Any) -> dict[str, Any]:
    answer = {"id": response_id, "type": "elicitation_response",
              "elicitation_id": elicitation["id"], "action": action, **fields}
    if action == "accept":
        answer["scope"] = scope
    return answer


def _released_call(elicitation: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """What an accept of ``elicitation`` must release: exactly its recorded call."""
    return [("function_call", elicitation["call_id"], elicitation["name"],
             elicitation["arguments"])]


def _calls(output: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    return [(item["type"], item.get("call_id"), item.get("name"), item.get("arguments"))
            for item in output if item["type"] in ("function_call", "custom_tool_call")]


def _assert_nothing_released(output: list[dict[str, Any]], *names: str) -> None:
    """No call to a gated tool left the server (the model's own calls come back as elicitations)."""
    names = names or (GATED, SHORT, CUSTOM)
    leaked = [item for item in output if item.get("type") in ("function_call", "custom_tool_call")
              and item.get("name") in names]
    assert not leaked, f"a gated call was released without approval: {leaked}"


def _accept_releases(server, elicitation: dict[str, Any], session: str | None,
                     key: str = KEY_A, tool: str = GATED, **answer: Any) -> list[dict[str, Any]]:
    """Accept ``elicitation``: exactly its recorded call comes back (still answerable proof)."""
    output = _ok(server, _body(USER, elicitation, _answer(elicitation, **answer),
                               session=session, tool=tool), key)
    assert _calls(output) == _released_call(elicitation), output
    return output


def _prompt_tokens(server) -> float:
    return scrape_metric(server.root_url, "vllm:prompt_tokens_total")


def _grants_of(server, elicitation_id: str) -> list[dict[str, Any]]:
    """The grants the operator's CLI lists as minted by ``elicitation_id`` (revoked/expired too)."""
    listed = subprocess.run([sys.executable, "-m", "vllm_allowed_tools.approvals.cli", "--db",
                             str(server.grant_store), "list", "--all", "--json"],
                            capture_output=True, text=True, timeout=60, check=True)
    grants = [json.loads(line) for line in listed.stdout.splitlines() if line.startswith("{")]
    return [grant for grant in grants if grant["origin_elicitation_id"] == elicitation_id]


# ------------------------------------------------------------------------------- the flow


def _rfc8785_digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(rfc8785.dumps(value)).hexdigest()


def test_an_accept_releases_the_recorded_call_without_a_model_call(server):
    elicitation = _elicit(server, "flow-1")
    assert elicitation["elicitation_type"] == "tool_call_approval"
    assert POOL_BY_NAME[GATED].arguments_valid(elicitation["arguments"])
    # a client recomputes both digests with a standard RFC 8785 library (docs/approvals.md)
    tool = TOOLS[0]
    assert elicitation["arguments_digest"] == _rfc8785_digest(json.loads(elicitation["arguments"]))
    assert elicitation["tool_definition_digest"] == _rfc8785_digest(
        {"namespace": None, "name": GATED, "description": tool["description"],
         "parameters": tool["parameters"]})
    before = _prompt_tokens(server)
    _accept_releases(server, elicitation, "flow-1")
    assert _prompt_tokens(server) == before, "no model call was needed"


def test_an_accept_needs_a_turn_that_allows_the_tool(server):
    elicitation = _elicit(server, "flow-2")
    history = [USER, elicitation, _answer(elicitation)]
    # this turn cannot call the tool (tool_choice none): a 400 that says why, nothing consumed
    error = _error(_send(server, {"model": "tiny", "input": history, "tools": TOOLS,
                                  "tool_choice": "none", "prompt_cache_key": "flow-2"}),
                   400, "tool_not_allowed_this_turn", "input[2]")
    assert "tool_choice" in error["message"]
    _accept_releases(server, elicitation, "flow-2")   # resent with a turn that allows it


def test_a_streamed_gated_call_is_an_elicitation(server):
    status, events = _stream(server, _body(session="flow-3", stream=True))
    assert status == 200, events
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in items] == ["elicitation"]
    assert not any(e["type"].startswith("response.function_call_arguments") for e in events)
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(set(numbers))
    assert events[-1]["response"]["output"][0]["type"] == "elicitation"


def test_a_decline_reaches_the_model_and_releases_nothing(server):
    elicitation = _elicit(server, "flow-4")
    before = _prompt_tokens(server)
    output = _ok(server, _body(USER, elicitation, _answer(elicitation, "decline", reason="not today"),
                               session="flow-4"))
    assert _prompt_tokens(server) > before   # the model was asked, with the decline
    assert not any(i["type"] == "function_call" and i["call_id"] == elicitation["call_id"]
                   for i in output)
    _assert_nothing_released(output)


# ------------------------------------------------------------------------------------- keys


def test_both_api_keys_authenticate_and_are_different_principals(server):
    for key in (KEY_A, KEY_B):
        assert _elicit(server, "keys", key)["name"] == GATED
    assert _send(server, _body(session="keys"), key="key-c")[0] == 401


# ------------------------------------------------------------------------------ 1. forged


def test_forged_elicitation_ids_are_unknown_and_release_nothing(server):
    session = "forged-1"
    real = _elicit(server, session)
    made_up = "elicit_" + "0" * 32
    forged_item = {**real, "id": made_up, "call_id": "call_forged",
                   "arguments": json.dumps({"path": "todo", "unit": "c"})}
    for history in (
        [USER, real, _answer({"id": made_up})],                  # a made-up id next to a real echo
        [USER, forged_item, _answer(forged_item)],                # a forged echo, answered
        [USER, _answer({"id": made_up})],                         # a bare answer, nothing echoed
        [USER, forged_item, _answer(forged_item, "decline")],
    ):
        index = next(i for i, item in enumerate(history)
                     if item.get("type") == "elicitation_response")
        error = _error(_send(server, _body(*history, session=session)), 400,
                       "unknown_elicitation", f"input[{index}].elicitation_id")
        assert made_up in error["message"]
    # nothing was consumed or declined: the real elicitation is still answerable, with its own call
    _accept_releases(server, real, session)


def test_an_altered_echo_or_answer_never_changes_what_is_released(server):
    session = "forged-2"
    real = _elicit(server, session)
    other_arguments = json.dumps({"path": "todo", "unit": "c"})
    assert other_arguments != real["arguments"]
    # an answer repeating a binding field with another value answers another call: 400, nothing used
    for key, value in (("call_id", "call_forged"), ("arguments_digest", "sha256:" + "1" * 64),
                       ("tool_definition_digest", "sha256:" + "2" * 64)):
        _error(_send(server, _body(USER, real, _answer(real, **{key: value}), session=session)),
               400, "elicitation_mismatch", f"input[2].{key}")
    # an echo whose call was rewritten: the server releases its own record, never the echo
    altered = {**real, "name": FREE, "arguments": other_arguments, "call_id": "call_forged",
               "arguments_digest": "sha256:" + "1" * 64}
    output = _ok(server, _body(USER, altered, _answer(real), session=session))
    assert _calls(output) == _released_call(real), output
    assert other_arguments not in json.dumps(output) and "call_forged" not in json.dumps(output)


def test_type_confused_or_duplicate_answers_are_a_400_and_consume_nothing(server):
    session = "forged-3"
    real = _elicit(server, session)
    good = _answer(real)
    for answer, param, code in (
        ({**good, "elicitation_id": [real["id"]]}, "input[2].elicitation_id",
         "invalid_elicitation_response"),
        ({**good, "elicitation_id": " " + real["id"]}, "input[2].elicitation_id",
         "unknown_elicitation"),
        ({**good, "elicitation_id": real["id"].upper()}, "input[2].elicitation_id",
         "unknown_elicitation"),
        ({**good, "action": "ACCEPT"}, "input[2].action", "invalid_elicitation_response"),
        ({**good, "action": True}, "input[2].action", "invalid_elicitation_response"),
        ({**good, "scope": "Once"}, "input[2].scope", "invalid_elicitation_response"),
        ({**good, "scope": 1}, "input[2].scope", "invalid_elicitation_response"),
        ({**good, "scope": None}, "input[2].scope", "invalid_elicitation_response"),
        ({**good, "scope": "always"}, "input[2].scope", "invalid_elicitation_response"),
        ({**good, "id": 5}, "input[2].id", "invalid_elicitation_response"),
        ({k: v for k, v in good.items() if k != "id"}, "input[2].id",
         "invalid_elicitation_response"),
    ):
        _error(_send(server, _body(USER, real, answer, session=session)), 400, code, param)
    # two answers to one elicitation in one request (the same, or conflicting): refused whole
    for second in (_answer(real, response_id="er_2"), _answer(real, "decline", response_id="er_2"),
                   good):
        _error(_send(server, _body(USER, real, good, second, session=session)), 400,
               "invalid_elicitation_response", "input[3].elicitation_id")
        _error(_send(server, _body(USER, real, second, good, session=session)), 400,
               "invalid_elicitation_response", "input[3].elicitation_id")
    _accept_releases(server, real, session)


@pytest.mark.parametrize("mistake", ["item-type", "field"])
def test_a_request_refused_with_a_400_leaves_the_elicitation_answerable(server, mistake):
    session = f"refused-{mistake}"
    real = _elicit(server, session)
    if mistake == "item-type":   # a typo in the answer's type: vLLM cannot read the item
        body = _body(USER, real, {**_answer(real), "type": "Elicitation_Response"},
                     session=session)
    else:                        # a field vLLM refuses next to a well-formed echo
        body = _body(USER, real, session=session, max_output_tokens=-1)
    status, data = _send(server, body)
    assert status == 400, data
    _accept_releases(server, real, session)


# ----------------------------------------------------------------------------- 2. replayed


def test_a_replayed_accept_with_the_call_in_history_releases_nothing_again(server):
    session = "replay"
    elicitation = _elicit(server, session)
    answer = _answer(elicitation)
    [released] = _accept_releases(server, elicitation, session)
    output_item = {"type": "function_call_output", "call_id": elicitation["call_id"],
                   "output": "sent"}
    for history in (
        [USER, elicitation, answer, released, output_item],                  # the full transcript
        [USER, elicitation, {**answer, "id": "er_rebuilt"}, released, output_item],
        [USER, elicitation, answer, released],                               # no result yet
    ):
        before = _prompt_tokens(server)
        output = _ok(server, _body(*history, session=session))
        assert _prompt_tokens(server) > before, "the model is asked as usual"
        assert not any(item.get("call_id") == elicitation["call_id"] for item in output), output
        _assert_nothing_released(output)   # its new send_email call is a new question
        assert [item["type"] for item in output] == ["elicitation"], output


# ------------------------------------------------------------------------------ 3. retried


def test_a_retried_accept_gets_the_identical_release_and_one_grant(server):
    session = "retry"
    elicitation = _elicit(server, session)
    history = [USER, elicitation, _answer(elicitation, scope="session")]
    before = _prompt_tokens(server)
    first = _ok(server, _body(*history, session=session))
    assert _calls(first) == _released_call(elicitation)
    # the reply was lost: the same body again, a rebuilt answer (new id), and a streamed retry
    assert _ok(server, _body(*history, session=session)) == first
    rebuilt = [USER, elicitation, _answer(elicitation, scope="session", response_id="er_again")]
    assert _ok(server, _body(*rebuilt, session=session)) == first
    status, events = _stream(server, _body(*history, session=session))
    assert status == 200
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == first
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"] == first
    assert _prompt_tokens(server) == before, "no model call was made for any of them"
    [grant] = _grants_of(server, elicitation["id"])   # one grant, minted by the first answer
    assert grant["scope"] == "session" and grant["origin_response_id"] == "er_1"
    # a different answer to the closed elicitation is refused, not applied
    for other in (_answer(elicitation, "decline", response_id="er_2"),
                  _answer(elicitation, scope="once", response_id="er_3")):
        _error(_send(server, _body(USER, elicitation, other, session=session)), 409,
               "elicitation_consumed", "input[2].elicitation_id")
    assert len(_grants_of(server, elicitation["id"])) == 1


# ------------------------------------------------------------------------------- 4. raced


def _race(server, bodies: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    barrier = threading.Barrier(len(bodies))

    def go(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        barrier.wait(timeout=60)
        return _send(server, body)

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(go, bodies))


def test_racing_identical_accepts_all_get_the_same_release(server):
    session = "race-same"
    elicitation = _elicit(server, session)
    bodies = [_body(USER, elicitation, _answer(elicitation, scope="session", response_id=rid),
                    session=session) for rid in ("er_1", "er_1", "er_2", "er_3")]
    results = _race(server, bodies)
    assert [status for status, _ in results] == [200] * 4, results
    outputs = [data["output"] for _, data in results]
    assert _calls(outputs[0]) == _released_call(elicitation)
    assert all(output == outputs[0] for output in outputs), outputs   # same item id and call id
    assert len(_grants_of(server, elicitation["id"])) == 1


@pytest.mark.parametrize(("other", "answer"), [
    ("decline", dict(action="decline", reason="no")), ("decline", dict(action="decline")),
    ("cancel", dict(action="cancel")), ("other-scope", dict(action="accept", scope="session")),
], ids=["decline", "decline-again", "cancel", "other-scope"])
def test_an_accept_racing_another_answer_one_wins_the_other_is_a_409(server, other, answer):
    """An accept (once) racing a decline, a cancel or an accept with another scope: exactly one
    answer is applied; the other gets 409 elicitation_consumed, then and on every resend."""
    session = f"race-{other}-{len(answer)}"
    elicitation = _elicit(server, session)
    accept = _body(USER, elicitation, _answer(elicitation, response_id="er_a"), session=session)
    rival = _body(USER, elicitation, _answer(elicitation, response_id="er_d", **answer),
                  session=session)
    (accept_status, accepted), (rival_status, rival_out) = _race(server, [accept, rival])
    assert sorted([accept_status, rival_status]) == [200, 409], (accepted, rival_out)
    loser = rival_out if accept_status == 200 else accepted
    assert loser["error"]["code"] == "elicitation_consumed"
    assert loser["error"]["param"] == "input[2].elicitation_id"
    if accept_status == 200:
        assert _calls(accepted["output"]) == _released_call(elicitation)
        winner, loser_body = accept, rival
    elif other == "other-scope":   # the session-scoped accept won: the same call, once
        assert _calls(rival_out["output"]) == _released_call(elicitation)
        winner, loser_body = rival, accept
    else:
        assert not any(item.get("call_id") == elicitation["call_id"]
                       for item in rival_out["output"]), rival_out
        _assert_nothing_released(rival_out["output"])
        winner, loser_body = rival, accept
    # afterwards: the loser's answer is still refused, the winner's stands
    _error(_send(server, loser_body), 409, "elicitation_consumed")
    status, again = _send(server, winner)
    assert status == 200, again
    if winner is accept:
        assert again["output"] == accepted["output"]
    elif other == "other-scope":
        assert again["output"] == rival_out["output"]
    else:
        _assert_nothing_released(again["output"])


# ------------------------------------------------------------------------ 5. cross-principal


def _assert_echo_is_ignored(server, elicitation: dict[str, Any], session: str | None,
                            key: str) -> None:
    """An echo of an elicitation this caller/session cannot answer changes nothing: it is not
    declined, and nothing of it (not even the server's record of the call) reaches the model."""
    status, echoed = _send(server, _body(USER, elicitation, session=session), key)
    assert status == 200, echoed
    _assert_nothing_released(echoed["output"])
    status, plain = _send(server, _body(USER, session=session), key)
    assert status == 200, plain
    assert echoed["usage"]["input_tokens"] == plain["usage"]["input_tokens"], \
        "the echoed elicitation of another caller or session reached the model"


def test_another_principal_cannot_answer_or_see_an_elicitation(server):
    session = "shared-session"
    elicitation = _elicit(server, session, KEY_A)
    made_up = {"id": "elicit_" + "f" * 32}
    unknown = _error(_send(server, _body(USER, _answer(made_up), session=session), KEY_B),
                     400, "unknown_elicitation", "input[1].elicitation_id")
    for answer in (_answer(elicitation), _answer(elicitation, "decline"),
                   _answer(elicitation, "cancel")):
        error = _error(_send(server, _body(USER, answer, session=session), KEY_B), 400,
                       "unknown_elicitation", "input[1].elicitation_id")
        # the same answer as for an id that never existed: whether it exists is not revealed
        assert error["message"].replace(elicitation["id"], "ID") == \
            unknown["message"].replace(made_up["id"], "ID")
    # key-b echoing it without an answer neither declines it nor shows it to key-b's model
    _assert_echo_is_ignored(server, elicitation, session, KEY_B)
    # nothing was consumed: key-a accepts it now, and its session grant is key-a's alone
    _accept_releases(server, elicitation, session, KEY_A, scope="session")
    by_grant = _ok(server, _body(session=session), KEY_A)
    assert [(kind, name) for kind, _, name, _ in _calls(by_grant)] == [("function_call", GATED)]
    other = _ok(server, _body(session=session), KEY_B)
    _assert_nothing_released(other)
    assert [item["type"] for item in other] == ["elicitation"]


# -------------------------------------------------------------------------- 6. cross-session


def test_another_session_cannot_answer_an_elicitation(server):
    elicitation = _elicit(server, "s1")
    answer = _answer(elicitation)
    # echoed in s2 without an answer: nothing released, nothing consumed
    _assert_nothing_released(_ok(server, _body(USER, elicitation, session="s2")))
    for fields in ({"prompt_cache_key": "s2"}, {"conversation": "s1"}, {"conversation": "s2"},
                   {}):
        body = _body(USER, elicitation, answer, session=None, **fields)
        _error(_send(server, body), 400, "unknown_elicitation", "input[2].elicitation_id")
    _accept_releases(server, elicitation, "s1")   # still answerable where it was asked


def test_an_echo_from_another_session_does_not_reach_the_model(server):
    elicitation = _elicit(server, "s1-echo")
    _assert_echo_is_ignored(server, elicitation, "s2-echo", KEY_A)


def test_a_conversation_session_is_bound_like_a_cache_key_session(server):
    output = _ok(server, _body(session=None, conversation="conv-s1"))
    [elicitation] = [item for item in output if item["type"] == "elicitation"]
    body = _body(USER, elicitation, _answer(elicitation), session=None, conversation="conv-s2")
    _error(_send(server, body), 400, "unknown_elicitation", "input[2].elicitation_id")
    output = _ok(server, _body(USER, elicitation, _answer(elicitation), session=None,
                               conversation="conv-s1"))
    assert _calls(output) == _released_call(elicitation)


# ------------------------------------------------------------------------------- 7. expired


def test_an_expired_elicitation_releases_nothing_and_the_model_is_told(server):
    session = "expiry"
    elicitation = _elicit(server, session, tool=SHORT)
    assert elicitation["requested_scopes"] == ["once"]
    time.sleep(max(0.0, elicitation["expires_at"] - time.time()) + 1.0)
    answer = _answer(elicitation, response_id="er_late")
    status, data = _send(server, _body(USER, elicitation, answer, session=session, tool=SHORT))
    assert status == 200, data
    assert not any(item.get("call_id") == elicitation["call_id"] for item in data["output"])
    _assert_nothing_released(data["output"])
    # the model saw the proposed call and the "expired" decline as its result: the same prompt as
    # that transcript written out (token for token)
    told = Decline.of(None, "expired", call=ProposedCall(
        call_id=elicitation["call_id"], identity=ToolIdentity(None, SHORT),
        arguments=elicitation["arguments"], definition_digest="")).tool_output
    assert "expired" in told
    written = [USER, {"type": "function_call", "call_id": elicitation["call_id"], "name": SHORT,
                      "arguments": elicitation["arguments"], "status": "completed"},
               {"type": "function_call_output", "call_id": elicitation["call_id"],
                "output": told}]
    status, explicit = _send(server, _body(*written, session="expiry-written", tool=SHORT))
    assert status == 200, explicit
    assert data["usage"]["input_tokens"] == explicit["usage"]["input_tokens"]
    # the record is closed: the same response again is a no-op, any other answer a 409
    output = _ok(server, _body(USER, elicitation, answer, session=session, tool=SHORT))
    assert not any(item.get("call_id") == elicitation["call_id"] for item in output)
    _assert_nothing_released(output)
    error = _error(_send(server, _body(USER, elicitation, _answer(elicitation, response_id="er_new"),
                                       session=session, tool=SHORT)),
                   409, "elicitation_consumed", "input[2].elicitation_id")
    assert "expired" in error["message"]


# ------------------------------------------------------------------------- 8. unauthenticated


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_unauthenticated_answers_are_401_and_consume_nothing(server, stream):
    session = f"unauthenticated-{stream}"
    elicitation = _elicit(server, session)
    for answer in (_answer(elicitation), _answer(elicitation, "decline")):
        body = _body(USER, elicitation, answer, session=session, stream=stream)
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY_A}"},
                        {"Authorization": "Bearer"}, {"Authorization": f"Bearer {KEY_A}x"}):
            response = httpx.post(server.base_url + "/responses", json=body, headers=headers,
                                  timeout=60)
            assert response.status_code == 401, (headers, response.text)
            assert "function_call" not in response.text
        # the SDK with a wrong key: the same
        status, data = (_stream if stream else _send)(server, body, key="key-c")
        assert status == 401, data
    # nothing was consumed (not even by a decline): key-a accepts it now
    _accept_releases(server, elicitation, session)


# ------------------------------------------------------------------------ 9. type confusion


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("field", "value"), [
    ("parallel_tool_calls", "true"), ("parallel_tool_calls", 1), ("parallel_tool_calls", "yes"),
    ("parallel_tool_calls", "false"), ("parallel_tool_calls", 0),
])
def test_type_confused_fields_still_ask_for_approval(server, field, value, stream):
    body = _body(session=f"typed-{value!r}-{stream}", **{field: value})
    if stream:
        status, events = _stream(server, body)
        assert status == 200, events
        items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert not any(e["type"].startswith("response.function_call_arguments") for e in events)
        assert events[-1]["type"] == "response.completed", events[-1]
        final = events[-1]["response"]["output"]
        _assert_nothing_released(final)
    else:
        items = _ok(server, body)
    _assert_nothing_released(items)
    assert items and all(item["type"] == "elicitation" and item["name"] == GATED
                         for item in items), items


@pytest.mark.parametrize("value", ["true", 1])
def test_a_type_confused_stream_flag_still_asks_for_approval(server, value):
    """``stream: "true"`` is served as a stream by vLLM: the plugin must read it the same way."""
    body = _body(session=f"typed-stream-{value!r}", stream=value)
    response = httpx.post(server.base_url + "/responses", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY_A}"})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ")]
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    _assert_nothing_released(items)
    _assert_nothing_released(events[-1]["response"]["output"])
    assert [item["type"] for item in items] == ["elicitation"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("field", "value"), [
    ("parallel_tool_calls", "maybe"), ("parallel_tool_calls", [True]), ("tools", {}),
    ("tools", {"type": "function", "name": GATED}), ("prompt_cache_key", 7),
])
def test_unreadable_fields_are_a_400_naming_them(server, field, value, stream):
    body = _body(session="typed-bad", **{field: value})
    if stream:
        status, events = _stream(server, body)
        error = {"error": events[0].get("error")}
        assert status == 400, events
        _error((status, error), 400, error["error"]["code"])
    else:
        status, error = _send(server, body)
        assert status == 400, error
    assert error["error"]["param"] == field, error


# ------------------------------------------------------------------------- 10. other routes


_ANTHROPIC_TOOL = {"name": GATED, "description": "Send a email.",
                   "input_schema": POOL_BY_NAME[GATED].parameters}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"model": "tiny", "max_tokens": 60, "messages": [
        {"role": "user", "content": "Send it."}], "tools": [_ANTHROPIC_TOOL],
        "tool_choice": {"type": "tool", "name": GATED}}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 60, "stream": True, "messages": [
        {"role": "user", "content": "Send it."}], "tools": [_ANTHROPIC_TOOL]}),
    ("/v1/messages/render", {"model": "tiny", "max_tokens": 60, "messages": [
        {"role": "user", "content": "Send it."}], "tools": [_ANTHROPIC_TOOL]}),
    ("/invocations", {"model": "tiny", "max_tokens": 60, "messages": [
        {"role": "user", "content": "Send it."}], "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": GATED}}}),
    ("/invocations", {"model": "tiny", "input": "Send it.", "tools": TOOLS,
                      "tool_choice": "required"}),
    ("/v1/chat/completions/batch", {"model": "tiny", "max_tokens": 60, "messages": [
        [{"role": "user", "content": "Send it."}]], "tools": CHAT_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": GATED}}}),
], ids=["messages", "messages-stream", "messages-render", "invocations-chat",
        "invocations-responses", "chat-batch"])
def test_other_tool_producing_endpoints_refuse_tools(server, path, body):
    keys = [KEY_A, None] if path == "/invocations" else [KEY_A]   # vLLM leaves it unauthenticated
    for key in keys:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(server.root_url + path, json=body, headers=headers, timeout=120)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unguarded_endpoint" and path in error["message"], error
        assert GATED not in response.text.replace(error["message"], "")


def test_stored_responses_are_not_served(server):
    status, data = _send(server, _body(session="stored", store=True))
    assert status == 200, data
    _assert_nothing_released(data["output"])
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for method, path in (("GET", f"/responses/{data['id']}"), ("GET", "/responses/resp_123"),
                         ("POST", f"/responses/{data['id']}/cancel")):
        response = httpx.request(method, server.base_url + path, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "unguarded_endpoint"
    with pytest.raises(openai.BadRequestError) as refused:
        _client(server).responses.retrieve(data["id"])
    assert refused.value.status_code == 400


# -------------------------------------------------------------- 10b. Chat Completions
# Chat cannot carry an elicitation: decided before generation (docs/approvals.md, "Chat Completions")


def _chat(server, stream: bool, key: str = KEY_A, **fields: Any) -> tuple[int, Any]:
    """POST /v1/chat/completions: (status, the JSON body, or the decoded chunks of a 200 stream)."""
    body = {"model": "tiny", "messages": [USER], "tools": CHAT_TOOLS, "parallel_tool_calls": False,
            "max_tokens": 60, "temperature": 1.0, "seed": 5, "stream": stream, **fields}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
    if not stream or response.status_code != 200:
        return response.status_code, response.json()
    return 200, [json.loads(line[6:]) for line in response.text.splitlines()
                 if line.startswith("data: ") and line != "data: [DONE]"]


def _chat_calls(stream: bool, data: Any) -> list[str]:
    """The names of the calls a 200 answer carries; no error in it."""
    if not stream:
        return [call["function"]["name"] for choice in data["choices"]
                for call in choice["message"].get("tool_calls") or ()]
    assert not [chunk for chunk in data if "error" in chunk], data
    return [call["function"]["name"] for chunk in data for choice in chunk.get("choices", ())
            for call in choice.get("delta", {}).get("tool_calls") or ()
            if call.get("function", {}).get("name")]


def _prompt_tokens_of(stream: bool, data: Any) -> int:
    usage = data["usage"] if not stream else [c for c in data if c.get("usage")][-1]["usage"]
    return usage["prompt_tokens"]


_NAMED_GATED = {"type": "function", "function": {"name": GATED}}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("tool_choice", "tools", "param"), [
    (_NAMED_GATED, CHAT_TOOLS, "tool_choice.function.name"),
    ("required", [POOL_BY_NAME[GATED].chat_tool()], "tool_choice"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": GATED}}]}}, CHAT_TOOLS,
     "tool_choice.allowed_tools.tools"),
], ids=["named", "required", "allowed-tools"])
def test_chat_forcing_a_gated_call_without_a_grant_is_a_400_before_generation(
        server, tool_choice, tools, param, stream):
    before = _prompt_tokens(server)
    status, data = _chat(server, stream, tool_choice=tool_choice, tools=tools,
                         prompt_cache_key="chat-no-grant")
    error = _error((status, data), 400, "tool_needs_approval", param)
    assert GATED in error["message"] and "/v1/responses" in error["message"]
    assert "retry" not in error["message"].lower()
    assert _prompt_tokens(server) == before, "the engine never saw the request"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "allowed_tools", "allowed_tools": {
    "mode": "required", "tools": [{"type": "function", "function": {"name": GATED}},
                                  {"type": "function", "function": {"name": FREE}}]}}],
    ids=["required", "allowed-tools"])
def test_chat_forced_calls_go_to_the_tools_that_need_no_approval(server, tool_choice, stream):
    for seed in (1, 2, 3):
        status, data = _chat(server, stream, tool_choice=tool_choice, seed=seed, max_tokens=150)
        assert status == 200, data
        assert _chat_calls(stream, data) == [FREE], data


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("tool_choice", [None, "auto", {"type": "allowed_tools", "allowed_tools": {
    "mode": "auto", "tools": [{"type": "function", "function": {"name": GATED}}]}}],
    ids=["absent", "auto", "allowed-tools-only-gated"])
def test_chat_auto_never_calls_a_gated_tool(server, tool_choice, stream):
    """Pushed onto the call trigger (the random model then opens a call at once), auto still never
    calls the gated tool: where the free tool is offered, the calls go to it."""
    fields = {} if tool_choice is None else {"tool_choice": tool_choice}
    called = []
    for seed in (1, 2, 3, 4):
        status, data = _chat(server, stream, seed=seed, prompt_cache_key="chat-auto",
                             logit_bias=_trigger_bias(server), **fields)
        assert status == 200, data
        called += _chat_calls(stream, data)
    assert GATED not in called, called
    if not (isinstance(tool_choice, dict) and tool_choice["allowed_tools"]["tools"][0]["function"]["name"]
            == GATED):
        assert called.count(FREE) >= 2, called   # calls were made: the rule was tested, not idle
    else:   # the one tool allowed needs approval: pushed onto the trigger, still no call at all
        assert called == [], called


def _trigger_bias(server) -> dict[str, int]:
    """``logit_bias`` favouring the hermes call trigger ``<tool_call>`` (one token of the tiny
    model's vocabulary, read from the server's own /tokenize)."""
    response = httpx.post(server.root_url + "/tokenize", timeout=60,
                          json={"model": "tiny", "prompt": "<tool_call>", "add_special_tokens": False},
                          headers={"Authorization": f"Bearer {KEY_A}"})
    tokens = response.json()["tokens"]
    assert len(tokens) == 1, tokens
    return {str(tokens[0]): 100}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_chat_releases_a_gated_call_under_a_live_session_grant(server, stream):
    session = f"chat-grant-{stream}"
    _accept_releases(server, _elicit(server, session), session, scope="session")
    auto_tokens = {}
    for granted_session in (session, "chat-other"):
        status, data = _chat(server, stream, tool_choice="auto", prompt_cache_key=granted_session)
        assert status == 200, data
        auto_tokens[granted_session] = _prompt_tokens_of(stream, data)
    # with the grant the tool is admitted, without it removed: the prompt is the same
    assert auto_tokens[session] == auto_tokens["chat-other"]
    status, data = _chat(server, stream, tool_choice=_NAMED_GATED, prompt_cache_key=session,
                         max_tokens=150)
    assert status == 200, data
    assert _chat_calls(stream, data) == [GATED]
    # another session or another API key holds no grant: refused before generation
    _error(_chat(server, stream, tool_choice=_NAMED_GATED, prompt_cache_key="chat-other"), 400,
           "tool_needs_approval")
    _error(_chat(server, stream, key=KEY_B, tool_choice=_NAMED_GATED, prompt_cache_key=session),
           400, "tool_needs_approval")


def test_render_never_answers_an_elicitation(server):
    session = "render"
    elicitation = _elicit(server, session)
    for answer in (_answer(elicitation), _answer(elicitation, "decline")):
        for history in ([USER, elicitation, answer], [USER, answer]):
            index = history.index(answer) if elicitation not in history else 1
            body = _body(*history, session=session)
            response = httpx.post(server.base_url + "/responses/render", json=body, timeout=60,
                                  headers={"Authorization": f"Bearer {KEY_A}"})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == f"input[{index}]"
    _accept_releases(server, elicitation, session)   # nothing was consumed or declined


# ------------------------------------------------------------------------ 11. custom tools


_CUSTOM_TOOL = {"type": "custom", "name": CUSTOM, "description": "Send a raw email."}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("tools", "tool_choice"), [
    ([_CUSTOM_TOOL, POOL_BY_NAME[FREE].responses_tool()], {"type": "custom", "name": CUSTOM}),
    ([_CUSTOM_TOOL], "required"),
    ([_CUSTOM_TOOL, POOL_BY_NAME[FREE].responses_tool()], "auto"),
    ([{"type": "namespace", "name": "mail", "description": "Mail.", "tools": [_CUSTOM_TOOL]}],
     "required"),
], ids=["named", "required", "auto", "namespaced"])
def test_a_gated_custom_tool_is_never_called_without_approval(server, tools, tool_choice, stream):
    body = {"model": "tiny", "input": "Send it.", "tools": tools, "tool_choice": tool_choice,
            "max_output_tokens": 60, "temperature": 1.0, "seed": 5, "prompt_cache_key": "custom"}
    if stream:
        status, events = _stream(server, body)
        if status == 200:
            items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
            assert not any(e["type"].startswith("response.custom_tool_call_input")
                           for e in events)
            output = items + events[-1]["response"]["output"]
        else:
            output, error = [], events[0]["error"]
    else:
        status, data = _send(server, body)
        output, error = (data["output"], None) if status == 200 else ([], data["error"])
    assert not [item for item in output if item.get("type") == "custom_tool_call"], output
    _assert_nothing_released(output)
    if status == 200:   # offered: then only ever as a question (a free-text input the token
        # limit cuts is no call: nothing to ask about; a completed call is asked about, see below)
        assert all(item["name"] == CUSTOM for item in output if item["type"] == "elicitation")
    else:               # refused up front (ours names the tool)
        assert 400 <= status < 500, error
        if error.get("code") == "custom_tool_needs_approval":
            assert error["param"].startswith("tools[0]"), error


#: a grammar that fixes the input: a forced call's input is this text exactly
_FIXED_INPUT = "send it now"
_GRAMMAR_CUSTOM_TOOL = {"type": "custom", "name": CUSTOM, "description": "Send a raw email.",
                        "format": {"type": "grammar", "syntax": "lark",
                                   "definition": f'start: "{_FIXED_INPUT}"'}}


def _custom_body(*history: Any, session: str, **fields: Any) -> dict[str, Any]:
    """A Responses request forcing a call of the gated custom tool (required allowlist of it)."""
    forced = {"tools": [_GRAMMAR_CUSTOM_TOOL, POOL_BY_NAME[FREE].responses_tool()],
              "tool_choice": {"type": "allowed_tools", "mode": "required",
                              "tools": [{"type": "custom", "name": CUSTOM}]}}
    return _body(*history, session=session, **{**forced, **fields})


def _custom_elicitation(output: list[dict[str, Any]]) -> dict[str, Any]:
    _assert_nothing_released(output)
    [elicitation] = [item for item in output if item["type"] == "elicitation"]
    assert elicitation["name"] == CUSTOM and elicitation["tool_type"] == "custom", elicitation
    assert elicitation["arguments"] == _FIXED_INPUT
    assert elicitation["arguments_digest"] == _rfc8785_digest(_FIXED_INPUT)   # the JSON string's
    return elicitation


def test_a_gated_custom_tool_elicits_accept_releases_it_and_decline_reaches_the_model(server):
    session = "custom-approval"
    # unary: the held custom_tool_call becomes its elicitation; an accept releases exactly it
    elicitation = _custom_elicitation(_ok(server, _custom_body(session=session)))
    before = _prompt_tokens(server)
    output = _ok(server, _custom_body(USER, elicitation, _answer(elicitation), session=session))
    assert _prompt_tokens(server) == before   # released without a model call
    assert [(i["type"], i["call_id"], i["name"], i["input"]) for i in output] == [
        ("custom_tool_call", elicitation["call_id"], CUSTOM, _FIXED_INPUT)], output
    # streamed: the input's events are withheld, the elicitation is sent instead
    status, events = _stream(server, {**_custom_body(session=session), "stream": True})
    assert status == 200, events
    assert not any(e["type"].startswith("response.custom_tool_call_input") for e in events)
    streamed = _custom_elicitation([e["item"] for e in events
                                    if e["type"] == "response.output_item.done"])
    assert events[-1]["response"]["output"] == [streamed]
    # an accept streamed back: the recorded call, as the direct answer's events
    status, events = _stream(server, {**_custom_body(USER, streamed, _answer(streamed),
                                                     session=session), "stream": True})
    assert status == 200, events
    assert [(i["type"], i["call_id"], i["input"]) for i in events[-1]["response"]["output"]] == [
        ("custom_tool_call", streamed["call_id"], _FIXED_INPUT)]
    # a decline: the model is asked again, seeing the call and its custom_tool_call_output
    declined = _custom_elicitation(_ok(server, _custom_body(session=session)))
    before = _prompt_tokens(server)
    output = _ok(server, _custom_body(USER, declined, _answer(declined, "decline", reason="no"),
                                      session=session))
    assert _prompt_tokens(server) > before
    assert not any(i.get("call_id") == declined["call_id"] and i["type"] == "custom_tool_call"
                   for i in output)
    _assert_nothing_released(output)
