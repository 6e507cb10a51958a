"""Property tests of the output guard over recorded SSE byte streams in arbitrary chunkings.

For any chunking of any recorded stream (plus variants with a call's name split over several
chunks, or a Responses call whose name arrives only at its ``done`` events), run through
:class:`~vllm_allowed_tools.response.GuardedSSE`:

* with every called tool allowed, the output is the input, byte for byte (event for event);
* with one called tool disallowed, no byte of any call to it (id, call id, name, arguments, not
  even a name prefix) reaches the output, and the output carries exactly one terminal event, last
  (Responses: ``response.failed`` with strictly increasing ``sequence_number`` s; Chat: one error
  chunk, then ``data: [DONE]``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.response import AllowedNames, ChatStreamGuard, GuardedSSE, ResponsesStreamGuard
from vllm_allowed_tools.response.sse import SSEEvent, SSEFramer

from support.guard import chat_calls

DATA = Path(__file__).parent / "data" / "guard"
NAMES = [tool.name for tool in POOL[:8]]
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}
RESPONSES = ["responses_stream_parallel", "responses_stream_single", "responses_stream_text",
             "responses_stream_auto_happy"]
CHAT = ["chat_stream_parallel", "chat_stream_single", "chat_stream_auto_happy"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def _events(raw: bytes) -> list[SSEEvent]:
    framer = SSEFramer()
    events = framer.feed(raw)
    assert framer.flush() == b""
    return events


RAW = {name: json.loads((DATA / f"{name}.json").read_text())["sse"].encode() for name in RESPONSES + CHAT}
PARSED = {name: [e.json() for e in _events(raw) if e.data != "[DONE]"] for name, raw in RAW.items()}


def _encode(events: list[dict[str, Any]], chat: bool) -> bytes:
    body = b"".join(SSEEvent.encode(e, None if chat else e["type"]) for e in events)
    return body + (b"data: [DONE]\n\n" if chat else b"")


def _responses_calls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e["type"] == "response.output_item.done"
            and e["item"]["type"] == "function_call"]


@dataclass
class Scenario:
    name: str
    variant: str
    api: str
    raw: bytes = field(repr=False)
    calls: list[dict[str, Any]] = field(repr=False)   # [{"id", "call_id", "name", "arguments"}]


@st.composite
def scenarios(draw, with_calls: bool = False) -> Scenario:
    """A recorded stream, or a variant of it (a chat name split over chunks, a late Responses name);
    ``with_calls``: only streams that carry at least one function call."""
    name = draw(st.sampled_from([n for n in RESPONSES + CHAT if not with_calls
                                 or (chat_calls(PARSED[n]) if n.startswith("chat")
                                     else _responses_calls(PARSED[n]))]))
    chat = name.startswith("chat")
    events = copy.deepcopy(PARSED[name])
    variant = draw(st.sampled_from(["recorded", "late_name" if not chat else "split_name"]))
    if chat:
        calls = chat_calls(events)
        if variant == "split_name" and calls:
            index = draw(st.sampled_from(sorted(calls)))
            at = next(i for i, c in enumerate(events)
                      if any(t.get("index") == index and (t.get("function") or {}).get("name")
                             for t in c["choices"][0]["delta"].get("tool_calls") or []))
            full = calls[index]["name"]
            cuts = sorted(draw(st.sets(st.integers(1, len(full) - 1), max_size=4)))
            pieces = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)])]
            split = []
            for n, piece in enumerate(pieces):
                chunk = copy.deepcopy(events[at])
                call = chunk["choices"][0]["delta"]["tool_calls"][0]
                call["function"] = {"name": piece}
                if n:
                    call.pop("id", None), call.pop("type", None)
                split.append(chunk)
            events[at:at + 1] = split
        raw = RAW[name] if variant == "recorded" else _encode(events, chat=True)
        found = [{"id": c["id"], "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]}
                 for _, c in sorted(chat_calls(events).items())]
        return Scenario(name, variant, "chat", raw, found)
    calls = _responses_calls(events)
    if variant == "late_name" and calls:
        late = draw(st.sampled_from(calls))["id"]
        for event in events:
            if event["type"] == "response.output_item.added" and event["item"]["id"] == late:
                event["item"]["name"] = ""
    raw = RAW[name] if variant == "recorded" else _encode(events, chat=False)
    return Scenario(name, variant, "responses", raw, calls)


def _chunked(raw: bytes, sizes: list[int]) -> list[bytes]:
    chunks, at = [], 0
    for size in sizes:
        if at >= len(raw):
            break
        chunks.append(raw[at:at + size])
        at += size
    if at < len(raw):
        chunks.append(raw[at:])
    return chunks


def _guard(raw_chunks: list[bytes], api: str, policy) -> tuple[bytes, GuardedSSE]:
    guard = ChatStreamGuard(policy) if api == "chat" else ResponsesStreamGuard(policy)
    guarded = GuardedSSE(guard)
    out = []
    for chunk in raw_chunks:
        out.append(guarded.feed(chunk))
        if guarded.terminal:        # the caller drops upstream here
            break
    out.append(guarded.close())
    return b"".join(out), guarded


def _scrubbed(event: dict[str, Any]) -> str:
    event = copy.deepcopy(event)
    if isinstance(event.get("response"), dict):
        event["response"].pop("tools", None)
        event["response"].pop("tool_choice", None)
    return json.dumps(event, ensure_ascii=False)


chunk_sizes = st.lists(st.integers(1, 700), max_size=80)


@SETTINGS
@given(scenarios(), chunk_sizes)
def test_allowed_only_streams_pass_through_byte_for_byte(scenario, sizes):
    api, raw = scenario.api, scenario.raw
    out, guarded = _guard(_chunked(raw, sizes), api, AllowedNames(NAMES))
    assert out == raw
    assert not guarded.terminal


@SETTINGS
@given(scenarios(with_calls=True), chunk_sizes, st.data())
def test_disallowed_call_never_leaks_and_ends_with_one_terminal_event(scenario, sizes, data):
    api, raw, calls = scenario.api, scenario.raw, scenario.calls
    assert calls, scenario           # scenarios(with_calls=True) draws only streams with a call
    bad_name = data.draw(st.sampled_from(sorted({call["name"] for call in calls})))
    out, guarded = _guard(_chunked(raw, sizes), api, AllowedNames([n for n in NAMES if n != bad_name]))
    assert guarded.terminal and guarded.violation is not None
    assert guarded.violation.name == bad_name
    events = _events(out)
    bad_calls = [call for call in calls if call["name"] == bad_name]
    if api == "responses":
        parsed = [event.json() for event in events]
        kinds = [event["type"] for event in parsed]
        assert sum(kind in TERMINAL for kind in kinds) == 1 and kinds[-1] == "response.failed"
        assert all(event.event == kind for event, kind in zip(events, kinds))
        numbers = [event["sequence_number"] for event in parsed]
        assert numbers == list(range(len(numbers)))
        text = "".join(_scrubbed(event) for event in parsed)
        for call in bad_calls:
            for needle in (call["id"], call["call_id"], json.dumps(call["name"]),
                           json.dumps(call["arguments"])[1:-1]):
                assert needle not in text
        added = {e["output_index"] for e in parsed if e["type"] == "response.output_item.added"}
        done = {e["output_index"] for e in parsed if e["type"] == "response.output_item.done"}
        assert added == done                       # open items were closed before the end
    else:
        assert events[-1].data == "[DONE]" and sum(e.data == "[DONE]" for e in events) == 1
        parsed = [event.json() for event in events[:-1]]
        assert sum("error" in chunk for chunk in parsed) == 1 and "error" in parsed[-1]
        assert parsed[-1]["error"]["code"] == "allowed_tools_violation"
        assert bad_name.encode() not in out
        emitted = chat_calls(parsed[:-1])
        for call in bad_calls:
            assert call["id"].encode() not in out
            assert all(c["id"] != call["id"] for c in emitted.values())
        # not even a prefix of a refused name: every name fragment sent belongs to an allowed call
        assert all(c["name"] != "" and c["name"] != bad_name and c["name"] in NAMES
                   for c in emitted.values())
    # the emitted output, up to the guard's own terminal events, is a prefix of the input
    prefix = out[:out.index(b"event: response.failed")] if api == "responses" else \
        out[:out.rindex(b"data: {\"error\"")]
    assert raw.startswith(prefix) or _closing_only(prefix, raw)


def _closing_only(prefix: bytes, raw: bytes) -> bool:
    """The prefix is an upstream prefix followed only by the guard's closing output_item.done events."""
    events = _events(prefix)
    upstream = _events(raw)
    n = 0
    while n < len(events) and n < len(upstream) and events[n].raw == upstream[n].raw:
        n += 1
    return all((e.json() or {}).get("type") == "response.output_item.done"
               and e.json()["item"]["status"] == "incomplete" for e in events[n:])
