"""The output guard's backstops (``docs/response-path.md``, "Backstops"), without a server.

* ``required_without_call``: a turn that must call (plain ``required``, a named choice,
  ``allowed_tools`` in ``required`` mode) never answers 200 without a call; an answer the token
  limit cut (Responses ``status: incomplete``, Chat ``finish_reason: length``) stays as it is;
* ``arguments_not_object``: a function call whose arguments are not one JSON object never leaves
  as a complete call (in any mode); the call the token limit cut an answer inside is the exception:
  it stays in the incomplete answer, closed as ``incomplete`` on Responses;
* ``strict_arguments_invalid``: a ``strict`` tool's arguments (every tool's under
  ``--tool-strict-level parameter``) validate against its schema.

Unary Chat and Responses, streamed Chat and Responses (guards on parsed events, and ``GuardedSSE``
over raw SSE bytes in random chunkings), the server's response side (``GuardedSend``) and the
approvals on the same stream.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools import metrics
from vllm_allowed_tools.approvals import ApprovalPolicy, open_engine
from vllm_allowed_tools.approvals.chat import ChatCallFilter
from vllm_allowed_tools.approvals.stream import ApprovalStream
from vllm_allowed_tools.approvals.response_bodies import ResponseApprovals
from vllm_allowed_tools.asgi.guarded_send import GuardedSend, StopSignal
from vllm_allowed_tools.asgi.turn_plan import output_contract
from vllm_allowed_tools.launch import LaunchArgs
from vllm_allowed_tools.request import resolve_allowlist
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.response import (
    AllowedNames,
    AllowedToolsViolation,
    ChatStreamGuard,
    GuardedSSE,
    ResponsesStream,
    ResponsesStreamGuard,
    check_chat_completion,
    check_responses_object,
    run_sync,
)
from vllm_allowed_tools.devtools.models.tool_pool import POOL, POOL_BY_NAME
from vllm_allowed_tools.response.contract import NAMES_ONLY, OutputContract
from vllm_allowed_tools.response.sse import SSEEvent, SSEFramer
from vllm_allowed_tools.settings import Settings

from support.guard import DATA, load, responses_calls, run_guard, send_plan, stream, with_reasoning

NAMES = [tool.name for tool in POOL[:8]]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
REASONS = ("required_without_call", "arguments_not_object", "strict_arguments_invalid",
           "custom_input_invalid")   # the last: tests/test_custom_tools.py
BAD_ARGUMENTS = ["unit{", "[1]", "{", '"text"', "", "null", '{"a": 1, "a": 2}']
WEATHER = POOL_BY_NAME["search_weather"]          # {"priority": low|high, "unit": c|f}, both required
GOOD = '{"priority": "high", "unit": "c"}'
INVALID = '{"priority": "urgent", "unit": "c"}'   # an object, but not what the schema says


# ------------------------------------------------------------------------------------------ helpers

def body(api: str, tool_choice: Any = None, *, strict: bool = False) -> dict[str, Any]:
    tools = [(tool.chat_tool(strict) if api == "chat" else tool.responses_tool(strict))
             for tool in POOL[:8]]
    out: dict[str, Any] = {"model": "tiny", "tools": tools}
    out["messages" if api == "chat" else "input"] = [{"role": "user", "content": "hi"}] \
        if api == "chat" else "hi"
    if tool_choice is not None:
        out["tool_choice"] = tool_choice
    return out


def allowed(api: str, mode: str, names: list[str]) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": n}} if api == "chat"
             else {"type": "function", "name": n} for n in names]
    if api == "chat":
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}
    return {"type": "allowed_tools", "mode": mode, "tools": tools}


def named(api: str, name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}} if api == "chat" \
        else {"type": "function", "name": name}


CHOICES = {   # what each tool_choice makes of the turn: a call required or not
    "required": (lambda api: "required", True),
    "named": (lambda api: named(api, WEATHER.name), True),
    "allowed_required": (lambda api: allowed(api, "required", [WEATHER.name]), True),
    "auto": (lambda api: "auto", False),
    "allowed_auto": (lambda api: allowed(api, "auto", [WEATHER.name]), False),
    "absent": (lambda api: None, False),
}


def contract(api: str, choice: str = "auto", *, strict: bool = False,
             strict_all: bool = False) -> OutputContract:
    """The contract the middleware builds for a request with this tool_choice."""
    request = body(api, CHOICES[choice][0](api), strict=strict)
    return output_contract(rewrite_request(request, api), request, api, strict_all=strict_all)


def policy(api: str, choice: str = "auto") -> Any:
    request = body(api, CHOICES[choice][0](api))
    rewritten = rewrite_request(request, api)
    if rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        return rewritten.allowlist
    return AllowedNames.from_request(request, api)


def backstops() -> dict[str, int]:
    return dict(metrics.snapshot()["backstops"])


def counted(before: dict[str, int], reason: str) -> int:
    return backstops().get(reason, 0) - before.get(reason, 0)


def chat_completion(calls: list[tuple[str, str]] | None, finish: str = "stop",
                    content: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{n}", "type": "function",
                                  "function": {"name": name, "arguments": arguments}}
                                 for n, (name, arguments) in enumerate(calls)]
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def fcall(name: str, arguments: str, n: int = 0) -> dict[str, Any]:
    return {"id": f"fc_{n}", "type": "function_call", "call_id": f"call_{n}", "name": name,
            "arguments": arguments, "status": "completed"}


def message_item(n: int = 0, text: str = "hello") -> dict[str, Any]:
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def responses_object(output: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": status, "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


def passed(check, body: dict[str, Any], *args, **kwargs) -> dict[str, Any]:
    """Run a guard over ``body`` that must let it out: no violation, no backstop counted; the body as
    the client then gets it (a guard may only close a cut call)."""
    before = backstops()
    check(body, *args, **kwargs)
    assert backstops() == before, "a guard that let an answer out counted a backstop"
    return body


def refused(check, *args, **kwargs) -> AllowedToolsViolation:
    with pytest.raises(AllowedToolsViolation) as caught:
        check(*args, **kwargs)
    return caught.value


# ----------------------------------------------------------------------- the contract each turn gets

@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_the_middleware_requires_a_call_exactly_where_tool_choice_does(api, choice):
    assert contract(api, choice).requires_call() is CHOICES[choice][1]


def test_a_choice_left_to_vllm_still_gets_argument_checks_from_the_catalog():
    request = body("responses", {"type": "custom", "name": "x"}, strict=True)  # not ours to model
    rewritten = rewrite_request(request, "responses")
    assert rewritten.allowlist is None
    made = output_contract(rewritten, request, "responses", strict_all=False)
    assert not made.requires_call()
    assert made.arguments_refusal(WEATHER.name, INVALID).reason == "strict_arguments_invalid"


@pytest.mark.parametrize("argv, expected", [
    (["vllm", "serve", "m", "--tool-strict-level", "parameter"], True),
    (["vllm", "serve", "m", "--tool-strict-level=PARAMETER"], True),
    (["vllm", "serve", "m", "--tool_strict_level", "parameter"], True),
    (["vllm", "serve", "m", "--tool-strict-level", "function"], False),
    (["vllm", "serve", "m", "--tool-strict-level", "parameter", "--tool-strict-level", "auto"], False),
    (["vllm", "serve", "m"], False),
])
def test_the_strict_level_is_read_from_the_command_line(argv, expected):
    assert LaunchArgs.from_argv(argv).strict_level_parameter is expected


@pytest.mark.parametrize("level, expected", [("parameter", True), ("function", False)])
def test_the_middleware_takes_the_strict_level_of_its_start_up_settings(level, expected):
    from vllm_allowed_tools.vllm_glue.middleware import AllowedToolsMiddleware
    # not a `serve` line: nothing to probe; the level is what the backstops are built with
    settings = Settings.from_environ({}, ["pytest", "--tool-strict-level", level])
    assert AllowedToolsMiddleware(app=None, settings=settings).strict_all is expected


# ------------------------------------------------------------------ required without a call: unary

@pytest.mark.parametrize("choice", ["required", "named", "allowed_required"])
def test_unary_chat_without_a_call_on_a_required_turn_is_a_500(choice):
    before = backstops()
    violation = refused(check_chat_completion, chat_completion(None, content="no call"),
                        policy("chat", choice), contract=contract("chat", choice))
    assert violation.status == 500 and violation.reason == "required_without_call"
    assert violation.to_openai() == {"error": {"message": violation.message, "type": "server_error",
                                               "param": None, "code": "allowed_tools_violation"}}
    assert "must call a tool" in violation.message and "auto" in violation.message
    assert counted(before, "required_without_call") == 1


@pytest.mark.parametrize("choice", ["auto", "allowed_auto", "absent"])
def test_unary_chat_without_a_call_is_fine_where_no_call_is_required(choice):
    answer = passed(check_chat_completion, chat_completion(None, content="text"), policy("chat", choice),
                    contract=contract("chat", choice))
    assert answer == chat_completion(None, content="text")


def test_unary_chat_cut_by_the_token_limit_stays_length():
    cut = passed(check_chat_completion, chat_completion(None, "length", "<tool_call>{\"na"),
                 policy("chat", "required"), contract=contract("chat", "required"))
    assert cut["choices"][0]["finish_reason"] == "length"
    recorded = load("chat_unary_parallel")["body"]   # vLLM's own: required, cut, no call
    assert recorded["choices"][0]["finish_reason"] == "length"
    passed(check_chat_completion, recorded, policy("chat", "required"), contract=contract("chat", "required"))
    assert recorded == load("chat_unary_parallel")["body"]


def test_unary_chat_with_a_call_on_a_required_turn_passes():
    answer = passed(check_chat_completion, chat_completion([(WEATHER.name, GOOD)]),
                    policy("chat", "required"), contract=contract("chat", "required"))
    assert answer == chat_completion([(WEATHER.name, GOOD)])


@pytest.mark.parametrize("choice", ["required", "named", "allowed_required"])
def test_unary_responses_without_a_call_on_a_required_turn_is_a_500(choice):
    before = backstops()
    violation = refused(check_responses_object, responses_object([message_item()]),
                        policy("responses", choice), contract=contract("responses", choice))
    assert violation.reason == "required_without_call" and violation.status == 500
    assert counted(before, "required_without_call") == 1


def test_unary_responses_cut_by_the_token_limit_stays_incomplete():
    assert check_responses_object(responses_object([message_item()], "incomplete"),
                                  policy("responses", "required"),
                                  contract=contract("responses", "required")) is False
    recorded = load("responses_unary_parallel")["body"]   # vLLM's own: required, cut, no call
    assert passed(check_responses_object, recorded, policy("responses", "required"),
                  contract=contract("responses", "required")) == load("responses_unary_parallel")["body"]


@pytest.mark.parametrize("choice", ["auto", "allowed_auto"])
def test_unary_responses_without_a_call_is_fine_where_no_call_is_required(choice):
    answer = passed(check_responses_object, responses_object([message_item()]), policy("responses", choice),
                    contract=contract("responses", choice))
    assert answer == responses_object([message_item()])


# -------------------------------------------------------------------- arguments not an object: unary

@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
@pytest.mark.parametrize("choice", ["auto", "required", "allowed_auto"])
def test_unary_chat_arguments_that_are_not_an_object_are_refused(arguments, choice):
    before = backstops()
    violation = refused(check_chat_completion, chat_completion([(WEATHER.name, arguments)]),
                        policy("chat", choice), contract=contract("chat", choice))
    assert violation.reason == "arguments_not_object" and violation.name == WEATHER.name
    assert repr(WEATHER.name) in violation.message   # unary: the tool is named
    assert counted(before, "arguments_not_object") == 1


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_unary_responses_arguments_that_are_not_an_object_are_refused(arguments):
    before = backstops()
    violation = refused(check_responses_object,
                        responses_object([fcall(WEATHER.name, GOOD, 0), fcall(WEATHER.name, arguments, 1)]),
                        policy("responses"), contract=contract("responses"))
    assert violation.reason == "arguments_not_object"
    assert counted(before, "arguments_not_object") == 1


def test_unary_chat_cut_inside_its_last_call_stays_length_but_an_earlier_bad_call_is_refused():
    cut = chat_completion([(WEATHER.name, GOOD), (WEATHER.name, '{"pri')], "length")
    assert passed(check_chat_completion, cut, policy("chat", "required"),
                  contract=contract("chat", "required")) == \
        chat_completion([(WEATHER.name, GOOD), (WEATHER.name, '{"pri')], "length")
    earlier = chat_completion([(WEATHER.name, '{"pri'), (WEATHER.name, GOOD)], "length")
    assert refused(check_chat_completion, earlier, policy("chat"),
                   contract=contract("chat")).reason == "arguments_not_object"
    done = chat_completion([(WEATHER.name, GOOD), (WEATHER.name, '{"pri')], "tool_calls")
    assert refused(check_chat_completion, done, policy("chat"),
                   contract=contract("chat")).reason == "arguments_not_object"


def test_unary_responses_cut_inside_its_last_call_closes_that_call_as_incomplete():
    answer = responses_object([fcall(WEATHER.name, GOOD, 0), fcall(WEATHER.name, '{"pri', 1)],
                              "incomplete")
    assert check_responses_object(answer, policy("responses", "required"),
                                  contract=contract("responses", "required")) is True
    assert [item["status"] for item in answer["output"]] == ["completed", "incomplete"]
    completed = responses_object([fcall(WEATHER.name, '{"pri', 0)])
    assert refused(check_responses_object, completed, policy("responses"),
                   contract=contract("responses")).reason == "arguments_not_object"
    not_last = responses_object([fcall(WEATHER.name, '{"pri', 0), message_item(1)], "incomplete")
    assert refused(check_responses_object, not_last, policy("responses"),
                   contract=contract("responses")).reason == "arguments_not_object"


def test_without_a_contract_a_guard_judges_names_only():
    # arguments that are not JSON, and a required turn without a call: neither is a name's business
    assert passed(check_chat_completion, chat_completion([(WEATHER.name, "unit{")]), policy("chat")) \
        == chat_completion([(WEATHER.name, "unit{")])
    assert passed(check_responses_object, responses_object([message_item()]),
                  policy("responses", "required"), contract=NAMES_ONLY) == responses_object([message_item()])
    # a name outside the policy is still refused without a contract
    outside = chat_completion([("not_offered", GOOD)])
    assert refused(check_chat_completion, outside, policy("chat")).status == 500


# ------------------------------------------------------------------------------- strict: unary

@pytest.mark.parametrize("api", ["chat", "responses"])
def test_unary_strict_arguments_must_validate(api):
    before = backstops()
    strict = contract(api, strict=True)
    if api == "chat":
        violation = refused(check_chat_completion, chat_completion([(WEATHER.name, INVALID)]),
                            policy(api), contract=strict)
        assert passed(check_chat_completion, chat_completion([(WEATHER.name, GOOD)]), policy(api),
                      contract=strict) == chat_completion([(WEATHER.name, GOOD)])
    else:
        violation = refused(check_responses_object, responses_object([fcall(WEATHER.name, INVALID)]),
                            policy(api), contract=strict)
        assert passed(check_responses_object, responses_object([fcall(WEATHER.name, GOOD)]), policy(api),
                      contract=strict) == responses_object([fcall(WEATHER.name, GOOD)])
    assert violation.reason == "strict_arguments_invalid"
    assert "$.priority" in violation.message and "parameters schema" in violation.message
    assert counted(before, "strict_arguments_invalid") == 1


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_non_strict_arguments_need_only_be_an_object_unless_the_level_is_parameter(api):
    loose, every = contract(api, strict=False), contract(api, strict=False, strict_all=True)
    if api == "chat":
        assert passed(check_chat_completion, chat_completion([(WEATHER.name, INVALID)]), policy(api),
                      contract=loose) == chat_completion([(WEATHER.name, INVALID)])
        assert refused(check_chat_completion, chat_completion([(WEATHER.name, INVALID)]),
                       policy(api), contract=every).reason == "strict_arguments_invalid"
    else:
        assert passed(check_responses_object, responses_object([fcall(WEATHER.name, INVALID)]),
                      policy(api), contract=loose) == responses_object([fcall(WEATHER.name, INVALID)])
        assert refused(check_responses_object, responses_object([fcall(WEATHER.name, INVALID)]),
                       policy(api), contract=every).reason == "strict_arguments_invalid"


def test_a_strict_call_cut_by_the_token_limit_is_not_refused_for_its_schema():
    cut = passed(check_chat_completion, chat_completion([(WEATHER.name, '{"priority": "hi')], "length"),
                 policy("chat"), contract=contract("chat", strict=True))
    assert cut["choices"][0]["finish_reason"] == "length"
    # the same arguments, not cut, are refused: the cut is what lets them out
    assert refused(check_chat_completion, chat_completion([(WEATHER.name, '{"priority": "hi')]),
                   policy("chat"), contract=contract("chat", strict=True)).status == 500


# ------------------------------------------------------------------------------ streamed Chat

def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def text_chunks(finish: str = "stop") -> list[dict[str, Any]]:
    return [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hello"}),
            chunk({"content": " there"}), chunk({}, finish)]


def call_chunks(calls: list[tuple[str, list[str]]], finish: str = "tool_calls") -> list[dict[str, Any]]:
    """A call per tool index, its arguments in the given pieces, as vLLM streams them."""
    out = [chunk({"role": "assistant", "content": ""})]
    for index, (name, pieces) in enumerate(calls):
        out.append(chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                                          "function": {"name": name, "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                for piece in pieces]
    return out + [chunk({}, finish)]


def assert_chat_error(out: list[dict[str, Any]], reason: str) -> None:
    assert sum("error" in c for c in out) == 1 and "error" in out[-1]
    assert out[-1]["error"]["code"] == "allowed_tools_violation"
    assert reason in out[-1]["error"]["message"]
    assert all(choice.get("finish_reason") is None for c in out[:-1] for choice in c["choices"])


@pytest.mark.parametrize("choice", ["required", "named", "allowed_required"])
def test_streamed_chat_without_a_call_on_a_required_turn_ends_with_the_error_chunk(choice):
    before = backstops()
    events = text_chunks()
    guard = ChatStreamGuard(policy("chat", choice), contract=contract("chat", choice))
    out = run_guard(guard, events)
    assert out[:-1] == events[:-1]   # the text went out; the finish chunk never does
    assert_chat_error(out, "required_without_call")
    assert guard.violation.reason == "required_without_call"
    assert counted(before, "required_without_call") == 1


def test_streamed_chat_ending_without_a_finish_reason_or_any_choice_is_judged_at_the_end():
    for events in (text_chunks()[:-1], []):
        guard = ChatStreamGuard(policy("chat", "required"), contract=contract("chat", "required"))
        out = run_guard(guard, events)
        assert out[:-1] == events and guard.violation.reason == "required_without_call"


def test_streamed_chat_cut_by_the_token_limit_or_not_required_passes_unchanged():
    for choice, finish in (("required", "length"), ("auto", "stop"), ("allowed_auto", "stop")):
        events = text_chunks(finish)
        guard = ChatStreamGuard(policy("chat", choice), contract=contract("chat", choice))
        assert run_guard(guard, events) == events and guard.violation is None


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_streamed_chat_arguments_not_an_object_are_refused_before_the_call_completes(arguments):
    pieces = [arguments[:1], arguments[1:]] if arguments else []
    events = call_chunks([(WEATHER.name, pieces)])
    guard = ChatStreamGuard(policy("chat"), contract=contract("chat"))
    out = run_guard(guard, events)
    # the deltas went out as today (a call whose name no arguments followed was still held), the
    # finish chunk did not
    assert out[:-1] == events[:-1] if arguments else out[:-1] == events[:1]
    assert_chat_error(out, "arguments_not_object")
    assert WEATHER.name not in out[-1]["error"]["message"]   # streamed: the tool is not named


def test_streamed_chat_a_bad_call_is_refused_when_the_next_tool_index_starts():
    events = call_chunks([(WEATHER.name, ["unit{"]), (WEATHER.name, [GOOD])])
    guard = ChatStreamGuard(policy("chat"), contract=contract("chat"))
    out = run_guard(guard, events)
    start_of_second = next(i for i, c in enumerate(events)
                           if (c["choices"][0]["delta"].get("tool_calls") or [{}])[0].get("index") == 1)
    assert out[:-1] == events[:start_of_second]
    assert_chat_error(out, "arguments_not_object")


def test_streamed_chat_good_calls_pass_unchanged_the_last_arguments_in_the_finish_chunk():
    events = call_chunks([(WEATHER.name, ['{"priority": ', '"high", "unit": "c"}']),
                          (WEATHER.name, [GOOD[:5]])])
    events[-1]["choices"][0]["delta"] = {"tool_calls": [{"index": 1, "function": {"arguments": GOOD[5:]}}]}
    guard = ChatStreamGuard(policy("chat", "required"),
                            contract=contract("chat", "required", strict=True))
    assert run_guard(guard, events) == events and guard.violation is None


def test_streamed_chat_cut_inside_its_last_call_stays_length():
    events = call_chunks([(WEATHER.name, [GOOD]), (WEATHER.name, ['{"pri'])], "length")
    guard = ChatStreamGuard(policy("chat", "required"), contract=contract("chat", "required"))
    assert run_guard(guard, events) == events and guard.violation is None
    events = call_chunks([(WEATHER.name, ['{"pri']), (WEATHER.name, [GOOD])], "length")
    guard = ChatStreamGuard(policy("chat"), contract=contract("chat"))
    assert_chat_error(run_guard(guard, events), "arguments_not_object")


def test_streamed_chat_strict_arguments_must_validate():
    before = backstops()
    events = call_chunks([(WEATHER.name, [INVALID])])
    guard = ChatStreamGuard(policy("chat"), contract=contract("chat", strict=True))
    out = run_guard(guard, events)
    assert_chat_error(out, "strict_arguments_invalid")
    assert "$.priority" in out[-1]["error"]["message"] and "urgent" not in out[-1]["error"]["message"]
    assert counted(before, "strict_arguments_invalid") == 1
    loose = ChatStreamGuard(policy("chat"), contract=contract("chat", strict=False))
    assert run_guard(loose, events) == events
    every = ChatStreamGuard(policy("chat"), contract=contract("chat", strict_all=True))
    assert_chat_error(run_guard(every, events), "strict_arguments_invalid")


def test_streamed_chat_named_choice_needs_its_call():
    good = call_chunks([(WEATHER.name, [GOOD])], "stop")   # vLLM ends a named call with "stop"
    guard = ChatStreamGuard(policy("chat", "named"), contract=contract("chat", "named"))
    assert run_guard(guard, good) == good
    guard = ChatStreamGuard(policy("chat", "named"), contract=contract("chat", "named"))
    assert_chat_error(run_guard(guard, text_chunks()), "required_without_call")


# -------------------------------------------------------------------------- streamed Responses

def text_stream(status: str = "completed") -> list[dict[str, Any]]:
    """vLLM's recorded text-only stream (cut by max_output_tokens), or the same one completed."""
    events = copy.deepcopy(stream("responses_stream_text"))
    final = events[-1]["response"]
    final["status"] = status
    final["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return events


def with_arguments(events: list[dict[str, Any]], call_id: str, arguments: str) -> list[dict[str, Any]]:
    """``events`` with one call's arguments replaced everywhere they appear."""
    events = copy.deepcopy(events)
    item_id = next(e["item"]["id"] for e in events if e["type"] == "response.output_item.added"
                   and e["item"].get("call_id") == call_id)
    first = True
    for event in events:
        if event.get("item_id") == item_id and event["type"] == "response.function_call_arguments.delta":
            event["delta"], first = (arguments if first else ""), False
        elif event.get("item_id") == item_id and event["type"] == "response.function_call_arguments.done":
            event["arguments"] = arguments
        elif event["type"] == "response.output_item.done" and event["item"]["id"] == item_id:
            event["item"]["arguments"] = arguments
        for item in (event.get("response") or {}).get("output") or ():
            if item.get("id") == item_id:
                item["arguments"] = arguments
    return events


def catalog_body(name: str) -> dict[str, Any]:
    """A recorded stream's request with its tools not strict (vLLM recorded them unconstrained)."""
    request = copy.deepcopy(load(name)["request"]["body"])
    for tool in request["tools"]:
        (tool.get("function") or tool)["strict"] = False
    return request


def recorded_contract(name: str, **kwargs: Any) -> OutputContract:
    api = "chat" if name.startswith("chat") else "responses"
    request = catalog_body(name)
    return output_contract(rewrite_request(request, api), request, api, strict_all=False, **kwargs)


def assert_failed(out: list[dict[str, Any]], reason: str) -> dict[str, Any]:
    kinds = [e["type"] for e in out]
    assert kinds.count("response.failed") == 1 and kinds[-1] == "response.failed"
    assert not {"response.completed", "response.incomplete"} & set(kinds)
    numbers = [e["sequence_number"] for e in out]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    added = {e["output_index"] for e in out if e["type"] == "response.output_item.added"}
    assert added == {e["output_index"] for e in out if e["type"] == "response.output_item.done"}
    failed = out[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "allowed_tools_violation"
    assert reason in failed["error"]["message"]
    return failed


@pytest.mark.parametrize("choice", ["required", "named", "allowed_required"])
def test_streamed_responses_without_a_call_on_a_required_turn_fail(choice):
    before = backstops()
    events = text_stream()
    guard = ResponsesStreamGuard(policy("responses", choice), contract=contract("responses", choice))
    out = run_guard(guard, events)
    assert out[:-1] == events[:-1]            # everything up to the terminal event, unchanged
    assert_failed(out, "required_without_call")
    assert guard.violation.reason == "required_without_call"
    assert counted(before, "required_without_call") == 1


def test_streamed_responses_cut_by_the_token_limit_or_not_required_pass_unchanged():
    for choice, status in (("required", "incomplete"), ("auto", "completed"), ("allowed_auto", "completed")):
        events = text_stream(status)
        guard = ResponsesStreamGuard(policy("responses", choice), contract=contract("responses", choice))
        out = run_guard(guard, events)
        assert out == events and all(a is b for a, b in zip(out, events)) and guard.violation is None


@pytest.mark.parametrize("arguments", BAD_ARGUMENTS)
def test_streamed_responses_arguments_not_an_object_fail_before_the_call_completes(arguments):
    upstream = stream("responses_stream_single")
    (call,) = responses_calls(upstream)
    events = with_arguments(upstream, call["call_id"], arguments)
    guard = ResponsesStreamGuard(policy("responses", "required"),
                                 contract=recorded_contract("responses_stream_single"))
    out = run_guard(guard, events)
    failed = assert_failed(out, "arguments_not_object")
    cut = next(i for i, e in enumerate(events) if e["type"] == "response.function_call_arguments.done")
    assert out[:cut] == events[:cut]          # deltas as today; nothing from arguments.done on
    closing = [e for e in out if e["type"] == "response.output_item.done"]
    assert [e["item"]["status"] for e in closing] == ["incomplete"]
    assert failed["output"][0]["status"] == "incomplete"


def test_streamed_responses_cut_inside_the_last_call_stays_incomplete_with_that_call_incomplete():
    upstream = stream("responses_stream_parallel")   # vLLM's own: cut inside its third call
    cut_call = responses_calls(upstream)[-1]
    assert upstream[-1]["response"]["status"] == "incomplete"
    guard = ResponsesStreamGuard(policy("responses", "required"),
                                 contract=recorded_contract("responses_stream_parallel"))
    out = run_guard(guard, upstream)
    assert guard.violation is None and out[-1]["response"]["status"] == "incomplete"
    done = [e["item"] for e in out if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["completed", "completed", "incomplete"]
    assert done[-1]["arguments"] == cut_call["arguments"]
    assert [item["status"] for item in out[-1]["response"]["output"]] == \
        ["completed", "completed", "incomplete"]
    assert not [e for e in out if e["type"] == "response.function_call_arguments.done"
                and e["item_id"] == cut_call["id"]]   # nothing says its arguments are done
    numbers = [e["sequence_number"] for e in out]
    assert numbers == list(range(len(numbers)))
    # a cut call that is not the last item (something was generated after it) is refused
    reordered, _ = with_reasoning("after")
    guard = ResponsesStreamGuard(policy("responses"),
                                 contract=recorded_contract("responses_stream_parallel"))
    assert_failed(run_guard(guard, reordered), "arguments_not_object")


def test_streamed_responses_strict_arguments_must_validate():
    upstream = stream("responses_stream_single")
    (call,) = responses_calls(upstream)
    events = with_arguments(upstream, call["call_id"], '{"priority": "urgent", "unit": "c"}')
    before = backstops()
    strict = ResponsesStreamGuard(policy("responses"), contract=contract("responses", strict=True))
    out = run_guard(strict, events)
    assert "urgent" not in json.dumps(assert_failed(out, "strict_arguments_invalid")["error"])
    assert counted(before, "strict_arguments_invalid") == 1
    loose = ResponsesStreamGuard(policy("responses"), contract=contract("responses"))
    assert run_guard(loose, events) == events
    every = ResponsesStreamGuard(policy("responses"), contract=contract("responses", strict_all=True))
    assert_failed(run_guard(every, events), "strict_arguments_invalid")


def test_streamed_responses_a_call_only_in_the_terminal_snapshot_is_judged_there():
    events = text_stream()
    events[-1]["response"]["output"].append(fcall(WEATHER.name, "unit{", 9))
    guard = ResponsesStreamGuard(policy("responses", "required"),
                                 contract=contract("responses", "required"))
    assert_failed(run_guard(guard, events), "arguments_not_object")


# --------------------------------------------------------------------- raw SSE bytes, any chunking

def encode(events: list[dict[str, Any]], chat: bool) -> bytes:
    out = b"".join(SSEEvent.encode(e, None if chat else e["type"]) for e in events)
    return out + (b"data: [DONE]\n\n" if chat else b"")


def frames(raw: bytes) -> list[SSEEvent]:
    framer = SSEFramer()
    events = framer.feed(raw)
    assert framer.flush() == b""
    return events


def chunked(raw: bytes, sizes: list[int]) -> list[bytes]:
    chunks, at = [], 0
    for size in sizes:
        if at < len(raw):
            chunks.append(raw[at:at + size])
            at += size
    return chunks + ([raw[at:]] if at < len(raw) else [])


def through_sse(guard, raw: bytes, sizes: list[int]) -> tuple[bytes, GuardedSSE]:
    guarded = GuardedSSE(guard)
    out = []
    for piece in chunked(raw, sizes):
        out.append(guarded.feed(piece))
        if guarded.terminal:
            break
    out.append(guarded.close())
    return b"".join(out), guarded


def sse_case(kind: str) -> tuple[str, Any, bytes, str | None]:
    """(api, guard, raw upstream bytes, the reason it must fail with or None: it passes)."""
    single = stream("responses_stream_single")
    call = responses_calls(single)[0]
    chat_single = stream("chat_stream_single")
    if kind == "responses_required":
        return "responses", ResponsesStreamGuard(policy("responses", "required"),
                                                 contract=contract("responses", "required")), \
            encode(text_stream(), False), "required_without_call"
    if kind == "responses_not_object":
        return "responses", ResponsesStreamGuard(policy("responses"), contract=contract("responses")), \
            encode(with_arguments(single, call["call_id"], '{"unit"'), False), "arguments_not_object"
    if kind == "responses_strict":
        return "responses", ResponsesStreamGuard(policy("responses"),
                                                 contract=contract("responses", strict=True)), \
            encode(with_arguments(single, call["call_id"], INVALID), False), "strict_arguments_invalid"
    if kind == "chat_required":
        return "chat", ChatStreamGuard(policy("chat", "named"), contract=contract("chat", "named")), \
            encode(text_chunks(), True), "required_without_call"
    if kind == "chat_not_object":
        bad = copy.deepcopy(chat_single)
        for c in bad:
            for t in c["choices"][0]["delta"].get("tool_calls") or () if c.get("choices") else ():
                if (t.get("function") or {}).get("arguments"):
                    t["function"]["arguments"] = "[1"
        return "chat", ChatStreamGuard(policy("chat"), contract=contract("chat")), encode(bad, True), \
            "arguments_not_object"
    if kind == "chat_strict":
        return "chat", ChatStreamGuard(policy("chat"), contract=contract("chat", strict=True)), \
            encode(call_chunks([(WEATHER.name, [INVALID[:9], INVALID[9:]])]), True), \
            "strict_arguments_invalid"
    raise AssertionError(kind)


FAILING = ["responses_required", "responses_not_object", "responses_strict", "chat_required",
           "chat_not_object", "chat_strict"]


@SETTINGS
@given(st.sampled_from(FAILING), st.lists(st.integers(1, 400), max_size=60))
def test_over_raw_sse_a_backstop_ends_the_stream_with_one_terminal_event(kind, sizes):
    api, guard, raw, reason = sse_case(kind)
    out, guarded = through_sse(guard, raw, sizes)
    assert guarded.terminal and guarded.violation.reason == reason
    events = frames(out)
    if api == "responses":
        parsed = [e.json() for e in events]
        assert all(e.event == p["type"] for e, p in zip(events, parsed))
        assert_failed(parsed, reason)
        assert b"response.function_call_arguments.done" not in out.split(b"event: response.failed")[0] \
            or reason == "required_without_call"
        prefix = out[:out.index(b"event: response.output_item.done") if b'"incomplete"' in out
                     else out.index(b"event: response.failed")]
        assert raw.startswith(prefix)
    else:
        assert events[-1].data == "[DONE]" and sum(e.data == "[DONE]" for e in events) == 1
        parsed = [e.json() for e in events[:-1]]
        assert_chat_error(parsed, reason)
        assert raw.startswith(out[:out.rindex(b'data: {"error"')])


GOOD_STREAMS = {   # recorded streams that meet every backstop of their request (tools not strict)
    "responses_stream_single": "required", "responses_stream_auto_happy": "auto",
    "responses_stream_text": "required",   # cut by the token limit: no call needed
    "chat_stream_single": "required", "chat_stream_auto_happy": "auto",
    "chat_stream_parallel": "required",    # cut inside its last call: finish_reason length
}


@SETTINGS
@given(st.sampled_from(sorted(GOOD_STREAMS)), st.lists(st.integers(1, 700), max_size=80))
def test_over_raw_sse_streams_meeting_the_contract_pass_byte_for_byte(name, sizes):
    api = "chat" if name.startswith("chat") else "responses"
    request = catalog_body(name)
    request["tool_choice"] = GOOD_STREAMS[name]
    made = output_contract(rewrite_request(request, api), request, api, strict_all=False)
    assert made.requires_call() is (GOOD_STREAMS[name] == "required")
    names = AllowedNames(NAMES)
    guard = ChatStreamGuard(names, contract=made) if api == "chat" \
        else ResponsesStreamGuard(names, contract=made)
    raw = json.loads((DATA / f"{name}.json").read_text())["sse"].encode()
    out, guarded = through_sse(guard, raw, sizes)
    assert out == raw and not guarded.terminal


# ------------------------------------------------------------------------------ the approvals

GATED, FREE = "send_email", "get_weather"
APPROVAL_POLICY = {"rules": [{"tools": [GATED], "approval": "required", "scopes": ["session"]}]}
GATED_ARGS = json.dumps({"path": "readme", "unit": "c"})


def approvals_body(stream_: bool = False) -> dict[str, Any]:
    return {"model": "tiny", "input": "hi", "tool_choice": "required", "stream": stream_,
            "tools": [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]}


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(APPROVAL_POLICY), tmp_path / "grants.db")


def gated_call_stream() -> list[dict[str, Any]]:
    item = fcall(GATED, GATED_ARGS)
    events = [{"type": "response.created", "response": {"object": "response", "status": "in_progress",
                                                        "output": []}},
              {"type": "response.output_item.added", "output_index": 0,
               "item": {**item, "arguments": "", "status": "in_progress"}},
              {"type": "response.function_call_arguments.delta", "output_index": 0,
               "item_id": item["id"], "delta": GATED_ARGS},
              {"type": "response.function_call_arguments.done", "output_index": 0,
               "item_id": item["id"], "arguments": GATED_ARGS, "name": GATED},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed", "response": responses_object([item])}]
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


@pytest.mark.parametrize("session", ["s1", None])   # s1: an elicitation; None: withheld
def test_a_required_turn_whose_call_becomes_an_elicitation_or_is_withheld_has_a_call(engine, session):
    request = approvals_body(True)
    turn = resolve_allowlist(request, "responses")
    made = OutputContract.for_turn(turn)
    assert made.requires_call()
    on = ResponsesStream()
    guard = ResponsesStreamGuard(AllowedNames.from_request(request, "responses"), stream=on,
                                 contract=made)
    ApprovalStream(ResponseApprovals(engine, request, turn, principal="alice", session=session),
                   stream=on)
    out = [sent for event in gated_call_stream() for sent in on.feed(event)] + run_sync(on.finish())
    assert guard.violation is None and out[-1]["type"] == "response.completed"
    kinds = [item["type"] for item in out[-1]["response"]["output"]]
    assert kinds == (["elicitation"] if session else [])   # no function_call left in either


def serve(api: str, request: dict[str, Any], answer: bytes, *, sse: bool, approvals: Any = None,
          call_filter: Any = None) -> tuple[int, bytes]:
    """An app's answer through the middleware's response side, with the request's contract."""
    rewritten = rewrite_request(request, api)
    made = output_contract(rewritten, request, api, strict_all=False)
    call_filter = call_filter or AllowedNames.from_request(request, api)
    stop, sent = StopSignal(), []

    async def client_send(message):
        sent.append(message)

    async def app():
        send = GuardedSend(client_send, send_plan(api, call_filter, request, contract=made,
                                               approvals=approvals), stop, (2, 4))
        kind = b"text/event-stream" if sse else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        await send({"type": "http.response.body", "body": answer, "more_body": False})

    asyncio.run(app())
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    return start["status"], b"".join(m.get("body", b"") for m in sent
                                     if m["type"] == "http.response.body")


@pytest.mark.parametrize("session", ["s1", None])
def test_unary_responses_through_the_server_with_approvals_judge_the_models_output(engine, session):
    request = approvals_body()
    turn = resolve_allowlist(request, "responses")
    approvals = ResponseApprovals(engine, request, turn, principal="alice", session=session)
    answer = json.dumps(responses_object([fcall(GATED, GATED_ARGS)])).encode()
    status, sent = serve("responses", request, answer, sse=False, approvals=approvals)
    assert status == 200, sent
    kinds = [item["type"] for item in json.loads(sent)["output"]]
    assert kinds == (["elicitation"] if session else [])
    # the same turn answered without a call is refused, approvals on or not
    status, sent = serve("responses", request, json.dumps(responses_object([message_item()])).encode(),
                         sse=False, approvals=approvals)
    assert status == 500 and "required_without_call" in json.loads(sent)["error"]["message"]


@pytest.mark.parametrize("session", ["s1", None])
def test_streamed_responses_through_the_server_with_approvals_judge_the_models_output(engine, session):
    request = approvals_body(True)
    turn = resolve_allowlist(request, "responses")
    approvals = ResponseApprovals(engine, request, turn, principal="alice", session=session)
    status, sent = serve("responses", request, encode(gated_call_stream(), False), sse=True,
                         approvals=approvals)
    parsed = [e.json() for e in frames(sent)]
    assert status == 200 and parsed[-1]["type"] == "response.completed", parsed[-1]
    assert [i["type"] for i in parsed[-1]["response"]["output"]] == (["elicitation"] if session else [])


def test_chat_approvals_filter_with_a_required_turn():
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
               "tools": [POOL_BY_NAME[GATED].chat_tool(), POOL_BY_NAME[FREE].chat_tool()]}
    turn = resolve_allowlist(request, "chat")
    made = OutputContract.for_turn(turn)
    gated_blocked = ChatCallFilter(AllowedNames.from_request(request, "chat"), frozenset({GATED}))
    free_args = json.dumps({"day": "monday", "path": "readme"})
    assert passed(check_chat_completion, chat_completion([(FREE, free_args)]), gated_blocked,
                  contract=made) == chat_completion([(FREE, free_args)])
    blocked = refused(check_chat_completion, chat_completion([(GATED, GATED_ARGS)]), gated_blocked,
                      contract=made)
    assert blocked.reason is None and "needs approval" in blocked.message   # the filter's refusal
    assert refused(check_chat_completion, chat_completion(None), gated_blocked,
                   contract=made).reason == "required_without_call"


def test_chat_through_the_server_unary_and_streamed():
    request = body("chat", "required")
    status, sent = serve("chat", request, json.dumps(chat_completion(None, content="x")).encode(),
                         sse=False)
    error = json.loads(sent)["error"]
    assert status == 500 and error["code"] == "allowed_tools_violation" and error["type"] == "server_error"
    status, sent = serve("chat", request, encode(text_chunks(), True), sse=True)
    events = frames(sent)
    assert status == 200 and events[-1].data == "[DONE]"
    assert "required_without_call" in events[-2].json()["error"]["message"]
    status, sent = serve("chat", request, encode(call_chunks([(WEATHER.name, [GOOD])]), True), sse=True)
    assert sent == encode(call_chunks([(WEATHER.name, [GOOD])]), True)


# ----------------------------------------------------------------------------------------- metrics

def test_every_reason_is_a_metrics_label():
    assert metrics.BACKSTOP_REASONS == frozenset(REASONS)
    assert metrics.METRIC_NAMES["backstops"][:2] == ("vllm_allowed_tools:backstops", "reason")


def test_a_backstop_is_counted_once_under_its_reason_and_once_under_its_source():
    violations_before = dict(metrics.snapshot()["violations"])
    before = backstops()
    guard = ChatStreamGuard(policy("chat", "required"), contract=contract("chat", "required"))
    run_guard(guard, text_chunks())
    assert counted(before, "required_without_call") == 1
    assert metrics.snapshot()["violations"].get("stream_guard", 0) == \
        violations_before.get("stream_guard", 0) + 1
