"""ASGI middleware: the request path into vLLM (``--middleware`` on vLLM 0.32 and 0.33).

It runs before FastAPI validates anything, which Chat Completions needs (vLLM rejects the
``allowed_tools`` shape at validation) and which lets an invalid selection fail with our 400 before
the engine sees the request. It imports nothing from vLLM: it speaks plain ASGI, so it is the same
on every vLLM version.

Launch: ``vllm serve ... --middleware vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware``
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from ..errors import AllowedToolsError
from ..rewrite import Api, restore_echo, rewrite_request
from ..sse import SSEEvent, SSEFramer

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_ROUTES: dict[str, Api] = {"/v1/chat/completions": "chat", "/v1/responses": "responses",
                           "/v1/chat/completions/render": "chat", "/v1/responses/render": "responses"}


def api_for_path(path: str) -> Api | None:
    return _ROUTES.get(path.rstrip("/"))


async def _read_body(receive: Receive) -> tuple[bytes, bool]:
    """The whole request body; the flag says the client disconnected while sending it."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that yields `body` once, then defers to the real one (for http.disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_content_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return kept + [(b"content-length", str(length).encode())]


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _EchoRestoringSend:
    """Wraps `send` for a Responses request: put the client's tool_choice back in every response
    object, unary (JSON body) or streamed (SSE events carrying `response`)."""

    def __init__(self, send: Send, original_tool_choice: Any) -> None:
        self._send = send
        self._original = original_tool_choice
        self._mode: str | None = None
        self._start: Message | None = None
        self._buffer = b""
        self._framer = SSEFramer()

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if content_type.startswith(b"application/json"):
                self._mode, self._start = "json", message   # hold until the body is complete
                return
            self._mode = "sse" if content_type.startswith(b"text/event-stream") else "raw"
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._mode == "raw":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._mode == "json":
            self._buffer += message.get("body", b"")
            if more:
                return
            body = self._buffer
            try:
                body = json.dumps(restore_echo(json.loads(body), self._original)).encode()
            except ValueError:
                pass
            start = dict(self._start or {})
            start["headers"] = _with_content_length(list(start.get("headers", [])), len(body))
            await self._send(start)
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        out = []
        for event in self._framer.feed(message.get("body", b"")):
            data = event.json()
            if isinstance(data, dict) and isinstance(data.get("response"), dict):
                restore_echo(data["response"], self._original)
                out.append(SSEEvent.encode(data, event.event))
            else:
                out.append(event.raw)
        if not more:
            out.append(self._framer.flush())
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})


class AllowedToolsMiddleware:
    """Resolve and rewrite allowed-tools requests; answer invalid selections with a 400."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        import sys

        from .capabilities import check_server_args
        check_server_args(sys.argv)   # fail at start-up, not per request, when we could not enforce
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = api_for_path(scope.get("path", "")) if scope.get("type") == "http" else None
        if api is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):   # vLLM answers malformed JSON itself
            await self.app(scope, _replay(body, receive), send)
            return
        try:
            rewritten = rewrite_request(data, api)
        except AllowedToolsError as exc:
            await _send_json(send, exc.status, exc.to_openai())
            return
        if rewritten.changed:
            body = json.dumps(rewritten.body).encode()
            scope = dict(scope, headers=_with_content_length(list(scope.get("headers", [])), len(body)))
        if api == "responses" and rewritten.policy is not None and rewritten.policy.has_allowlist:
            send = _EchoRestoringSend(send, rewritten.original_tool_choice)
        await self.app(scope, _replay(body, receive), send)
