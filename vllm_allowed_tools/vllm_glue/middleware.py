"""ASGI middleware: the request path into vLLM (``--middleware`` on vLLM 0.32 and 0.33).

It runs before FastAPI validates anything, which Chat Completions needs (vLLM rejects the
``allowed_tools`` shape at validation) and which lets an invalid selection fail with our 400 before
the engine sees the request. It speaks plain ASGI, so it is the same on every vLLM version; the way
out is :mod:`.guarded_send` (``docs/response-path.md``).

Launch: ``vllm serve ... --middleware vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware``
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from ..approvals.chat import ChatApprovals
from ..approvals.errors import GrantStoreUnavailable
from ..errors import AllowedToolsError
from ..metrics import record_fallback
from ..request import resolve_callable_catalog
from ..request.custom_tools import read_custom_tools
from ..request.placement import LAST_MESSAGE, SYSTEM_MESSAGE, place_policy
from ..request.rewrite import (
    Api,
    constrain_to_catalog,
    echo_of,
    filter_catalog,
    narrow_allowlist,
    rewrite_request,
)
from ..response import AllowedNames, request_tools
from ..response.asgi import Receive, Scope, Send
from ..response.conformance_check import CheckLog
from ..response.contract import OutputContract
from ..response.sse import SSEEvent
from ..settings import PLAIN_CATALOG, Settings, current
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

#: ``code`` of the 400 for a tool-bearing request on a route the guard does not cover.
CODE_UNGUARDED_ENDPOINT = "unguarded_endpoint"

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


class AllowedToolsMiddleware:
    """Resolve and rewrite allowed-tools requests; answer invalid selections with a 400."""

    def __init__(self, app: Any, settings: Settings | None = None) -> None:
        from .capabilities import activate, check_server_args
        from .served_template import choose_placement
        # vLLM builds it with the app alone: the process's settings, parsed (and refused) now
        self.settings = settings = current() if settings is None else settings
        # fail at start-up, not per request, when we could not enforce
        self.capabilities = check_server_args(settings)
        activate(self.capabilities)
        self.placement = choose_placement(settings)   # where the served template takes the policy
        # vLLM renders a request's own chat_template only when the operator trusts them
        self._request_templates = settings.launch.trust_request_chat_template
        self.plain_decoding = settings.plain_decoding
        self.strict_all = settings.launch.strict_level_parameter
        from ..approvals import engine_from_settings
        # None: approvals off; a bad policy file stops start-up
        self.approvals = engine_from_settings(settings)
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
        try:
            placement = self._placement_for(data, api)
            rewritten = rewrite_request(data, api, placement)
            data = rewritten.request
            _refuse_final_message_continuation(data, rewritten, placement)
            _refuse_unguardable_fields(data, api, approvals=self.approvals is not None,
                                       render=render)
        except AllowedToolsError as exc:
            await _send_json(send, exc.status, exc.to_openai())
            return
        if self.placement.filter_catalog and rewritten.allowlist is not None \
                and rewritten.allowlist.has_allowlist:
            rewritten = replace(rewritten, body=filter_catalog(rewritten.body, rewritten.allowlist))
            record_fallback("filter_catalog")
        call_filter = _output_filter(rewritten, data, api)
        # a render answers with the prompt, not with the model's output: nothing for the backstops
        contract = _output_contract(rewritten, data, api, strict_all=self.strict_all) \
            if call_filter is not None and not render else None
        if self.plain_decoding == PLAIN_CATALOG:
            rewritten = constrain_to_catalog(rewritten, api)
        approvals = commit = None
        if self.approvals is not None:
            prepared = await self._prepare_approvals(scope, send, data, rewritten, api, render)
            if prepared is None:
                return   # answered already
            rewritten, approvals, commit = prepared
            if isinstance(approvals, ChatApprovals):   # decided already: the guard is the backstop
                call_filter = approvals.call_filter(call_filter) if call_filter is not None else None
                approvals = None
        rewritten = _with_policy_block(rewritten, api, placement)
        if rewritten.changed:
            body = json.dumps(rewritten.body).encode()
            scope = dict(scope, headers=with_content_length(list(scope.get("headers", [])), len(body)))
        stop = StopSignal()
        spec = tuple(int(p) for p in str(scope.get("asgi", {}).get("spec_version", "2.0")).split(".")
                     if p.isdigit())
        send = GuardedSend(send, api, call_filter, echo_of(rewritten, api), stop, spec, approvals,
                           commit, contract=contract, check_log=self._check_log)
        await self.app(scope, stop.receive(body, receive), send)

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

    async def _prepare_approvals(self, scope: Scope, send: Send, data: dict, rewritten: Any,
                                 api: Api, render: bool) -> tuple[Any, Any, Any] | None:
        """(the rewritten request, the response-side approvals or None, the store writes to make
        once vLLM accepts the request or None); None when the request was answered here (an
        error, or calls released by an approval without the model)."""
        try:   # it may read and write the grant store: off the loop
            rewritten, approvals, direct, commit = await asyncio.to_thread(
                self._approvals, scope, data, rewritten, api, render)
        except AllowedToolsError as exc:
            if isinstance(exc, GrantStoreUnavailable):
                log_store_down(exc)
            await _send_json(send, exc.status, exc.to_openai(), error_headers(exc))
            return None
        if direct is not None:
            await _send_direct(send, data, direct, rewritten.original_tool_choice, self._check_log)
            return None
        return rewritten, approvals, commit

    def _approvals(self, scope: Scope, data: dict, rewritten: Any, api: Api, render: bool):
        """(rewritten request, the response-side approvals or None, calls to release directly,
        the store writes to make once vLLM accepts the request). A render request never reaches
        the grant store: it cannot answer an elicitation."""
        from ..approvals.chat import decide_chat_turn
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
        if render:
            return replace(rewritten, body=body, changed=rewritten.changed or body is not rewritten.body), \
                None, None, None
        principal = principal_from_headers(scope.get("headers", []),
                                           self.approvals.store.principal_secret)
        session = session_of(data)
        catalog = rewritten.allowlist or resolve_callable_catalog(data, api)
        if api == "chat":
            chat = decide_chat_turn(self.approvals, data, catalog, principal=principal,
                                    session=session)
            rewritten = narrow_allowlist(replace(rewritten, body=body, changed=rewritten.changed
                                                 or body is not rewritten.body), chat.blocked)
            return rewritten, chat, None, None
        prepared = prepare_request(self.approvals, body, principal=principal, session=session,
                                   catalog=catalog)
        if prepared.direct_output is not None:
            return rewritten, None, prepared.direct_output, None
        changed = rewritten.changed or prepared.changed or prepared.body is not rewritten.body
        approvals = ResponseApprovals(self.approvals, data, catalog, principal=principal,
                                      session=session) if catalog is not None else None
        if approvals is not None and approvals.may_call_gated():
            self.approvals.check_store()   # down: 503 now, before any generation
        return replace(rewritten, body=prepared.body, changed=changed), approvals, None, \
            prepared.commit


async def _send_direct(send: Send, body: dict, output: list[dict], original_tool_choice: Any,
                       check: CheckLog | None) -> None:
    """Calls an approval released without the model, answered here (``check``: the check mode's
    log; these answers are ours alone)."""
    from ..approvals.wire import direct_events, direct_response
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


def _with_policy_block(rewritten: Any, api: Api, placement: str) -> Any:
    """The request with the policy block as a message, where the template takes it so; last, after
    the approvals have read the client's own history."""
    allowlist = rewritten.allowlist
    if placement not in (SYSTEM_MESSAGE, LAST_MESSAGE) or allowlist is None \
            or not allowlist.has_allowlist:
        return rewritten
    body = place_policy(rewritten.body, api, placement, allowlist.mode or allowlist.choice,
                        sorted(allowlist.allowed_flat_names))
    return replace(rewritten, body=body, changed=True)


