"""Open Responses conformance on the real server: what ``/v1/responses`` sends validates against the
published schema, unary and streamed, plain, allowed_tools auto / required, cut by
``max_output_tokens``, and a ``function_call_output`` follow-up.

Each answer is validated here, as the client got it; the server's own check mode
(``tests/conftest.py``) validates every Responses answer of the whole session as well.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.response.conformance import TERMINAL_EVENT, check_response, check_stream

from support.calls import responses_selection

pytestmark = pytest.mark.server

CATALOG = POOL[:6]
TOOLS = [tool.responses_tool() for tool in CATALOG]
ALLOWED = [tool.name for tool in CATALOG[:2]]
BASE = {"model": "tiny", "input": "Go ahead.", "temperature": 1.0, "seed": 3,
        "max_output_tokens": 60}
CASES = {
    "plain": BASE,
    "plain_tools": {**BASE, "tools": TOOLS},
    "allowed_auto": {**BASE, "tools": TOOLS, "tool_choice": responses_selection("auto", ALLOWED)},
    "allowed_required": {**BASE, "tools": TOOLS,
                         "tool_choice": responses_selection("required", ALLOWED)},
    "cut": {**BASE, "max_output_tokens": 3},
    "cut_required": {**BASE, "tools": TOOLS, "max_output_tokens": 3,
                     "tool_choice": responses_selection("required", ALLOWED)},
}


def unary(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(server.base_url + "/responses", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def streamed(server: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", server.base_url + "/responses", json={**body, "stream": True},
                      timeout=300) as answer:
        assert answer.status_code == 200
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                assert name == event["type"], "the SSE event name is the event's type"
                events.append(event)
    return events


@pytest.mark.parametrize("case", sorted(CASES))
def test_unary_answers_conform(random_server, case):
    response = unary(random_server, CASES[case])
    assert check_response(response) == []
    if case.startswith("cut"):
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
        assert response["completed_at"] is None
    if "tool_choice" in CASES[case]:
        assert response["tool_choice"] == CASES[case]["tool_choice"], "the client's echo stays"


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_answers_conform_and_end_as_their_status_says(random_server, case):
    events = streamed(random_server, CASES[case])
    assert check_stream(events) == []
    final = events[-1]["response"]
    assert events[-1]["type"] == TERMINAL_EVENT[final["status"]]
    if case.startswith("cut"):
        assert events[-1]["type"] == "response.incomplete"


def test_a_function_call_output_follow_up_conforms(random_server):
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": ALLOWED[0],
            "arguments": "{}", "status": "completed"}
    history = [{"role": "user", "content": "Go ahead."}, call,
               {"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    for body in ({**BASE, "tools": TOOLS, "input": history},
                 {**CASES["allowed_auto"], "input": history}):
        assert check_response(unary(random_server, body)) == []
        assert check_stream(streamed(random_server, body)) == []
