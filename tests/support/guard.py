"""The output guard's recorded streams and what reads them: tests/data/guard/'s recordings (a real
``vllm serve``'s answers, see test_guard.py's docstring), the events of a stream, the calls in
them, a stream with reasoning items put around its calls, and a guard run over events. The guard's
tests and the backstops', custom tools' and property tests all read the same recordings."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from vllm_allowed_tools.response.sse import SSEFramer

DATA = Path(__file__).resolve().parent.parent / "data" / "guard"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.json").read_text())


def sse_events(raw: str | bytes) -> list:
    framer = SSEFramer()
    events = framer.feed(raw.encode() if isinstance(raw, str) else raw)
    assert framer.flush() == b""
    return events


def stream(name: str) -> list[dict[str, Any]]:
    """The JSON events of a recorded stream (chat: without the final [DONE])."""
    return [event.json() for event in sse_events(load(name)["sse"]) if event.data != "[DONE]"]


def renumber(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**event, "sequence_number": i} if "sequence_number" in event else event
            for i, event in enumerate(events)]


def responses_calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function_call items of a Responses stream, from their output_item.done events."""
    return [e["item"] for e in events if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "function_call"]


def reasoning_events(output_index: int, text: str, item_id: str) -> list[dict[str, Any]]:
    """A reasoning item exactly as vLLM 0.32's simple streaming path emits it."""
    part = {"text": text, "type": "reasoning_text"}
    base = {"output_index": output_index, "item_id": item_id}
    return [
        {"type": "response.output_item.added", "sequence_number": -1, "output_index": output_index,
         "item": {"type": "reasoning", "id": item_id, "summary": [], "status": "in_progress",
                  "content": None, "encrypted_content": None}},
        {"type": "response.content_part.added", "sequence_number": -1, **base, "content_index": 0,
         "part": {"text": "", "type": "reasoning_text"}},
        *({"type": "response.reasoning_text.delta", "sequence_number": -1, **base, "content_index": 0,
           "delta": piece} for piece in (text[:4], text[4:])),
        {"type": "response.reasoning_text.done", "sequence_number": -1, **base, "content_index": 0,
         "text": text},
        {"type": "response.content_part.done", "sequence_number": -1, **base, "content_index": 0,
         "part": part},
        {"type": "response.output_item.done", "sequence_number": -1, "output_index": output_index,
         "item": {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
                  "content": [part], "encrypted_content": None}},
    ]


def with_reasoning(layout: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(stream, calls): the parallel stream's calls with reasoning items around them."""
    upstream = stream("responses_stream_parallel")
    head, final = upstream[:2], copy.deepcopy(upstream[-1])
    calls_events: list[list[dict[str, Any]]] = [[]]
    for event in upstream[2:-1]:
        calls_events[-1].append(event)
        if event["type"] == "response.output_item.done":
            calls_events.append([])
    calls_events.pop()
    items: list[list[dict[str, Any]]] = []
    for n, events in enumerate(calls_events):
        if layout == "before" or (layout == "between" and n > 0):
            items.append(reasoning_events(0, f"thinking about call {n}", f"rs_{n}"))
        items.append(events)
    if layout == "after":
        items.append(reasoning_events(0, "resumed reasoning after the calls", "rs_after"))
    flat: list[dict[str, Any]] = []
    output = []
    for index, events in enumerate(items):
        flat += [{**e, "output_index": index} for e in events]
        output.append(events[-1]["item"])
    final["response"]["output"] = output
    return renumber(head + flat + [final]), responses_calls(upstream)


def chat_calls(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """tool index -> {"id", "name", "arguments"} reassembled from chunks (choice 0)."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                fn = call.get("function") or {}
                entry["name"] += fn.get("name") or ""
                entry["arguments"] += fn.get("arguments") or ""
    return calls


def run_guard(guard, events: list[Any]) -> list[Any]:
    """What a guard sends for ``events``: each fed in turn until the guard ends the stream, then
    its finish."""
    out = []
    for event in events:
        out += guard.feed(event)
        if guard.terminal:
            break
    return out + guard.finish()


def send_plan(api: str, call_filter: Any, request: dict[str, Any] | None = None, **fields: Any):
    """The turn plan a test's ``GuardedSend`` reads: ``request`` (an empty one by default)
    rewritten as the middleware would, judged by ``call_filter``; ``fields``: the plan's others
    (``contract``, ``approvals``, ``commit``, ...)."""
    from vllm_allowed_tools.asgi.turn_plan import TurnPlan
    from vllm_allowed_tools.request.placement import TEMPLATE_VARIABLE
    from vllm_allowed_tools.request.rewrite import rewrite_request
    if request is None:
        request = {"messages": []} if api == "chat" else {"input": []}
    return TurnPlan(api=api, render=False, placement=TEMPLATE_VARIABLE,   # type: ignore[arg-type]
                    rewritten=rewrite_request(request, api), call_filter=call_filter,  # type: ignore[arg-type]
                    contract=fields.pop("contract", None), **fields)
