"""SSE framing exactly as the WHATWG spec says, and the guard over any framing and chunking.

* Property: random event streams, encoded with random line endings (LF, CR, CRLF, mixed), fed to
  :class:`~vllm_allowed_tools.response.sse.SSEFramer` in random chunkings (cuts between a CR and its LF
  included) yield exactly the events of the unsplit stream, which are the events that were encoded.
* The guard (:class:`~vllm_allowed_tools.response.GuardedSSE`) over recorded vLLM streams re-framed
  with CRLF / CR and cut between CR and LF: a disallowed call is caught, allowed streams pass byte
  for byte; data it cannot read ends the stream as a violation; a partial trailing event is not
  forwarded.
* The middleware's response side (``_GuardedSend``, driven as a fake ASGI app would): header names
  and media types compared case-insensitively, and a 2xx answer the guard cannot read refused with
  a 500 ``allowed_tools_violation`` (counted as ``unreadable``).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_allowed_tools import metrics
from vllm_allowed_tools.devtools.models.tool_pool import POOL
from vllm_allowed_tools.response import AllowedNames, ChatStreamGuard, GuardedSSE, ResponsesStreamGuard
from vllm_allowed_tools.response.sse import SSEEvent, SSEFramer

DATA = Path(__file__).parent / "data" / "guard"
NAMES = [tool.name for tool in POOL[:8]]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
ENDINGS = [b"\n", b"\r", b"\r\n"]


def recorded(name: str) -> bytes:
    return json.loads((DATA / f"{name}.json").read_text())["sse"].encode()


def frame_all(chunks: list[bytes]) -> tuple[list[tuple[bytes, str | None, str | None]], bytes]:
    """(the events of a whole stream fed in these chunks, as (raw, event, data); the rest)."""
    framer = SSEFramer()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events += framer.feed(chunk)
    events += framer.close()
    return [(e.raw, e.event, e.data) for e in events], framer.flush()


def cut(raw: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p for p in points if 0 < p < len(raw)})
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)])]


def cr_lf_cuts(raw: bytes) -> list[int]:
    """Every position between a CR and the LF after it."""
    return [i + 1 for i in range(len(raw) - 1) if raw[i:i + 2] == b"\r\n"]


# ------------------------------------------------------------------------------- random streams

# field values: anything but CR and LF, with the characters str.splitlines() would break on
_SPECIAL = ["\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029", "\ufeff", ":", " "]
values = st.lists(st.one_of(st.sampled_from(_SPECIAL),
                            st.text(st.characters(blacklist_characters="\r\n",
                                                  blacklist_categories=("Cs",)), max_size=6)),
                  max_size=5).map("".join)


@st.composite
def lines_of_event(draw) -> tuple[list[str], str | None, str | None]:
    """The lines of one event (no empty line among them) and its expected (event, data)."""
    lines: list[str] = []
    event: str | None = None
    data: list[str] = []
    for kind in draw(st.lists(st.sampled_from(
            ["data", "data", "event", "comment", "other", "bare_data", "bare_event", "wrong_case"]),
            max_size=6)):
        value = draw(values)
        spaced = value.startswith(" ") or draw(st.booleans())
        sep = ": " if spaced else ":"
        if kind == "data":
            lines.append(f"data{sep}{value}")
            data.append(value)
        elif kind == "event":
            lines.append(f"event{sep}{value}")
            event = value
        elif kind == "comment":
            lines.append(f":{value}")
        elif kind == "other":
            lines.append(f"id{sep}{value}")
        elif kind == "bare_data":              # no colon: the field's value is empty
            lines.append("data")
            data.append("")
        elif kind == "bare_event":
            lines.append("event")
            event = ""
        else:
            lines.append(f"Data{sep}{value}")  # field names are case-sensitive: ignored
    return lines, event, ("\n".join(data) if data else None)


@st.composite
def streams(draw) -> tuple[bytes, list[tuple[bytes, str | None, str | None]]]:
    """A stream with random line endings and the (raw, event, data) of each of its events."""
    bom = draw(st.booleans())
    out, expected = bytearray(b"\xef\xbb\xbf" if bom else b""), []
    previous = b""
    for lines, event, data in draw(st.lists(lines_of_event(), max_size=6)):
        start = 0 if not expected else len(out)
        for line in [*lines, ""]:
            choices = ENDINGS
            if previous == b"\r" and line == "":   # CR then LF would be one CRLF, not two line ends
                choices = [b"\r", b"\r\n"]
            previous = draw(st.sampled_from(choices))
            out += line.encode() + previous
        expected.append((bytes(out[start:]), event, data))
    return bytes(out), expected


@SETTINGS
@given(streams(), st.lists(st.integers(0, 400), max_size=30), st.data())
def test_framer_yields_the_encoded_events_in_every_chunking(stream, points, data):
    raw, expected = stream
    assume(raw)
    left = b"" if expected else raw   # a lone byte order mark is no event
    whole, rest = frame_all([raw])
    assert whole == expected and rest == left
    cuts = points + data.draw(st.lists(st.sampled_from(cr_lf_cuts(raw) or [0]), max_size=4))
    chunked, rest = frame_all(cut(raw, cuts))
    assert chunked == expected and rest == left


@SETTINGS
@given(streams(), st.binary(max_size=20).filter(lambda b: b"\r" not in b and b"\n" not in b),
       st.lists(st.integers(0, 400), max_size=10))
def test_bytes_are_kept_exactly_and_a_partial_event_is_never_dispatched(stream, tail, points):
    raw, expected = stream
    assume(tail)
    events, rest = frame_all(cut(raw + tail, points))
    assert events == expected and rest == (tail if expected else raw + tail)
    assert b"".join(e[0] for e in events) + rest == raw + tail


def test_a_final_cr_is_decided_at_the_end_of_the_stream():
    framer = SSEFramer()
    assert framer.feed(b"data: a\r\r") == []           # the second CR may still be half a CRLF
    (event,) = framer.close()
    assert (event.raw, event.data) == (b"data: a\r\r", "a")
    framer = SSEFramer()
    assert framer.feed(b"data: a\r\n\r") == []
    assert [(e.raw, e.data) for e in framer.feed(b"\ndata: b\r\n\r\n")] == [
        (b"data: a\r\n\r\n", "a"), (b"data: b\r\n\r\n", "b")]


def test_only_cr_and_lf_end_lines():
    payload = json.dumps({"text": "a\u2028b\x85c\x0cd\x1ce"}, ensure_ascii=False)
    (event,) = SSEFramer().feed(f"data: {payload}\n\n".encode())
    assert event.json() == {"text": "a\u2028b\x85c\x0cd\x1ce"}


# ------------------------------------------------------------------------- the guard, re-framed

def reframe(raw: bytes, endings: list[bytes]) -> bytes:
    """An LF-framed stream with each line end replaced by the next of `endings` (cycled)."""
    lines = raw.split(b"\n")[:-1]
    out, previous = bytearray(), b""
    for n, line in enumerate(lines):
        ending = endings[n % len(endings)]
        if previous == b"\r" and line == b"" and ending == b"\n":
            ending = b"\r\n"
        out += line + ending
        previous = ending
    return bytes(out)


def guard_chunks(chunks: list[bytes], api: str, policy) -> tuple[bytes, GuardedSSE]:
    guarded = GuardedSSE(ChatStreamGuard(policy) if api == "chat" else ResponsesStreamGuard(policy))
    out = []
    for chunk in chunks:
        out.append(guarded.feed(chunk))
        if guarded.terminal:
            break
    out.append(guarded.close())
    return b"".join(out), guarded


STREAMS = [("chat_stream_single", "chat"), ("chat_stream_parallel", "chat"),
           ("responses_stream_single", "responses"), ("responses_stream_parallel", "responses")]


def called_names(raw: bytes) -> set[str]:
    names = set()
    for event in frame_all([raw])[0]:
        data = SSEEvent(*event).json() or {}
        item = data.get("item") or {}
        if item.get("type") == "function_call" and item.get("name"):
            names.add(item["name"])
        for choice in data.get("choices") or ():
            for call in (choice.get("delta") or {}).get("tool_calls") or ():
                if (call.get("function") or {}).get("name"):
                    names.add(call["function"]["name"])
    return names


@pytest.mark.parametrize("endings", [[b"\r\n"], [b"\r"], [b"\r\n", b"\n", b"\r"]],
                         ids=["crlf", "cr", "mixed"])
@pytest.mark.parametrize("name,api", STREAMS)
def test_a_disallowed_call_is_caught_when_cr_and_lf_cross_a_chunk_boundary(name, api, endings):
    raw = reframe(recorded(name), endings)
    chunks = cut(raw, cr_lf_cuts(raw)) if b"\r\n" in raw else cut(raw, list(range(0, len(raw), 7)))
    names = sorted(called_names(recorded(name)))
    assert names and called_names(raw) == set(names)
    for bad in names:
        before = metrics.snapshot()["violations"].get("stream_guard", 0)
        out, guarded = guard_chunks(chunks, api, AllowedNames([n for n in NAMES if n != bad]))
        assert guarded.terminal and guarded.violation is not None and guarded.violation.name == bad
        assert metrics.snapshot()["violations"].get("stream_guard", 0) == before + 1
        events = [SSEEvent(*e) for e in frame_all([out])[0]]
        if api == "chat":
            assert events[-1].data == "[DONE]"
            assert events[-2].json()["error"]["code"] == "allowed_tools_violation"
            assert bad.encode() not in out
        else:
            assert events[-1].json()["type"] == "response.failed"
            sent = [e.json() for e in events[:-1]]
            assert not any((e.get("item") or {}).get("name") == bad for e in sent)
    # allowed: byte for byte, CRs and all
    out, guarded = guard_chunks(chunks, api, AllowedNames(NAMES))
    assert out == raw and not guarded.terminal


@given(st.sampled_from(STREAMS), st.lists(st.sampled_from(ENDINGS), min_size=1, max_size=4),
       st.lists(st.integers(0, 3000), max_size=40), st.data())
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_guard_reads_every_framing_and_chunking(stream, endings, points, data):
    name, api = stream
    raw = reframe(recorded(name), endings)
    names = sorted(called_names(recorded(name)))
    chunks = cut(raw, points + data.draw(st.lists(st.sampled_from(cr_lf_cuts(raw) or [0]),
                                                  max_size=20)))
    out, guarded = guard_chunks(chunks, api, AllowedNames(NAMES))
    assert out == raw and not guarded.terminal
    bad = data.draw(st.sampled_from(names))
    out, guarded = guard_chunks(chunks, api, AllowedNames([n for n in NAMES if n != bad]))
    assert guarded.terminal and guarded.violation.name == bad


def _chat_chunk(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "tiny",
            "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": 0, "id": "call_1", "type": "function",
                 "function": {"name": name, "arguments": arguments}}]}, "finish_reason": None}]}


def test_a_call_whose_data_holds_a_unicode_line_separator_is_still_read():
    """str.splitlines() broke data at U+2028 / U+0085: the JSON did not parse and passed unread."""
    for separator in ("\u2028", "\x85", "\x0c"):
        raw = SSEEvent.encode(_chat_chunk("evil", json.dumps({"x": f"a{separator}b"},
                                                            ensure_ascii=False)))
        raw = raw.replace(b"\\u2028", "\u2028".encode())
        out, guarded = guard_chunks([raw, b"data: [DONE]\n\n"], "chat", AllowedNames(NAMES))
        assert guarded.terminal and guarded.violation.name == "evil"
        assert b"evil" not in out


@pytest.mark.parametrize("data", [b"not json", b"[1, 2]", b"\"text\"", b"null", b"{\"a\": 1"])
def test_an_event_the_guard_cannot_read_ends_the_stream(data):
    before = metrics.snapshot()["violations"].get("unreadable", 0)
    raw = b"data: " + data + b"\n\n" + SSEEvent.encode(_chat_chunk("get_weather", "{}"))
    out, guarded = guard_chunks([raw], "chat", AllowedNames(NAMES))
    assert guarded.terminal and guarded.violation.source == "unreadable"
    assert metrics.snapshot()["violations"]["unreadable"] == before + 1
    events = [SSEEvent(*e) for e in frame_all([out])[0]]
    assert [e.data for e in events][-1] == "[DONE]"
    assert events[0].json()["error"]["code"] == "allowed_tools_violation"
    assert b"data: " + data not in out and b"get_weather" not in out
    # Responses: one response.failed
    out, guarded = guard_chunks([b"event: x\ndata: " + data + b"\n\n"], "responses",
                                AllowedNames(NAMES))
    assert guarded.terminal
    (event,) = [SSEEvent(*e) for e in frame_all([out])[0]]
    assert event.json()["type"] == "response.failed"
    assert event.json()["response"]["error"]["code"] == "allowed_tools_violation"


def test_events_without_data_pass_and_a_partial_trailing_event_is_not_forwarded():
    keepalive = b": ping\r\n\r\nevent: x\r\r"
    partial = SSEEvent.encode(_chat_chunk("evil", "{}"))[:-1]     # no closing empty line
    out, guarded = guard_chunks([keepalive, partial], "chat", AllowedNames(NAMES))
    assert out == keepalive and not guarded.terminal


# -------------------------------------------------------------------------------- the middleware

def _chat_body(name: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "tiny", "choices": [
        {"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": name, "arguments": "{}"}}]}}]}


def _serve(status: int, headers: list[tuple[bytes, bytes]], bodies: list[bytes], *,
           tools: bool = True) -> tuple[int, dict[bytes, bytes], bytes, bool]:
    """Send a fake app's answer (status, headers, bodies) through the middleware's response side,
    ``_GuardedSend``, as it wraps a plain Chat request (``tool_choice: required`` over two pool
    tools; ``tools=False``: no tools, so no policy): (status, lowercased headers, body the client
    got, whether the app was told to stop)."""
    from support.guard import send_plan
    from vllm_allowed_tools.asgi.guarded_send import GuardedSend as _GuardedSend, StopSignal as _Stop

    policy = AllowedNames(tool.name for tool in POOL[:2]) if tools else None
    stop = _Stop()
    sent: list[dict[str, Any]] = []

    async def client_send(message):
        sent.append(message)

    async def client_receive():
        await asyncio.sleep(3600)

    async def app():
        send = _GuardedSend(client_send, send_plan("chat", policy), stop, (2, 3))
        receive = stop.receive(b"{}", client_receive)
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for n, body in enumerate(bodies):
            more = n < len(bodies) - 1
            await send({"type": "http.response.body", "body": body, "more_body": more})
            if more and stop.event.is_set():
                return (await receive())["type"] == "http.disconnect"
        return False

    told_to_stop = asyncio.run(app())
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    return start["status"], {k.lower(): v for k, v in start["headers"]}, body, told_to_stop


def _unreadable() -> int:
    return metrics.snapshot()["violations"].get("unreadable", 0)


@pytest.mark.parametrize("content_type", [b"Application/Json", b"APPLICATION/JSON; Charset=UTF-8",
                                          b"application/json;charset=utf-8"])
def test_json_answers_are_guarded_whatever_the_case_of_their_header(content_type):
    bad = json.dumps(_chat_body("evil")).encode()
    status, _, body, _ = _serve(200, [(b"Content-Type", content_type)], [bad])
    assert status == 500 and json.loads(body)["error"]["code"] == "allowed_tools_violation"
    assert b"evil" in body   # the unary message names the refused tool; the call itself is not sent
    assert b"call_1" not in body
    good = json.dumps(_chat_body(POOL[0].name)).encode()
    status, _, body, _ = _serve(201, [(b"CONTENT-TYPE", content_type)], [good[:10], good[10:]])
    assert status == 201 and body == good


@pytest.mark.parametrize("headers", [[(b"content-type", b"text/plain")], [],
                                     [(b"Content-Type", b"application/octet-stream")],
                                     [(b"content-type", b"application/json"),
                                      (b"content-type", b"text/plain")],
                                     [(b"content-type", b"application/json"),
                                      (b"Content-Encoding", b"gzip")]],
                         ids=["text-plain", "missing", "octet-stream", "two-types", "gzip"])
def test_an_answer_the_guard_cannot_read_is_refused(headers):
    before = _unreadable()
    bad = json.dumps(_chat_body("evil")).encode()
    status, got, body, _ = _serve(200, headers, [bad])
    assert status == 500 and got[b"content-type"] == b"application/json"
    error = json.loads(body)["error"]
    assert error["code"] == "allowed_tools_violation" and error["type"] == "server_error"
    assert b"evil" not in body and int(got[b"content-length"]) == len(body)
    assert _unreadable() == before + 1


def test_a_stream_the_guard_cannot_read_is_refused_and_stopped():
    before = _unreadable()
    chunks = [SSEEvent.encode(_chat_chunk("evil", "{}")), b"data: [DONE]\n\n"]
    status, _, body, stopped = _serve(200, [(b"content-type", b"text/x-stream")], chunks)
    assert status == 500 and b"evil" not in body and stopped
    assert json.loads(body)["error"]["code"] == "allowed_tools_violation"
    assert _unreadable() == before + 1


@pytest.mark.parametrize("body", [b"not json", b"[1]", b"", b"{\"choices\": "])
def test_a_json_answer_that_does_not_parse_is_refused(body):
    before = _unreadable()
    status, _, got, _ = _serve(200, [(b"content-type", b"application/json")], [body])
    assert status == 500 and json.loads(got)["error"]["code"] == "allowed_tools_violation"
    assert _unreadable() == before + 1


@pytest.mark.parametrize("content_type", [b"TEXT/EVENT-STREAM", b"Text/Event-Stream; charset=utf-8"])
def test_event_streams_are_guarded_whatever_the_case_of_their_header(content_type):
    chunks = [SSEEvent.encode(_chat_chunk("evil", "")),
              SSEEvent.encode(_chat_chunk("", "{}")), b"data: [DONE]\n\n"]
    status, _, body, stopped = _serve(200, [(b"Content-Type", content_type)], chunks)
    assert status == 200 and b"evil" not in body and stopped
    events = [SSEEvent(*e) for e in frame_all([body])[0]]
    assert events[0].json()["error"]["code"] == "allowed_tools_violation"
    assert events[-1].data == "[DONE]"
    good = [SSEEvent.encode(_chat_chunk(POOL[0].name, "{}")), b"data: [DONE]\n\n"]
    status, _, body, _ = _serve(200, [(b"Content-Type", content_type)], good)
    assert status == 200 and body == b"".join(good)


def test_error_answers_and_requests_without_tools_pass_as_they_are():
    error = b'{"error": {"message": "bad", "code": 400}}'
    assert _serve(400, [(b"content-type", b"text/plain")], [error])[::2] == (400, error)
    assert _serve(503, [], [b"down"])[::2] == (503, b"down")
    bad = json.dumps(_chat_body("evil")).encode()
    assert _serve(200, [(b"content-type", b"text/plain")], [bad], tools=False)[::2] == (200, bad)


@pytest.mark.parametrize("content_type", [b"application/json", b"text/event-stream"])
def test_a_body_sent_past_the_guard_is_refused(content_type):
    """``http.response.pathsend`` (a body from a file, an ASGI extension) never passes the guard."""
    from support.guard import send_plan
    from vllm_allowed_tools.asgi.guarded_send import GuardedSend as _GuardedSend, StopSignal as _Stop

    before = _unreadable()
    sent: list[dict[str, Any]] = []

    async def client_send(message):
        sent.append(message)

    async def run():
        send = _GuardedSend(client_send, send_plan("chat", AllowedNames(NAMES)), _Stop(), (2, 3))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.pathsend", "path": "/etc/hostname"})

    asyncio.run(run())
    assert [m["type"] for m in sent].count("http.response.start") == 1
    assert all(m["type"] != "http.response.pathsend" for m in sent)
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"allowed_tools_violation" in body
    assert _unreadable() == before + 1
