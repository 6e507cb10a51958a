"""Approvals end to end on the real server (official SDK sending the new items as raw JSON): a gated
call comes back as an `elicitation`, unary and streaming; `accept` releases exactly that call
without a model call; `decline` reaches the model as the call's result; Chat refuses it before generation."""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import rfc8785
from conftest import start_cli_server, stop_cli_server

from vllm_allowed_tools.testing.metrics import scrape_metric
from vllm_allowed_tools.testing.tool_pool import POOL_BY_NAME

pytestmark = pytest.mark.server

GATED, FREE = "send_email", "get_weather"
TOOLS = [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]


@pytest.fixture(scope="module")
def approvals_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("approvals")
    policy = folder / "approvals.json"
    policy.write_text(json.dumps({"rules": [{"tools": [GATED], "approval": "required",
                                             "scopes": ["once", "session"]}]}))
    server = start_cli_server("random", env={"VLLM_ALLOWED_TOOLS_APPROVAL_POLICY": str(policy)})
    yield server
    stop_cli_server(server)


def _ask(client, *history, stream=False, conversation="conv-1"):
    kwargs = dict(model="tiny", input=list(history) or "Send it.", tools=TOOLS,
                  tool_choice={"type": "allowed_tools", "mode": "required",
                               "tools": [{"type": "function", "name": GATED}]},
                  parallel_tool_calls=False, max_output_tokens=60, temperature=1.0,
                  extra_body={"seed": 5, "prompt_cache_key": conversation})
    if not stream:   # the raw JSON: elicitation items are not (yet) SDK types
        return client.responses.with_raw_response.create(**kwargs).http_response.json()["output"]
    with client.responses.with_streaming_response.create(stream=True, **kwargs) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]


def _prompt_tokens(server) -> float:
    return scrape_metric(server.root_url, "vllm:prompt_tokens_total")


def _rfc8785_digest(value) -> str:
    return "sha256:" + hashlib.sha256(rfc8785.dumps(value)).hexdigest()


def test_gated_call_is_an_elicitation_and_accept_releases_it(approvals_server):
    client = approvals_server.client()
    output = _ask(client)
    [elicitation] = [item for item in output if item["type"] == "elicitation"]
    assert not [item for item in output if item["type"] == "function_call"]
    assert elicitation["elicitation_type"] == "tool_call_approval" and elicitation["name"] == GATED
    assert POOL_BY_NAME[GATED].arguments_valid(elicitation["arguments"])
    # a client recomputes both digests with a standard RFC 8785 library (docs/approvals.md)
    tool = TOOLS[0]
    assert elicitation["arguments_digest"] == _rfc8785_digest(json.loads(elicitation["arguments"]))
    assert elicitation["tool_definition_digest"] == _rfc8785_digest(
        {"namespace": None, "name": GATED, "description": tool["description"],
         "parameters": tool["parameters"]})
    before = _prompt_tokens(approvals_server)
    answer = {"id": "er_1", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "accept", "scope": "once"}
    released = _ask(client, {"role": "user", "content": "Send it."}, elicitation, answer)
    assert [(i["type"], i["call_id"], i["arguments"]) for i in released] == \
        [("function_call", elicitation["call_id"], elicitation["arguments"])]
    assert _prompt_tokens(approvals_server) == before, "no model call was needed"
    # replaying the consumed elicitation executes nothing new: the model is asked as usual instead
    again = _ask(client, {"role": "user", "content": "Send it."}, elicitation, answer,
                 released[0], {"type": "function_call_output", "call_id": elicitation["call_id"],
                               "output": "sent"})
    assert not any(i["type"] == "function_call" and i["call_id"] == elicitation["call_id"]
                   for i in again)


def test_a_retried_accept_gets_the_same_call_and_needs_a_turn_that_allows_it(approvals_server):
    client = approvals_server.client()
    [elicitation] = [i for i in _ask(client, conversation="conv-4") if i["type"] == "elicitation"]
    answer = {"id": "er_4", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "accept", "scope": "once"}
    history = [{"role": "user", "content": "Send it."}, elicitation, answer]
    # this turn cannot call the tool (tool_choice none): a 400 that says why, nothing consumed
    refused = httpx.post(approvals_server.base_url + "/responses", timeout=60,
                         headers={"Authorization": "Bearer test"},   # the client's credential
                         json={"model": "tiny", "input": history, "tools": TOOLS,
                               "tool_choice": "none", "prompt_cache_key": "conv-4"})
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tool_not_allowed_this_turn" and error["param"] == "input[2]"
    assert "tool_choice" in error["message"]
    # resent with a tool_choice that allows the tool: released, without a model call
    before = _prompt_tokens(approvals_server)
    released = _ask(client, *history, conversation="conv-4")
    assert [(i["type"], i["call_id"], i["arguments"]) for i in released] == \
        [("function_call", elicitation["call_id"], elicitation["arguments"])]
    # the reply was lost: the same answer again gets the same call (same item id), not a decline
    assert _ask(client, *history, conversation="conv-4") == released
    assert _prompt_tokens(approvals_server) == before, "no model call was needed"


def test_streamed_gated_call_is_an_elicitation(approvals_server):
    events = _ask(approvals_server.client(), stream=True, conversation="conv-2")
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in items] == ["elicitation"]
    assert not any(e["type"].startswith("response.function_call_arguments") for e in events)
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(set(numbers))
    assert events[-1]["response"]["output"][0]["type"] == "elicitation"


def test_decline_reaches_the_model(approvals_server):
    client = approvals_server.client()
    [elicitation] = [i for i in _ask(client, conversation="conv-3") if i["type"] == "elicitation"]
    answer = {"id": "er_2", "type": "elicitation_response", "elicitation_id": elicitation["id"],
              "action": "decline", "reason": "not today"}
    before = _prompt_tokens(approvals_server)
    output = _ask(client, {"role": "user", "content": "Send it."}, elicitation, answer,
                  conversation="conv-3")
    assert _prompt_tokens(approvals_server) > before   # the model was asked, with the decline
    assert all(i["type"] in ("elicitation", "message", "function_call") for i in output)
    assert not any(i["type"] == "function_call" and i["call_id"] == elicitation["call_id"]
                   for i in output)


def test_bad_elicitation_response_is_a_400(approvals_server):
    body = {"model": "tiny", "tools": TOOLS, "input": [
        {"id": "er_3", "type": "elicitation_response", "elicitation_id": "elicit_nope",
         "action": "accept"}]}
    response = httpx.post(approvals_server.base_url + "/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("input[0]")


def test_chat_cannot_release_a_gated_call(approvals_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Send it."}],
            "tools": [POOL_BY_NAME[GATED].chat_tool(), POOL_BY_NAME[FREE].chat_tool()],
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                "mode": "required", "tools": [{"type": "function", "function": {"name": GATED}}]}},
            "parallel_tool_calls": False, "max_tokens": 60, "temperature": 1.0, "seed": 5}
    response = httpx.post(approvals_server.base_url + "/chat/completions", json=body, timeout=60)
    # decided before generation: Chat has no item to carry the question (docs/approvals.md)
    assert response.status_code == 400 and response.json()["error"]["code"] == \
        "tool_needs_approval"
