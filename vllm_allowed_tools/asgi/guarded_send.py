"""The response side of the middleware: an ASGI ``send`` that lets no unjudged tool call out.

While an allowlist or a catalog applies, every 2xx answer is guarded (a JSON body as a whole, an
event stream event by event); one it cannot read is refused like a call outside the allowlist. The rules:
``docs/response-path.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ..approvals.approval_errors import GrantStoreUnavailable
from ..approvals.stream import ApprovalStream
from ..errors import AllowedToolsError
from ..metrics import record_violation
from ..request.rewrite import Api, restore_echo
from ..response import (
    AllowedToolsViolation,
    ChatStreamGuard,
    GuardedSSE,
    ResponsesStream,
    ResponsesStreamGuard,
    check_chat_completion,
    check_responses_object,
    unreadable_violation,
)
from ..response.asgi import Message, Receive, Send
from ..response.chat_custom import restore_completion
from ..response.contract import NAMES_ONLY, OutputContract
from ..response.conformance import conformed_event, conformed_response
from ..response.conformance_check import CheckLog
from .turn_plan import TurnPlan

logger = logging.getLogger("vllm_allowed_tools.asgi.guarding_middleware")   # the middleware's log

#: ASGI extensions that send a response body without ``http.response.body`` messages
_BODY_ELSEWHERE = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


def with_content_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return kept + [(b"content-length", str(length).encode())]


def error_headers(exc: Exception) -> list[tuple[bytes, bytes]]:
    retry = getattr(exc, "retry_after", None)
    return [(b"retry-after", str(retry).encode())] if retry else []


def log_store_down(exc: GrantStoreUnavailable) -> None:
    logger.error("vllm-allowed-tools: grant store unavailable, gated calls refused (503): %s",
                 exc.detail)


class StopSignal:
    """Set once a stream was ended by the guard: the app is then told the client went away (its
    streaming response stops and vLLM aborts the engine request) and anything it still sends is
    dropped."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def receive(self, body: bytes, receive: Receive) -> Receive:
        """Replay `body` once, then the real receive, raced against the stop signal."""
        sent = False

        async def guarded_receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            if self.event.is_set():
                return {"type": "http.disconnect"}
            real = asyncio.ensure_future(receive())
            stop = asyncio.ensure_future(self.event.wait())
            try:
                done, _ = await asyncio.wait({real, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:   # also when the app cancels this receive: leave no task pending
                for task in (real, stop):
                    if not task.done():
                        task.cancel()
            if real in done:
                message = real.result()
                if message.get("type") == "http.disconnect":
                    # the client left: every other listener (Starlette's, vLLM's) hears it too,
                    # even one still waiting on a receive the server already woke once
                    self.event.set()
                return message
            return {"type": "http.disconnect"}

        return guarded_receive


def _media_type(headers: Any) -> tuple[str | None, bool]:
    """(the response's media type, lowercased without parameters or None when it has none; whether
    its body is encoded, e.g. compressed). Header names are compared case-insensitively (ASGI says
    lowercase; nothing here relies on it). Several different content types read as none."""
    types: set[str] = set()
    encoded = False
    for name, value in headers or ():
        name = bytes(name).lower()
        text = bytes(value).decode("latin-1").split(";", 1)[0].strip().lower()
        if name == b"content-type":
            types.add(text)
        elif name == b"content-encoding" and text not in ("", "identity"):
            encoded = True
    return (types.pop() if len(types) == 1 else None), encoded


def _is_2xx(status: Any) -> bool:
    return isinstance(status, int) and 200 <= status < 300


class GuardedSend:
    """Wraps `send`: the output guard on every call leaving the server, the approvals on every
    Responses function call, and, for an allowed-tools Responses request, the client's own
    tool_choice restored in every response object. Non-2xx answers pass as they are: they are
    vLLM's own error bodies, which never carry a tool call.

    ``commit``: the request's grant-store writes, made when vLLM's answer starts with a 2xx status
    and before any of it goes out (a request vLLM refuses changes nothing); one that fails is
    answered instead of vLLM's answer. ``contract``: the turn's backstops (a call required,
    arguments checked), judged on the model's output before the approvals rewrite it. All of it
    is read from the turn's :class:`.turn_plan.TurnPlan`."""

    def __init__(self, send: Send, plan: TurnPlan, stop: StopSignal,
                 spec_version: tuple[int, ...], *, check_log: CheckLog | None = None) -> None:
        api = plan.api
        #: Chat: the request's custom tools, whose function calls go out as custom calls
        self._custom_names = plan.custom_names if api == "chat" else frozenset()
        self._server_turn = plan.server_turn   # the server-side calls vLLM's loop decided
        self._contract = plan.contract if plan.contract is not None else NAMES_ONLY
        self._approvals = plan.approvals
        self._commit = plan.commit
        self._send = send
        self._api = api
        self._call_filter = plan.call_filter
        self._echo = plan.echo   # Responses fields to echo as the client sent them (restore_echo)
        self._stop = stop
        self._spec_version = spec_version
        self._mode: str | None = None
        self._start: Message | None = None
        self._buffer = b""
        self._guard: GuardedSSE | None = None
        self._finished = False
        self._quiet = False     # what the app still sends is dropped without an error
        self._unreadable = ""   # what made a 2xx answer unreadable
        self._check_log = check_log if api == "responses" else None   # the check mode's log
        self._stream_check: Any = None

    async def __call__(self, message: Message) -> None:
        if self._finished:
            if self._spec_version >= (2, 4) and not self._quiet:
                raise OSError("the allowed-tools guard ended this stream")
            return   # the app is being told the client left; drop what it still sends
        kind = message["type"]
        if kind == "http.response.start":
            if self._commit is not None and _is_2xx(message.get("status")) \
                    and not await self._committed():
                return
            if self._begin(message):
                await self._send(message)
        elif self._mode != "raw" and kind in _BODY_ELSEWHERE:
            # a body the guard never sees (sent from a file by the server): refused like any
            # other body it cannot read
            await self._end(unreadable_violation(f"a body sent as {kind}"))
        elif kind != "http.response.body" or self._mode == "raw":
            await self._send(message)
        elif self._mode == "unreadable":
            await self._refuse(unreadable_violation(f"a 2xx answer with {self._unreadable}"),
                               stop=message.get("more_body", False))
        elif self._mode == "json":
            await self._unary(message)
        else:
            await self._stream(message)

    async def _committed(self) -> bool:
        """Make the request's store writes (vLLM accepted it); False: they failed and the error
        was answered instead (the app is told the client left)."""
        commit, self._commit = self._commit, None
        try:
            await asyncio.to_thread(commit)   # type: ignore[arg-type]
        except AllowedToolsError as exc:   # another answer won meanwhile (409), the store is down
            if isinstance(exc, GrantStoreUnavailable):
                log_store_down(exc)
            self._finished = self._quiet = True
            body = json.dumps(exc.to_openai()).encode()
            await self._send({"type": "http.response.start", "status": exc.status,
                              "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode()),
                                          *error_headers(exc)]})
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            self._stop.event.set()
            return False
        return True

    def _begin(self, start: Message) -> bool:
        """Choose how the answer is guarded; whether its start goes out now."""
        status = start.get("status")
        media, encoded = _media_type(start.get("headers"))
        readable = not encoded and media in ("application/json", "text/event-stream")
        if not _is_2xx(status) or (self._call_filter is None
                                   and not (self._api == "responses" and readable)):
            # vLLM's own error body, or nothing to judge by: no tool calls in it (a Responses
            # answer still goes through the Open Responses fixer)
            self._mode = "raw"
            return True
        if not readable:
            self._mode = "unreadable"   # refused at the first body
            self._unreadable = ("an encoded (compressed) body" if encoded else
                                f"content type {media!r}" if media else "no single content type")
            return False
        if media == "application/json":
            self._mode, self._start = "json", start   # held until the body is complete
            return False
        self._mode = "sse"
        self._guard = GuardedSSE(self._responses_stream() if self._api == "responses"
                                 else ChatStreamGuard(self._call_filter, contract=self._contract,
                                                      custom_names=self._custom_names))
        if self._check_log is not None:
            self._stream_check = self._check_log.stream()
        return True

    def _responses_stream(self) -> ResponsesStream:
        """The guard, then the approvals, on one stream that makes every event it sends conform
        to Open Responses and restores the client's echo (no guard for a request without tools)."""
        echo = self._echo
        stream = ResponsesStream(restore=(lambda response: restore_echo(response, echo))
                                 if echo else None, conform=conformed_event)
        if self._call_filter is not None:   # first: it judges the model's own output
            ResponsesStreamGuard(self._call_filter, stream=stream, contract=self._contract)
        if self._approvals is not None:
            ApprovalStream(self._approvals, stream=stream)
        if self._server_turn is not None:
            from ..server_tools.response import ServerToolStream
            ServerToolStream(self._server_turn, stream)
        return stream

    async def _unary(self, message: Message) -> None:
        self._buffer += message.get("body", b"")
        if message.get("more_body", False):
            return
        start = dict(self._start or {})
        if self._stop.event.is_set():
            # the client left before the answer was ready: vLLM's handler was cancelled
            # (``with_cancellation``) and FastAPI answers its None as a 200 ``null`` to nobody.
            # Nothing goes out, so nothing is refused, counted or logged as a violation.
            self._finished = self._quiet = True
            logger.debug("vllm-allowed-tools: the client left before its unary answer; dropped")
            return
        try:
            data = json.loads(self._buffer)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            await self._refuse(unreadable_violation("a JSON body that does not parse to an object"),
                               stop=False)
            return
        try:
            body = await self._judged_body(data)
        except AllowedToolsViolation as violation:
            logger.error("vllm-allowed-tools: refused an answer (%s): %s",
                         violation.reason or "a call outside the policy", violation)
            body = json.dumps(violation.to_openai()).encode()
            start["status"] = violation.status
        except GrantStoreUnavailable as exc:
            log_store_down(exc)
            body = json.dumps(exc.to_openai()).encode()
            start["status"] = exc.status
            start["headers"] = list(start.get("headers", [])) + error_headers(exc)
        start["headers"] = with_content_length(list(start.get("headers", [])), len(body))
        if self._check_log is not None and _is_2xx(start.get("status")):
            self._check_log.unary(body)
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

    async def _judged_body(self, data: dict[str, Any]) -> bytes:
        """The unary body to send: checked, gated calls turned into elicitations, made to conform
        to Open Responses, echo restored."""
        if self._call_filter is None:   # a Responses request without tools: the fixer only
            conformed = conformed_response(data)
            return self._buffer if conformed is data else json.dumps(conformed).encode()
        changed = False   # the call a cut answer ended inside was marked incomplete
        if self._api == "responses":   # before the approvals: the model's own output is judged
            changed = check_responses_object(data, self._call_filter, contract=self._contract)
        else:
            restore_completion(data, self._custom_names)   # judged as the client gets it
            changed = check_chat_completion(data, self._call_filter, contract=self._contract)
        if self._approvals is not None:
            calls = [item for item in data.get("output") or ()
                     if isinstance(item, dict)
                     and item.get("type") in ("function_call", "custom_tool_call")]
            decisions = await asyncio.to_thread(self._approvals.decide, calls) if calls else {}
            self._approvals.apply_to_response(data, decisions)
        if self._server_turn is not None and self._api == "responses":
            from ..server_tools.response import apply_to_response
            apply_to_response(self._server_turn, data)   # a refused call: the violation
        conformed = conformed_response(data) if self._api == "responses" else data
        if self._echo:
            restore_echo(conformed, self._echo)
        if changed or self._approvals is not None or self._echo or conformed is not data \
                or self._server_turn is not None or self._custom_names:
            return json.dumps(conformed).encode()
        return self._buffer

    async def _refuse(self, violation: AllowedToolsViolation, *, stop: bool) -> None:
        """Answer with ``violation`` in place of a body the guard cannot read (counted); ``stop``:
        the app is still sending (a stream), so it is told the client left (vLLM aborts the
        engine request) and what it still sends is dropped."""
        record_violation(violation.source)
        logger.error("vllm-allowed-tools: refused a response the guard cannot read: %s", violation)
        self._finished = True
        body = json.dumps(violation.to_openai()).encode()
        await self._send({"type": "http.response.start", "status": violation.status,
                          "headers": [(b"content-type", b"application/json"),
                                      (b"content-length", str(len(body)).encode())]})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        if stop:
            self._stop.event.set()

    async def _end(self, violation: AllowedToolsViolation) -> None:
        """A body the guard cannot see: refused whole, or the stream ended with its closing events."""
        if self._guard is None:
            await self._refuse(violation, stop=False)
            return
        logger.error("vllm-allowed-tools: ended a stream the guard cannot read: %s", violation)
        await self._last(self._guard.refuse(violation))

    async def _stream(self, message: Message) -> None:
        assert self._guard is not None
        more = message.get("more_body", False)
        out = await self._guard.feed_async(message.get("body", b""))
        if not more and not self._guard.terminal:
            out += await self._guard.close_async()
        if not self._guard.terminal:
            self._checked(out, more)
            await self._send({"type": "http.response.body", "body": out, "more_body": more})
            return
        error = self._guard.violation
        if isinstance(error, GrantStoreUnavailable):
            log_store_down(error)
        else:
            logger.error("vllm-allowed-tools: ended a stream (%s): %s",
                         getattr(error, "reason", None) or "a call outside the policy", error)
        await self._last(out)

    async def _last(self, body: bytes) -> None:
        """Send the stream's last bytes; the app hears "client disconnected" (vLLM aborts the
        engine request) and what it still sends is dropped."""
        self._finished = True
        self._checked(body, False)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
        self._stop.event.set()

    def _checked(self, body: bytes, more: bool) -> None:
        """Check mode: the stream's outgoing bytes validated as a client frames them."""
        if self._stream_check is not None:
            self._stream_check.feed(body)
            if not more:
                self._stream_check.close()