def _refuse_final_message_continuation(data: dict, rewritten: Any, placement: str) -> None:
    if placement in (SYSTEM_MESSAGE, LAST_MESSAGE) and data.get("continue_final_message") is True \
            and rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        raise AllowedToolsError(
            "`continue_final_message` cannot be combined with allowed_tools on this server: the "
            "served template takes the per-turn policy as a message after the history, so the "
            "final message would no longer be the last. Send the request without it.",
            param="continue_final_message", code="unsupported_with_allowed_tools")


def _output_filter(rewritten: Any, body: dict, api: Api) -> Any:
    """What the guard checks calls against: the allowlist when the turn has one, else the catalog
    (a call to a name the request never offered is refused in every mode); None without tools."""
    if rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        return rewritten.allowlist
    if body.get("tools"):
        return AllowedNames.from_request(body, api)
    return None


def _output_contract(rewritten: Any, body: dict, api: Api, *, strict_all: bool) -> OutputContract:
    """The guard's backstops for this turn: a call required (``required``, a named choice,
    ``allowed_tools`` in ``required`` mode), arguments always one JSON object, strict tools' (every
    tool's under ``--tool-strict-level parameter``) valid against their schema, a grammar custom
    tool's input admitted by its grammar."""
    turn = rewritten.allowlist
    if turn is None and body.get("tools"):   # a choice left to vLLM: the catalog, in auto mode
        try:
            turn = resolve_callable_catalog(body, api)
        except AllowedToolsError:
            turn = None
    grammars = read_custom_tools(body.get("tools"), api).grammars   # compiled when rewritten
    return OutputContract.for_turn(turn, strict_all=strict_all, custom_grammars=grammars)


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
