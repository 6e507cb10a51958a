"""vLLM's API-key check, run before the plugin reads a body or touches the grant store.

vLLM adds its ``AuthenticationMiddleware`` (``--api-key`` / ``VLLM_API_KEY``) inside ours, so
without this an unauthenticated request would reach the approvals first: it could consume an
elicitation, or learn from a 400 whether one exists. The plugin asks vLLM's own middleware
instance whether it would accept the request (same tokens, same guarded path prefixes) and, when it
would not, hands the request straight to it for its 401. If an API key is configured and that
middleware cannot be found, the server does not start: the order could not be guaranteed.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..settings import Settings

_DEFAULT_GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")


class VllmAuthentication:
    """Adapter over vLLM's ``AuthenticationMiddleware`` instance."""

    def __init__(self, middleware: Any) -> None:
        self.middleware = middleware
        module = sys.modules.get(type(middleware).__module__)
        self.prefixes = tuple(getattr(module, "GUARDED_PREFIX", _DEFAULT_GUARDED_PREFIX))

    def accepts(self, scope: Mapping[str, Any]) -> bool:
        """Whether vLLM's middleware would let this request through (OPTIONS and unguarded paths
        included, as it decides them)."""
        if scope.get("method") == "OPTIONS":
            return True
        path = str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))
        if not path.startswith(self.prefixes):
            return True
        from starlette.datastructures import Headers
        return bool(self.middleware.verify_token(Headers(scope=scope)))


def find_authentication(app: Any, settings: Settings) -> VllmAuthentication | None:
    """vLLM's API-key middleware under ``app`` (each middleware keeps the next in ``.app``), or None
    when none is configured. Raises RuntimeError when a key is configured but the middleware is
    not found below ours."""
    node, depth = app, 0
    while node is not None and depth < 32:
        if callable(getattr(node, "verify_token", None)) and hasattr(node, "api_tokens"):
            return VllmAuthentication(node)
        node, depth = getattr(node, "app", None), depth + 1
    if settings.api_key_configured:
        raise RuntimeError(
            "vllm-allowed-tools: an API key is configured (--api-key or VLLM_API_KEY) but vLLM's "
            "authentication middleware is not below AllowedToolsMiddleware, so requests could reach "
            "the grant store unauthenticated. Pass --middleware "
            "vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware to `vllm serve` (it is "
            "added outside vLLM's own middleware), not to another app.")
    return None
