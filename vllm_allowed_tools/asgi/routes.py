"""Which of vLLM's routes the plugin guards, and which it refuses while it is loaded.

A route the plugin does not guard must never serve tool calls: vLLM mounts more tool-producing
routes than the two the guard understands (Anthropic ``/v1/messages``, Cohere ``/cohere/v2/chat``,
SageMaker ``/invocations``, ``/v1/chat/completions/batch``, endpoint plugins, ...), and every one of
them runs the chat handler with no guard and no approvals. So the route table is walked at
start-up and each route gets one of these decisions (logged, one line a route):

* ``guarded``: ``POST /v1/chat/completions`` and ``POST /v1/responses``: the policy, the output
  guard and the approvals.
* ``render``: their ``/render`` twins: the policy is resolved and rendered; no output, no grant-store
  write.
* ``stored``: ``/v1/responses/{response_id}`` (retrieve, cancel): vLLM's stored response objects
  are its own, unguarded output (gated calls included), so they are refused.
* ``no_tools``: any other route taking a body: served only when the body carries no tools
  (``tools``, ``tool_choice``, ``functions``); a request that does is refused with a 400 that names
  the endpoint and the guarded ones.
* ``count_only``: ``/tokenize``, ``/detokenize``, ``/v1/messages/count_tokens``: they render or
  count and produce no call.
* ``passthrough``: routes without a body (``GET``): health, metrics, models.

A route is found the way Starlette's router finds it (first full match on the path without the
``root_path``, and the method), so ``--root-path`` or a trailing slash cannot route around this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

logger = logging.getLogger("vllm.allowed_tools.routes")  # under vLLM's configured logger

Decision = Literal["guarded", "render", "stored", "no_tools", "count_only", "passthrough"]

_GUARDED = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}
_RENDER = {"/v1/chat/completions/render": "chat", "/v1/responses/render": "responses"}
_STORED = ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel")
_COUNT_ONLY = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")
_BODYLESS = frozenset({"GET", "HEAD", "OPTIONS"})
_TOOL_KEYS = ("tools", "tool_choice", "functions", "function_call")


@dataclass(frozen=True)
class RouteDecision:
    decision: Decision
    template: str | None          # the route's path template, None when no route matched
    api: str | None = None        # "chat" / "responses" for guarded and render routes


def decide(template: str | None, method: str) -> RouteDecision:
    """The decision for one route (template as the router declares it) and request method."""
    if template is None:
        # nothing matches: the router answers 404/405 itself; still refuse tools, to be safe
        return RouteDecision("passthrough" if method in _BODYLESS else "no_tools", None)
    path = template.rstrip("/") or "/"
    if path in _STORED:
        return RouteDecision("stored", template)
    if method in _BODYLESS:
        return RouteDecision("passthrough", template)
    if path in _GUARDED and method == "POST":
        return RouteDecision("guarded", template, _GUARDED[path])
    if path in _RENDER and method == "POST":
        return RouteDecision("render", template, _RENDER[path])
    if path in _COUNT_ONLY:
        return RouteDecision("count_only", template)
    return RouteDecision("no_tools", template)


def carries_tools(body: Any) -> str | None:
    """The first tool-bearing key of a request body (``tools`` non-empty, a ``tool_choice`` other
    than ``none``, legacy ``functions``), or None."""
    if not isinstance(body, Mapping):
        return None
    for key in _TOOL_KEYS:
        value = body.get(key)
        if value in (None, [], {}, "") or (key == "tool_choice" and value == "none"):
            continue
        return key
    return None


def find_router(app: Any) -> Any | None:
    """The Starlette router under a middleware chain (each middleware keeps the next in ``.app``)."""
    seen = 0
    while app is not None and seen < 32:
        if isinstance(getattr(app, "routes", None), list):
            return app
        router = getattr(app, "router", None)
        if router is not None and isinstance(getattr(router, "routes", None), list):
            return router
        app, seen = getattr(app, "app", None), seen + 1
    return None


def matched_template(routes: Iterable[Any], scope: Mapping[str, Any]) -> str | None:
    """The path template of the route Starlette will dispatch ``scope`` to (first full match)."""
    from starlette.routing import Match
    for route in routes:
        try:
            match, _ = route.matches(scope)
        except Exception:   # a route type that cannot match this scope
            continue
        if match == Match.FULL:
            return getattr(route, "path", None) or getattr(route, "path_format", None) or ""
    return None


def route_table(router: Any) -> list[tuple[str, str, RouteDecision]]:
    """(method, template, decision) for every route: what start-up logs."""
    rows = []
    for route in getattr(router, "routes", ()):
        template = getattr(route, "path", None)
        if template is None:
            continue
        for method in sorted(getattr(route, "methods", None) or {"*"}):
            rows.append((method, template, decide(template, method if method != "*" else "POST")))
    return rows


def log_route_table(router: Any) -> None:
    for method, template, decision in route_table(router):
        logger.info("vllm-allowed-tools: route %s %s: %s", method, template, decision.decision)
