"""Output indexes on a Responses stream with approvals: every item the client sees has its own
``output_index``, dense and in the order the items were added, the same on its ``added``, delta and
``done`` events, and the final ``response.completed`` output lists the items at those positions.

Synthetic event streams through the output guard and the approval step (no server): a call that
needs an approval no scope can give (scopes ``["session"]``, no session) is withheld, a gated call
with a session becomes an elicitation, a free call passes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_allowed_tools.approvals import ApprovalPolicy, open_engine
from vllm_allowed_tools.approvals.stream import ApprovalStream
from vllm_allowed_tools.approvals.response_bodies import ResponseApprovals
from vllm_allowed_tools.devtools.models.tool_pool import POOL_BY_NAME
from vllm_allowed_tools.request import resolve_allowlist
from vllm_allowed_tools.response import ResponsesStream, ResponsesStreamGuard, run_sync

GATED, FREE = "send_email", "get_weather"
POLICY = {"rules": [{"tools": [GATED], "approval": "required", "scopes": ["session"]}]}
BODY = {"model": "tiny", "input": "hi",
        "tools": [POOL_BY_NAME[GATED].responses_tool(), POOL_BY_NAME[FREE].responses_tool()]}


@pytest.fixture
def engine(tmp_path):
    return open_engine(ApprovalPolicy.from_mapping(POLICY), tmp_path / "grants.db")


def _call(name: str, n: int) -> dict[str, Any]:
    return {"id": f"fc_{n}", "type": "function_call", "call_id": f"call_{n}", "name": name,
            "arguments": json.dumps({"n": n}), "status": "completed"}


def _message(n: int) -> dict[str, Any]:
    return {"id": f"msg_{n}", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "hi", "annotations": []}]}


def _opening(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """An item's events up to (not including) its ``output_item.done``."""
    if item["type"] == "function_call":
        added = {**item, "arguments": "", "status": "in_progress"}
        return [{"type": "response.output_item.added", "output_index": index, "item": added},
                {"type": "response.function_call_arguments.delta", "output_index": index,
                 "item_id": item["id"], "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "output_index": index,
                 "item_id": item["id"], "arguments": item["arguments"], "name": item["name"]}]
    part = {"type": "output_text", "text": "", "annotations": []}
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "content": [], "status": "in_progress"}},
            {"type": "response.content_part.added", "output_index": index, "item_id": item["id"],
             "content_index": 0, "part": part},
            {"type": "response.output_text.delta", "output_index": index, "item_id": item["id"],
             "content_index": 0, "delta": "hi"},
            {"type": "response.content_part.done", "output_index": index, "item_id": item["id"],
             "content_index": 0, "part": item["content"][0]}]


def _done(item: dict[str, Any], index: int) -> list[dict[str, Any]]:
    return [{"type": "response.output_item.done", "output_index": index, "item": item}]


def _numbered(items: list[dict[str, Any]], middle: list[dict[str, Any]]) -> list[dict[str, Any]]:
    events = [{"type": "response.created", "response": {"object": "response", "output": []}},
              *middle,
              {"type": "response.completed",
               "response": {"object": "response", "status": "completed", "output": items}}]
    return [{**event, "sequence_number": number} for number, event in enumerate(events)]


def _sequential(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM streams: one item after the other."""
    return _numbered(items, [event for index, item in enumerate(items)
                             for event in _opening(item, index) + _done(item, index)])


def _run(engine, events: list[dict[str, Any]], session: str | None) -> list[dict[str, Any]]:
    stream = ResponsesStream()
    ResponsesStreamGuard(resolve_allowlist(BODY, "responses"), stream=stream)
    ApprovalStream(ResponseApprovals(engine, BODY, resolve_allowlist(BODY, "responses"),
                                     principal="alice", session=session), stream=stream)
    return [out for event in events for out in stream.feed(event)] + run_sync(stream.finish())


def _assert_indexes_consistent(out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The invariant; returns the items the client saw, by output_index."""
    seen: dict[int, dict[str, Any]] = {}
    for event in out:
        index = event.get("output_index")
        if event["type"] == "response.output_item.added":
            assert index == len(seen), f"added at {index}, expected {len(seen)}: {event}"
            seen[index] = event["item"]
        elif index is not None:
            assert index in seen, f"an event for an item never added: {event}"
            item_id = event.get("item_id") or (event.get("item") or {}).get("id")
            assert item_id == seen[index]["id"], f"output_index {index} is two items: {event}"
    final = out[-1]
    assert final["type"] == "response.completed"
    assert [item["id"] for item in final["response"]["output"]] == \
        [seen[index]["id"] for index in range(len(seen))]
    numbers = [event["sequence_number"] for event in out]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    return [seen[index] for index in range(len(seen))]


def _kinds(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(item["type"], item.get("call_id") or item["id"]) for item in items]


@pytest.mark.parametrize("session", [None, "s1"])
def test_sequential_items_keep_dense_indexes(engine, session):
    items = [_message(0), _call(GATED, 1), _call(FREE, 2), _call(GATED, 3), _message(4)]
    seen = _assert_indexes_consistent(_run(engine, _sequential(items), session))
    if session is None:   # no scope can be given: the gated calls are withheld
        assert _kinds(seen) == [("message", "msg_0"), ("function_call", "call_2"),
                                ("message", "msg_4")]
    else:
        assert _kinds(seen) == [("message", "msg_0"), ("elicitation", "call_1"),
                                ("function_call", "call_2"), ("elicitation", "call_3"),
                                ("message", "msg_4")]


def test_a_later_call_that_passes_never_shares_an_index_with_a_shifted_item(engine):
    # the withheld call completes after the free call that follows it: the free call is sent
    # first, and the message after both must not land on its output_index
    withheld, free, message = _call(GATED, 0), _call(FREE, 1), _message(2)
    events = _numbered([withheld, free, message],
                       _opening(withheld, 0) + _opening(free, 1) + _done(free, 1)
                       + _done(withheld, 0) + _opening(message, 2) + _done(message, 2))
    seen = _assert_indexes_consistent(_run(engine, events, None))
    assert _kinds(seen) == [("function_call", "call_1"), ("message", "msg_2")]


@pytest.mark.parametrize("session", [None, "s1"])
def test_an_item_added_while_a_call_is_held_keeps_one_index(engine, session):
    # a message starts while a gated call is still held: every event of the message carries the
    # index it was added at, whatever the call becomes
    call, message = _call(GATED, 0), _message(1)
    events = _numbered([call, message],
                       _opening(call, 0) + _opening(message, 1) + _done(call, 0)
                       + _done(message, 1))
    seen = _assert_indexes_consistent(_run(engine, events, session))
    expected = [("message", "msg_1")] + ([] if session is None else [("elicitation", "call_0")])
    assert _kinds(seen) == expected


def test_an_unchanged_stream_is_passed_as_the_very_events(engine):
    items = [_message(0), _call(FREE, 1)]
    events = _sequential(items)
    out = _run(engine, events, "s1")
    assert all(sent is fed for sent, fed in zip(out[:-1], events[:-1]))
