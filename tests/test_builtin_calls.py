"""Built-in tools' calls (``web_search_call``, ``code_interpreter_call``, ...: what gpt-oss's browser
and python produce when vLLM runs them) at the output guard: an ``allowed_tools`` turn never names a
built-in tool (the selection refuses one), so none of their calls leaves the server on such a turn;
a plain request lets out only the built-ins it offered."""

from __future__ import annotations

import pytest

from vllm_allowed_tools.errors import InvalidSelectionError
from vllm_allowed_tools.request import resolve_allowlist
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.response import (
    AllowedNames,
    AllowedToolsViolation,
    ResponsesStreamGuard,
    check_responses_object,
)
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.response.call_names import BUILTIN_CALLS
from vllm_allowed_tools.wire import ALLOWLIST_KEY, WireAllowlist

FUNCTIONS = [tool.responses_tool() for tool in POOL[:3]]
BROWSER = {"type": "web_search_preview"}
PYTHON = {"type": "code_interpreter", "container": {"type": "auto"}}


def body(tools, tool_choice="auto") -> dict:
    return {"model": "m", "input": "x", "tools": tools, "tool_choice": tool_choice}


def turn_filter(*names: str) -> WireAllowlist:
    request = body(FUNCTIONS + [BROWSER, PYTHON], {"type": "allowed_tools", "mode": "auto",
                                                    "tools": [{"type": "function", "name": n} for n in names]})
    return WireAllowlist.from_wire(rewrite_request(request, "responses").body[ALLOWLIST_KEY])


def response(*items) -> dict:
    return {"object": "response", "status": "completed", "output": list(items)}


SEARCH = {"type": "web_search_call", "id": "ws_1", "status": "completed",
          "action": {"type": "search", "query": "q"}}
CODE = {"type": "code_interpreter_call", "id": "ci_1", "status": "completed", "code": "print(1)",
        "container_id": "c", "outputs": []}


@pytest.mark.parametrize("selected", [BROWSER, PYTHON, {"type": "web_search"}])
def test_a_selection_naming_a_built_in_tool_is_a_400_naming_the_entry(selected):
    with pytest.raises(InvalidSelectionError) as refused:
        resolve_allowlist(body(FUNCTIONS + [BROWSER, PYTHON], {
            "type": "allowed_tools", "mode": "auto", "tools": [selected]}), "responses")
    assert refused.value.param == "tool_choice.tools[0].type"


@pytest.mark.parametrize("item", [SEARCH, CODE])
def test_an_allowed_tools_turn_lets_no_built_in_call_out(item):
    with pytest.raises(AllowedToolsViolation, match="built-in tool"):
        check_responses_object(response(item), turn_filter(POOL[0].name))


@pytest.mark.parametrize("item", [SEARCH, CODE])
def test_the_stream_guard_ends_the_stream_at_a_built_in_call(item):
    guard = ResponsesStreamGuard(turn_filter(POOL[0].name))
    out = guard.feed({"type": "response.created", "sequence_number": 0,
                      "response": {"object": "response", "status": "in_progress", "output": []}})
    out += guard.feed({"type": "response.output_item.added", "sequence_number": 1, "output_index": 0,
                       "item": {**item, "status": "in_progress"}})
    assert guard.terminal and guard.violation.kind == "builtin"
    assert not any(event.get("item", {}).get("type") == item["type"] for event in out)
    assert out[-1]["type"] == "response.failed"


def test_a_plain_request_lets_out_only_the_built_ins_it_offered():
    offered = AllowedNames.from_request(body(FUNCTIONS + [BROWSER]), "responses")
    check_responses_object(response(SEARCH), offered)
    with pytest.raises(AllowedToolsViolation, match="built-in tool"):
        check_responses_object(response(CODE), offered)
    with pytest.raises(AllowedToolsViolation):
        check_responses_object(response(SEARCH), AllowedNames.from_request(body(FUNCTIONS), "responses"))


def test_every_built_in_call_type_names_the_tool_types_that_offer_it():
    assert all(kinds and all(isinstance(kind, str) for kind in kinds) for kinds in BUILTIN_CALLS.values())
    assert not {"function_call", "custom_tool_call"} & set(BUILTIN_CALLS)
