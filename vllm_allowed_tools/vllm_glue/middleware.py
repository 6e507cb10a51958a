"""ASGI middleware: the request path into vLLM (``--middleware`` on vLLM 0.32 and 0.33).

It runs before FastAPI validates anything, which Chat Completions needs (vLLM rejects the
``allowed_tools`` shape at validation) and which lets an invalid selection fail with our 400 before
the engine sees the request. It imports nothing from vLLM: it speaks plain ASGI, so it is the same
on every vLLM version.

Launch: ``vllm serve ... --middleware vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware``

With approvals on, every grant-store access runs in a worker thread (``asyncio.to_thread``), never
on the event loop: a slow or locked store delays only the requests that need it. A request that may
call a gated tool is answered with 503 ``grant_store_unavailable`` (and ``Retry-After``) before any
generation while the store is down; when the store fails at the moment a gated call is decided, a
unary answer becomes that 503 and a stream ends with one ``response.failed`` carrying the same error
(the engine request is aborted). The gated call is never released.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..approvals.errors import GrantStoreUnavailable
from ..approvals.wire import ApprovalStream, WithoutGated
from ..errors import AllowedToolsError
from ..response.guard import (
    AllowedToolsViolation,
    AllowedNames,
    ChatStreamGuard,
    GuardedSSE,
    ResponsesStreamGuard,
    check_chat_completion,
    check_responses_object,
    request_tools,
    unreadable_violation,
)
from ..metrics import record_fallback, record_violation
from ..request.rewrite import Api, filter_catalog, restore_echo, rewrite_request
from ..response.sse import SSEEvent, SSEFramer
from .authentication import find_authentication
from .routes import (
    RouteDecision,
    carries_tools,
    decide,
    find_router,
    log_route_table,
    matched_template,
)

logger = logging.getLogger(__name__)

#: ``code`` of the 400 for a tool-bearing request on a route the guard does not cover.
CODE_UNGUARDED_ENDPOINT = "unguarded_endpoint"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

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


def _with_content_length(headers: list[tuple[bytes, bytes]], length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return kept + [(b"content-length", str(length).encode())]


def _error_headers(exc: Exception) -> list[tuple[bytes, bytes]]:
    retry = getattr(exc, "retry_after", None)
    return [(b"retry-after", str(retry).encode())] if retry else []


def _log_store_down(exc: GrantStoreUnavailable) -> None:
    logger.error("vllm-allowed-tools: grant store unavailable, gated calls refused (503): %s",
                 exc.detail)


async def _send_json(send: Send, status: int, payload: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Stop:
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


#: ASGI extensions that send a response body without ``http.response.body`` messages
_BODY_ELSEWHERE = frozenset({"http.response.pathsend", "http.response.zerocopysend"})


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


class _GuardedSend:
    """Wraps `send`: the output guard on every call leaving the server, and, for an allowed-tools
    Responses request, the client's own tool_choice restored in every response object.

    While a policy applies, every 2xx answer is guarded: ``application/json`` as a whole body,
    ``text/event-stream`` event by event (media types compared case-insensitively, parameters
    ignored). A 2xx answer the guard cannot read (another or no content type, an encoded body, a
    JSON body that does not parse to an object) is refused like a call outside the policy: 500
    ``allowed_tools_violation``, counted under source ``unreadable``. Non-2xx answers pass as they
    are: they are vLLM's own error bodies, which never carry a tool call.
    """

    def __init__(self, send: Send, api: Api, policy: Any, echo: tuple[bool, Any], stop: _Stop,
                 spec_version: tuple[int, ...], approvals: Any = None) -> None:
        self._approvals = approvals
        self._approval_stream = ApprovalStream(approvals) if approvals is not None else None
        self._send = send
        self._api = api
        self._policy = policy
        self._restore, self._original = echo
        self._stop = stop
        self._spec_version = spec_version
        self._mode: str | None = None
        self._start: Message | None = None
        self._buffer = b""
        self._guard: GuardedSSE | None = None
        self._framer = SSEFramer()
        self._finished = False
        self._unreadable = ""   # what made a 2xx answer unreadable

    async def __call__(self, message: Message) -> None:
        if self._finished:
            if self._spec_version >= (2, 4):
                raise OSError("the allowed-tools guard ended this stream")
            return   # the app is being told the client left; drop what it still sends
        if message["type"] == "http.response.start":
            status = message.get("status")
            media, encoded = _media_type(message.get("headers"))
            if self._policy is None or not (isinstance(status, int) and 200 <= status < 300):
                # No policy, or not a success: vLLM's error bodies (4xx/5xx) carry no tool calls,
                # so they pass as they are, whatever their content type.
                self._mode = "raw"
            elif encoded or media not in ("application/json", "text/event-stream"):
                self._mode = "unreadable"   # refused at the first body
                self._unreadable = ("an encoded (compressed) body" if encoded else
                                    f"content type {media!r}" if media else "no single content type")
                return
            elif media == "application/json":
                self._mode, self._start = "json", message   # hold until the body is complete
                return
            else:
                self._mode = "sse"
                self._guard = GuardedSSE(ResponsesStreamGuard(self._policy) if self._api == "responses"
                                         else ChatStreamGuard(self._policy))
            await self._send(message)
            return
        if self._mode != "raw" and message["type"] in _BODY_ELSEWHERE:
            # a body the guard never sees (sent from a file by the server): refused like any
            # other body it cannot read
            violation = unreadable_violation(f"a body sent as {message['type']}")
            if self._guard is None:
                await self._refuse(violation, stop=False)
                return
            logger.error("vllm-allowed-tools: ended a stream the guard cannot read: %s", violation)
            self._finished = True
            await self._send({"type": "http.response.body", "body": self._guard.refuse(violation),
                              "more_body": False})
            self._stop.event.set()
            return
        if message["type"] != "http.response.body" or self._mode == "raw":
            await self._send(message)
            return
        if self._mode == "unreadable":
            await self._refuse(unreadable_violation(f"a 2xx answer with {self._unreadable}"),
                               stop=message.get("more_body", False))
            return
        if self._mode == "json":
            await self._unary(message)
        else:
            await self._stream(message)

    async def _unary(self, message: Message) -> None:
        self._buffer += message.get("body", b"")
        if message.get("more_body", False):
            return
        start = dict(self._start or {})
        body = self._buffer
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            await self._refuse(unreadable_violation("a JSON body that does not parse to an object"),
                               stop=False)
            return
        try:
            if self._api == "responses":
                check_responses_object(data, self._policy)
            else:
                check_chat_completion(data, self._policy)
            if self._approvals is not None:
                calls = [item for item in data.get("output") or ()
                         if isinstance(item, dict) and item.get("type") == "function_call"]
                decisions = await asyncio.to_thread(self._approvals.decide, calls) \
                    if calls else {}
                self._approvals.apply_to_response(data, decisions)
            if self._restore:
                restore_echo(data, self._original)
            if self._approvals is not None or self._restore:
                body = json.dumps(data).encode()
        except AllowedToolsViolation as violation:
            logger.error("vllm-allowed-tools: refused a call outside the policy: %s", violation)
            body = json.dumps(violation.to_openai()).encode()
            start["status"] = violation.status
        except GrantStoreUnavailable as exc:
            _log_store_down(exc)
            body = json.dumps(exc.to_openai()).encode()
            start["status"] = exc.status
            start["headers"] = list(start.get("headers", [])) + _error_headers(exc)
        start["headers"] = _with_content_length(list(start.get("headers", [])), len(body))
        await self._send(start)
        await self._send({"type": "http.response.body", "body": body, "more_body": False})

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

    async def _stream(self, message: Message) -> None:
        assert self._guard is not None
        more = message.get("more_body", False)
        out = self._guard.feed(message.get("body", b""))
        if not more and not self._guard.terminal:
            out += self._guard.close()
        if self._restore or self._approval_stream is not None:
            out, store_down = await self._post_process(out, final=not more or self._guard.terminal)
            if store_down is not None:
                _log_store_down(store_down)
                self._finished = True
                await self._send({"type": "http.response.body", "body": out, "more_body": False})
                self._stop.event.set()   # vLLM aborts the engine request
                return
        if self._guard.terminal:
            logger.error("vllm-allowed-tools: ended a stream at a call outside the policy: %s",
                         self._guard.violation)
            self._finished = True
            await self._send({"type": "http.response.body", "body": out, "more_body": False})
            self._stop.event.set()   # the app hears "client disconnected": vLLM aborts the request
            return
        await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _post_process(self, chunk: bytes,
                            final: bool) -> tuple[bytes, GrantStoreUnavailable | None]:
        """After the guard: approvals (gated calls become elicitations) and the tool_choice echo.
        Returns the bytes to send, and the store error when a decision failed (then the bytes end
        with the stream's ``response.failed`` and nothing more may be sent)."""
        out = []
        events = self._framer.feed(chunk)
        if final:
            events += self._framer.close()
        for event in events:
            data = event.json()
            if not isinstance(data, dict):
                out.append(event.raw)
                continue
            if self._approval_stream is not None:
                decisions = None
                pending = self._approval_stream.pending_calls(data)
                if pending:
                    try:
                        decisions = await asyncio.to_thread(self._approvals.decide, pending)
                    except GrantStoreUnavailable as exc:
                        for item in self._approval_stream.fail(exc):
                            if self._restore and isinstance(item.get("response"), dict):
                                item = {**item, "response": restore_echo(dict(item["response"]),
                                                                         self._original)}
                            out.append(SSEEvent.encode(item, item["type"]))
                        return b"".join(out), exc
                events = self._approval_stream.feed(data, decisions)
            else:
                events = [data]
            for item in events:
                if item is data and not (self._restore and isinstance(data.get("response"), dict)):
                    out.append(event.raw)
                    continue
                if self._restore and isinstance(item.get("response"), dict):
                    item = {**item, "response": restore_echo(dict(item["response"]), self._original)}
                out.append(SSEEvent.encode(item, item.get("type") or event.event))
        if final:
            out.append(self._framer.flush())
        return b"".join(out), None


class AllowedToolsMiddleware:
    """Resolve and rewrite allowed-tools requests; answer invalid selections with a 400."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        import sys

        from .capabilities import activate, check_server_args
        # fail at start-up, not per request, when we could not enforce
        self.capabilities = check_server_args(sys.argv)
        activate(self.capabilities)
        from ..approvals import engine_from_env
        self.approvals = engine_from_env()   # None: approvals off; a bad policy file stops start-up
        self.app = app
        self._auth = find_authentication(app, sys.argv)
        self._router = find_router(app)
        if self._router is not None:
            log_route_table(self._router)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        if self._auth is not None and not self._auth.accepts(scope):
            # vLLM's own 401, before we read the body or touch the grant store
            await self.app(scope, receive, send)
            return
        route = _route(self._router, scope)
        if route.decision == "passthrough" or route.decision == "count_only":
            await self.app(scope, receive, send)
            return
        if route.decision == "stored":
            await _send_json(send, 400, _unguarded_endpoint(scope, route.template).to_openai())
            return
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if route.decision == "no_tools" or not isinstance(data, dict):
            key = carries_tools(data)
            if key is not None:
                await _send_json(send, 400, _unguarded_endpoint(scope, route.template, key).to_openai())
                return
            # no tools, or not a JSON object: vLLM answers as it always does
            await self.app(scope, _Stop().receive(body, receive), send)
            return
        api: Api = route.api   # type: ignore[assignment]
        render = route.decision == "render"
        try:
            rewritten = rewrite_request(data, api)
            data = rewritten.request
            _refuse_unguardable_fields(data, api, approvals=self.approvals is not None,
                                       render=render)
        except AllowedToolsError as exc:
            await _send_json(send, exc.status, exc.to_openai())
            return
        if self.capabilities.filter_catalog and rewritten.policy is not None \
                and rewritten.policy.has_allowlist:
            rewritten = replace(rewritten, body=filter_catalog(rewritten.body, rewritten.policy))
            record_fallback("filter_catalog")
        policy = _output_policy(rewritten, data, api)
        approvals = None
        if self.approvals is not None:
            try:
                if api == "responses":   # it may read and write the grant store: off the loop
                    rewritten, approvals, direct = await asyncio.to_thread(
                        self._approvals, scope, data, rewritten, api, render)
                else:
                    rewritten, approvals, direct = self._approvals(scope, data, rewritten, api,
                                                                   render)
            except AllowedToolsError as exc:
                if isinstance(exc, GrantStoreUnavailable):
                    _log_store_down(exc)
                await _send_json(send, exc.status, exc.to_openai(), _error_headers(exc))
                return
            if direct is not None:
                await _send_direct(send, data, direct, rewritten.original_tool_choice)
                return
            if api == "chat" and policy is not None:
                policy = WithoutGated(policy, self.approvals, data)
        if rewritten.changed:
            body = json.dumps(rewritten.body).encode()
            scope = dict(scope, headers=_with_content_length(list(scope.get("headers", [])), len(body)))
        stop = _Stop()
        allowlist = rewritten.policy is not None and rewritten.policy.has_allowlist
        spec = tuple(int(p) for p in str(scope.get("asgi", {}).get("spec_version", "2.0")).split(".")
                     if p.isdigit())
        send = _GuardedSend(send, api, policy, (api == "responses" and allowlist,
                                                rewritten.original_tool_choice), stop, spec,
                            approvals)
        await self.app(scope, stop.receive(body, receive), send)

    def _approvals(self, scope: Scope, data: dict, rewritten: Any, api: Api, render: bool):
        """(rewritten request, the response-side approvals or None, calls to release directly).
        A render request never reaches the grant store: it cannot answer an elicitation."""
        from ..approvals.hints import check_hints
        from ..approvals.wire import (
            ResponseApprovals,
            prepare_request,
            principal_from_headers,
            session_of,
            strip_approval_hints,
        )
        from ..request import resolve_callable_catalog
        check_hints(data, self.approvals.policy)   # a bad `approval` object: 400 before generation
        _refuse_gated_custom_tools(data, api, self.approvals)
        body = strip_approval_hints(rewritten.body)
        if render:
            _refuse_approval_items(data)
        if api != "responses" or render:
            return replace(rewritten, body=body, changed=rewritten.changed or body is not rewritten.body), \
                None, None
        principal = principal_from_headers(scope.get("headers", []),
                                           self.approvals.store.principal_secret)
        session = session_of(data)
        catalog = rewritten.policy or resolve_callable_catalog(data, "responses")
        prepared = prepare_request(self.approvals, body, principal=principal, session=session,
                                   catalog=catalog)
        if prepared.direct_output is not None:
            return rewritten, None, prepared.direct_output
        changed = rewritten.changed or prepared.changed or prepared.body is not rewritten.body
        approvals = ResponseApprovals(self.approvals, data, catalog, principal=principal,
                                      session=session) if catalog is not None else None
        if approvals is not None and approvals.may_call_gated():
            self.approvals.check_store()   # down: 503 now, before any generation
        return replace(rewritten, body=prepared.body, changed=changed), approvals, None


async def _send_direct(send: Send, body: dict, output: list[dict], original_tool_choice: Any) -> None:
    from ..approvals.wire import direct_events, direct_response
    response = direct_response(body, output, original_tool_choice)
    if not body.get("stream"):
        await _send_json(send, 200, response)
        return
    payload = b"".join(SSEEvent.encode(event, event["type"]) for event in direct_events(response))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def _output_policy(rewritten: Any, body: dict, api: Api) -> Any:
    """What the guard checks calls against: the allowlist when the turn has one, else the catalog
    (a call to a name the request never offered is refused in every mode); None without tools."""
    if rewritten.policy is not None and rewritten.policy.has_allowlist:
        return rewritten.policy
    if body.get("tools"):
        return AllowedNames.from_request(body, api)
    return None


def _route(router: Any, scope: Scope) -> RouteDecision:
    routes = getattr(router, "routes", None)
    if routes is None:
        router = find_router(scope.get("app"))
        routes = getattr(router, "routes", ())
    return decide(matched_template(routes, scope), str(scope.get("method", "GET")).upper())


def _unguarded_endpoint(scope: Scope, template: str | None, key: str | None = None) -> AllowedToolsError:
    """The 400 for a route that would serve tool calls past the guard and the approvals."""
    endpoint = f"{scope.get('method', 'POST')} {template or scope.get('path', '')}"
    what = f"a request with `{key}`" if key else "this endpoint"
    return AllowedToolsError(
        f"{endpoint} is not guarded by vllm-allowed-tools, so this server refuses {what} there: "
        "tool calls are served only on POST /v1/chat/completions and POST /v1/responses, where "
        "the allowed-tools policy, the output guard and the approvals apply. Send the request to "
        "one of those.", param=key, code=CODE_UNGUARDED_ENDPOINT)


def _refuse_unguardable_fields(body: dict, api: Api, *, approvals: bool, render: bool) -> None:
    """Fields whose output or history the guard never sees: background responses (fetched later
    from vLLM's store, unguarded) and, with approvals, ``previous_response_id`` (history from
    vLLM's store, where gated calls stand as if they had been released)."""
    if api != "responses" or render or not body.get("tools"):
        return
    if body.get("background"):
        raise AllowedToolsError(
            "`background: true` is not supported with tools under vllm-allowed-tools: a background "
            "response is fetched later from vLLM's store, past the output guard. Send the request "
            "with `background: false`.", param="background", code=CODE_UNGUARDED_ENDPOINT)
    if approvals and body.get("previous_response_id") is not None:
        raise AllowedToolsError(
            "`previous_response_id` is not supported while tool-call approvals are on: vLLM would "
            "rebuild the history from its own store, where a call waiting for approval stands as "
            "if it had been made. Send the whole conversation in `input` instead.",
            param="previous_response_id", code=CODE_UNGUARDED_ENDPOINT)


def _refuse_approval_items(body: dict) -> None:
    """Render endpoints never consume an elicitation or mint a grant, so they take no answers."""
    for index, item in enumerate(body.get("input") if isinstance(body.get("input"), list) else ()):
        if isinstance(item, dict) and item.get("type") in ("elicitation", "elicitation_response"):
            raise AllowedToolsError(
                f"input[{index}] is an `{item['type']}` item; render endpoints do not answer or "
                "replay approvals. Render the conversation without elicitation items, or send the "
                "answer to POST /v1/responses.", param=f"input[{index}]",
                code="approval_items_not_rendered")


def _refuse_gated_custom_tools(body: dict, api: Api, engine: Any) -> None:
    """A ``custom`` tool the approval policy gates is refused before generation: its calls
    (``custom_tool_call``, free-form input) cannot be elicited and released yet, and serving them
    unasked would skip the approval. Ungated custom tools are served as before."""
    from ..request import ToolIdentity
    for param, kind, namespace, name in request_tools(body, api):
        if kind == "custom" and engine.policy.effective(ToolIdentity(namespace, name)).required:
            raise AllowedToolsError(
                f"{param} is the custom tool {name!r}, which this server's approval policy "
                "gates; approvals are served for function tools only, so a gated custom tool cannot "
                "be offered. Define it as a function tool (its calls then ask for approval), or ask "
                "the operator to exempt it.", param=param,
                code="custom_tool_needs_approval")
