"""ASGI middleware: the request path into vLLM, and the guarded way out (:mod:`.guarded_send`).

It runs before FastAPI validates anything, which Chat Completions needs (vLLM rejects the
``allowed_tools`` shape at validation) and which lets an invalid selection fail with our 400 before
the engine sees the request. It speaks plain ASGI and imports no vLLM, so it is the same on every
vLLM version (``docs/response-path.md``). What vLLM loads is its subclass
``vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware``, which makes the start-up
decisions that need vLLM and hands them to :class:`GuardingMiddleware`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal, Protocol

from ..approvals import engine_from_settings
from ..approvals.approval_errors import GrantStoreUnavailable
from ..approvals.approval_turn import PreparedTurn, prepare_turn
from ..errors import AllowedToolsError
from ..request.rewrite import Api
from ..request.template_probe import ProbeResult
from ..response.asgi import Receive, Scope, Send
from ..response.conformance_check import CheckLog
from ..response.sse import SSEEvent
from ..server_tools import hook_status, read_server_tools
from ..server_tools.request import PreparedServerTurn, prepare_server_turn
from ..server_tools.server_turn import ServerTurn, register, unregister
from ..settings import Settings
from .authentication import find_authentication
from .guarded_send import GuardedSend, StopSignal, error_headers, log_store_down, with_content_length
from .routes import (
    RouteDecision,
    carries_tools,
    decide,
    find_router,
    log_route_table,
    matched_template,
)
from ..server_tools.forwarding import store_only_engine as _store_only_engine
from .turn_plan import CODE_UNGUARDED_ENDPOINT, TurnPlan, plan_turn


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


async def _send_json(send: Send, status: int, payload: dict[str, Any],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class TemplatePlacement(Protocol):
    """Where the served chat template takes the per-turn policy (chosen at start-up by probing it;
    ``vllm_glue/served_template.py``'s ``PlacementChoice``)."""

    @property
    def placement(self) -> str: ...

    @property
    def served(self) -> object | None:
        """The served template, when a request's own template can be probed like it."""

    @property
    def filter_catalog(self) -> bool: ...

    def for_request_template(self, text: str) -> ProbeResult: ...


class GuardingMiddleware:
    """Resolve and rewrite allowed-tools requests (a 400 for an invalid selection), run the
    approvals, and guard what comes back; ``settings`` and ``placement`` are the server's, decided
    at start-up."""

    def __init__(self, app: Any, *, settings: Settings, placement: TemplatePlacement,
                 harmony: bool = False) -> None:
        self.settings = settings
        self.placement = placement
        # vLLM renders a request's own chat_template only when the operator trusts them
        self._request_templates = settings.launch.trust_request_chat_template
        self.plain_decoding = settings.plain_decoding
        self.strict_all = settings.launch.strict_level_parameter
        # None: approvals off; a bad policy file stops start-up
        self.approvals = engine_from_settings(settings)
        # what server-side calls are recorded with: the approvals' engine, or (approvals off) one
        # with no rules over the configured grant store, for the clients' require_approval
        self.server_engine = self.approvals if self.approvals is not None \
            else _store_only_engine(settings)
        #: whether the model is served on vLLM's harmony path (the subclass knows; see vllm_glue)
        self.harmony = harmony
        self._check_log = CheckLog.from_settings(settings)   # the Open Responses check mode
        self.app = app
        self._auth = find_authentication(app, settings)
        self._router = find_router(app)
        if self._router is not None:
            log_route_table(self._router)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or (self._auth is not None and not self._auth.accepts(scope)):
            # not HTTP, or vLLM's own 401 before we read the body or touch the grant store
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
            await self.app(scope, StopSignal().receive(body, receive), send)
            return
        await self._guarded(scope, receive, send, data, body, route)

    async def _guarded(self, scope: Scope, receive: Receive, send: Send, data: dict, body: bytes,
                       route: RouteDecision) -> None:
        """A tool-bearing request: rewritten for vLLM, its answer guarded on the way out."""
        api: Api = route.api   # type: ignore[assignment]
        render = route.decision == "render"
        server: PreparedServerTurn | None = None
        if api == "responses":
            step = await self._server_step(scope, send, data, render)
            if step is False:
                return   # answered already
            server = step
            if server is not None:
                data = server.body
        try:
            plan = plan_turn(data, api, self.settings, placement=self._placement_for(data, api),
                             render=render, filter_catalogs=self.placement.filter_catalog,
                             approvals=self.approvals is not None, server=server)
        except AllowedToolsError as exc:
            await _send_json(send, exc.status, exc.to_openai())
            return
        if self.approvals is not None:
            turn = await self._approved(scope, send, plan, render)
            if turn is None:
                return   # answered already
            plan = plan.approved(turn)
        plan = plan.sealed()
        forwarded = plan.body()
        if forwarded is not None:
            body = forwarded
            scope = dict(scope, headers=with_content_length(list(scope.get("headers", [])), len(body)))
        stop = StopSignal()
        spec = tuple(int(p) for p in str(scope.get("asgi", {}).get("spec_version", "2.0")).split(".")
                     if p.isdigit())
        guarded = GuardedSend(send, plan, stop, spec, check_log=self._check_log)
        await self._run(scope, stop.receive(body, receive), guarded, plan.server_turn)

    async def _run(self, scope: Scope, receive: Receive, send: Send, turn: ServerTurn | None) -> None:
        """vLLM serves the request; a server-side turn is findable by its loop meanwhile."""
        if turn is None:
            await self.app(scope, receive, send)
            return
        register(turn)
        try:
            await self.app(scope, receive, send)
        finally:
            unregister(turn)

    async def _server_step(self, scope: Scope, send: Send, data: dict,
                           render: bool) -> PreparedServerTurn | None | Literal[False]:
        """The server-side turn (None: no server-side tools; False: answered with an error)."""
        try:
            return await asyncio.to_thread(self._server_turn, scope, data, render)
        except AllowedToolsError as exc:
            if isinstance(exc, GrantStoreUnavailable):
                log_store_down(exc)
            await _send_json(send, exc.status, exc.to_openai(), error_headers(exc))
            return False

    def _server_turn(self, scope: Scope, data: dict, render: bool) -> PreparedServerTurn | None:
        """The request's server-side tools decided here (blocking: answers read the store)."""
        tools = read_server_tools(data)
        if not tools:
            return None
        if render:
            return prepare_server_turn(data, tools, engine=None, headers=[], harmony=self.harmony,
                                       hook=hook_status(), operator_engine=False,
                                       render=True)
        prepared = prepare_server_turn(data, tools, engine=self.server_engine,
                                       headers=scope.get("headers", []), harmony=self.harmony,
                                       hook=hook_status(), operator_engine=self.approvals is not None)
        # off the harmony path with no policy (else refused above): vLLM serves it as it would
        return prepared if self.harmony else None

    def _placement_for(self, data: dict, api: Api) -> str:
        """The served template's placement, or that of a template the request brings (vLLM
        renders with it only under ``--trust-request-chat-template``; otherwise it refuses it)."""
        template = data.get("chat_template") if api == "chat" else None
        if not isinstance(template, str) or not self.placement.served or not self._request_templates:
            return self.placement.placement
        result = self.placement.for_request_template(template)
        if result.placement is None:
            raise AllowedToolsError(
                "`chat_template` cannot take the per-turn allowed-tools policy after a stable "
                f"prompt prefix ({result.explain()}); send a template that can, or none to use "
                "the server's", param="chat_template", code="unsupported_chat_template")
        return result.placement

    async def _approved(self, scope: Scope, send: Send, plan: TurnPlan,
                        render: bool) -> PreparedTurn | None:
        """The approvals' turn (:func:`..approvals.turn.prepare_turn`, off the loop: it may read
        and write the grant store); None when the request was answered here (an error, or calls
        an approval released without the model)."""
        assert self.approvals is not None
        request, rewritten = plan.rewritten.request, plan.rewritten
        try:
            turn = await asyncio.to_thread(prepare_turn, self.approvals, request, rewritten,
                                           plan.api, headers=scope.get("headers", []),
                                           render=render)
        except AllowedToolsError as exc:
            if isinstance(exc, GrantStoreUnavailable):
                log_store_down(exc)
            await _send_json(send, exc.status, exc.to_openai(), error_headers(exc))
            return None
        if turn.direct_output is not None:
            await _send_direct(send, request, turn.direct_output, rewritten.original_tool_choice,
                               self._check_log)
            return None
        return turn


async def _send_direct(send: Send, body: dict, output: list[dict], original_tool_choice: Any,
                       check: CheckLog | None) -> None:
    """Calls an approval released without the model, answered here (``check``: the check mode's
    log; these answers are ours alone)."""
    from ..approvals.response_bodies import direct_events, direct_response
    from ..response.conformance import conformed_response
    response = conformed_response(direct_response(body, output, original_tool_choice))
    if not body.get("stream"):
        if check is not None:
            check.unary(json.dumps(response).encode())
        await _send_json(send, 200, response)
        return
    payload = b"".join(SSEEvent.encode(event, event["type"]) for event in direct_events(response))
    if check is not None:
        stream = check.stream()
        stream.feed(payload)
        stream.close()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache")]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


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
