"""Send one request to a running server and fold what comes back (unary or SSE) into an
:class:`Observed`, the one shape every reliability check judges."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_allowed_tools.request import flat_name

PATHS = {"chat": "/chat/completions", "responses": "/responses"}
MISSING: Any = object()          # a field the request leaves out
REQUEST_TIMEOUT = 60.0           # a request that takes longer is a hang


def log(message: str) -> None:
    """Progress, on stderr (stdout is the figures')."""
    print(message, file=sys.stderr, flush=True)


def base_body(api: str, max_tokens: int, content: str = "Go ahead.") -> dict[str, Any]:
    if api == "chat":
        return {"model": "tiny", "messages": [{"role": "user", "content": content}],
                "max_tokens": max_tokens, "temperature": 1.0}
    return {"model": "tiny", "input": content, "max_output_tokens": max_tokens, "temperature": 1.0}


def read_payload(raw: bytes) -> Any:
    """A non-stream answer's body: its JSON, or the start of its text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:500].decode(errors="replace")


def error_of(payload: Any) -> dict:
    """The error object of a non-2xx answer (its raw text when it is not JSON)."""
    return payload.get("error") if isinstance(payload, dict) else {"raw": payload}


@dataclass
class Observed:
    """What came back for one request."""
    status: int | None = None              # None: no answer (timeout / connection error)
    error: dict | None = None              # the JSON error object of a non-2xx answer
    calls: list[tuple[str | None, str]] = field(default_factory=list)   # (flat name, arguments)
    echoes: list[Any] = field(default_factory=list)   # tool_choice of every Responses object seen
    stream_error: Any = None               # an error event inside a 200 stream
    terminal: bool = True                  # a 200 stream ended with its terminal event
    finish: str | None = None              # finish_reason / response status
    elapsed: float = 0.0
    transport_error: str | None = None


def _responses_output_calls(response: dict) -> list[tuple[str | None, str]]:
    return [(flat_name(item.get("name"), item.get("namespace")),
             item.get("arguments") or item.get("input") or "")
            for item in response.get("output") or [] if isinstance(item, dict)
            and item.get("type") in ("function_call", "custom_tool_call")]


def parse_unary(api: str, status: int, payload: Any, observed: Observed) -> None:
    observed.status = status
    if status != 200 or not isinstance(payload, dict):
        observed.error = error_of(payload)
        return
    if api == "chat":
        choice = (payload.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        observed.calls = [_chat_call(c) for c in message.get("tool_calls") or []]
        observed.finish = choice.get("finish_reason")
    else:
        observed.calls = _responses_output_calls(payload)
        observed.echoes.append(payload.get("tool_choice"))
        observed.finish = payload.get("status")


def _chat_call(call: dict) -> tuple[str | None, str]:
    """(name, arguments) of a Chat ``tool_calls`` entry: a function's, or a custom tool's input."""
    function, custom = call.get("function") or {}, call.get("custom") or {}
    return (flat_name(function.get("name") or custom.get("name")),
            function.get("arguments") or custom.get("input") or "")


def _fold_chat_event(event: dict, observed: Observed, calls: dict[int, list[str]]) -> None:
    if "error" in event or event.get("object") == "error":
        observed.stream_error = event.get("error") or event
        return
    for choice in event.get("choices") or []:
        if choice.get("finish_reason"):
            observed.finish = choice["finish_reason"]
        for call in (choice.get("delta") or {}).get("tool_calls") or []:
            entry = calls.setdefault(call.get("index", 0), ["", ""])
            function = call.get("function") or call.get("custom") or {}
            entry[0] += function.get("name") or ""
            entry[1] += function.get("arguments") or function.get("input") or ""


def _fold_responses_event(event: dict, observed: Observed, calls: dict[int, list[str]]) -> Any:
    """Fold one Responses event; returns its final response object when it is a terminal event
    (MISSING otherwise)."""
    kind = event.get("type")
    final = MISSING
    if isinstance(event.get("response"), dict):
        observed.echoes.append(event["response"].get("tool_choice"))
    if kind in ("error", "response.failed"):
        observed.stream_error = event.get("error") or event.get("response", {}).get("error") \
            or event
    if kind in ("response.completed", "response.incomplete", "response.failed"):
        final = event.get("response")
        observed.terminal = kind != "response.failed"
        observed.finish = (final or {}).get("status")
    if kind == "response.output_item.added" and isinstance(event.get("item"), dict):
        item = event["item"]
        if item.get("type") in ("function_call", "custom_tool_call") and item.get("name"):
            # a name at `added` already reached the client, whatever happens later
            calls.setdefault(1000 + int(event.get("output_index", 0)),
                             [flat_name(item.get("name"), item.get("namespace")) or "", ""])
    return final


def parse_stream(api: str, lines: Iterable[str], observed: Observed) -> None:
    """Fold the ``data:`` lines of a 200 SSE stream into `observed`."""
    observed.terminal = False
    calls: dict[int, list[str]] = {}
    final: dict | None = None
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            observed.terminal = api == "chat"
            continue
        try:
            event = json.loads(data)
        except ValueError:
            observed.stream_error = {"unparseable": data[:200]}
            continue
        if not isinstance(event, dict):
            continue
        if api == "chat":
            _fold_chat_event(event, observed, calls)
        else:
            terminal = _fold_responses_event(event, observed, calls)
            final = final if terminal is MISSING else terminal
    if api == "chat":
        observed.calls = [(calls[i][0] or None, calls[i][1]) for i in sorted(calls)]
    else:
        named = {name for name, _ in (calls[i] for i in calls)}
        observed.calls = _responses_output_calls(final or {})
        seen = {name for name, _ in observed.calls}
        observed.calls += [(name, "") for name in sorted(named - seen)]


def send_sync(client: httpx.Client, base_url: str, api: str, body: Any, stream: bool) -> Observed:
    """One request (`body` a dict, or raw bytes sent as JSON), read to its end or its timeout."""
    observed = Observed()
    start = time.monotonic()
    url = base_url + PATHS[api]
    kwargs: dict[str, Any] = ({"content": body, "headers": {"content-type": "application/json"}}
                              if isinstance(body, bytes) else {"json": body})
    try:
        if not stream:
            response = client.post(url, **kwargs)
            try:
                payload = response.json()
            except ValueError:
                payload = response.text[:500]
            parse_unary(api, response.status_code, payload, observed)
        else:
            with client.stream("POST", url, **kwargs) as response:
                if response.status_code != 200 or \
                        not response.headers.get("content-type", "").startswith("text/event-stream"):
                    parse_unary(api, response.status_code, read_payload(response.read()), observed)
                else:
                    observed.status = 200
                    parse_stream(api, _lines_until(response, start + REQUEST_TIMEOUT), observed)
    except httpx.HTTPError as exc:
        observed.status = None
        observed.transport_error = f"{type(exc).__name__}: {exc}"
    observed.elapsed = time.monotonic() - start
    return observed


def _lines_until(response: httpx.Response, deadline: float) -> Iterable[str]:
    for line in response.iter_lines():
        if time.monotonic() > deadline:
            raise httpx.ReadTimeout("stream exceeded the request timeout")
        yield line


async def send_async(client: httpx.AsyncClient, base_url: str, api: str, body: dict) -> Observed:
    """A streaming request, read to its end."""
    observed = Observed()
    start = time.monotonic()
    try:
        async with client.stream("POST", base_url + PATHS[api], json=body) as response:
            if response.status_code != 200:
                parse_unary(api, response.status_code, read_payload(await response.aread()),
                            observed)
            else:
                observed.status = 200
                parse_stream(api, [line async for line in response.aiter_lines()], observed)
    except httpx.HTTPError as exc:
        observed.status = None
        observed.transport_error = f"{type(exc).__name__}: {exc}"
    observed.elapsed = time.monotonic() - start
    return observed
