"""The middleware vLLM builds: ``--middleware vllm_allowed_tools.vllm_glue.middleware.AllowedToolsMiddleware``
(added by the plugin when ``--tool-call-parser`` names one of ours; vLLM 0.32 and 0.33).

vLLM builds it with the app alone, in every API server process, so the start-up decisions that
need vLLM are made here, before the first request: whether this server can enforce an allowlist
at all (:mod:`.capabilities`: parser, structured-output backend, constraint stage; refused with a
CapabilityError otherwise) and where the served chat template takes the per-turn policy
(:mod:`.served_template`). The request path itself is plain ASGI:
:class:`~vllm_allowed_tools.asgi.guarding_middleware.GuardingMiddleware`.
"""

from __future__ import annotations

from typing import Any

from ..asgi.guarding_middleware import GuardingMiddleware
from ..settings import Settings, current
from .capabilities import activate, check_server_args
from .harmony_prompt import serves_harmony
from .served_template import choose_placement
from .server_tool_hook import install as install_server_tool_hook


class AllowedToolsMiddleware(GuardingMiddleware):
    """:class:`GuardingMiddleware` with this server's start-up decisions; ``settings``: the
    process's (:func:`~vllm_allowed_tools.settings.current`) unless given, parsed and refused
    now, not on some request."""

    def __init__(self, app: Any, settings: Settings | None = None) -> None:
        settings = current() if settings is None else settings
        self.capabilities = check_server_args(settings)   # fail at start-up when we could not enforce
        activate(self.capabilities)
        # the hook deciding server-side calls in vLLM's loop (checked and installed once)
        self.server_tool_hook = install_server_tool_hook()
        super().__init__(app, settings=settings, placement=choose_placement(settings),
                         harmony=serves_harmony(settings.launch))
