"""The middleware's part of server-side tools: the request carrying its turn, the guard's filter.
(The decisions are :mod:`vllm_allowed_tools.server_tools`'; the hook in vLLM's loop is glue.)"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from ..call_filter import CallFilter
from ..request.rewrite import Rewritten
from ..response.contract import OutputContract
from .request import PreparedServerTurn
from .server_turn import ServerTurnFilter
from ..settings import Settings

logger = logging.getLogger("vllm.allowed_tools.server_tools")  # under vLLM's configured logger


def store_only_engine(settings: Settings) -> Any:
    """An approval engine without rules over ``VLLM_ALLOWED_TOOLS_GRANT_STORE`` (None when unset):
    what a client's ``require_approval`` is recorded with while the operator's approvals are off."""
    if settings.grant_store is None:
        return None
    from ..approvals import ApprovalEngine, open_store
    from ..approvals.policy import ApprovalPolicy
    return ApprovalEngine(ApprovalPolicy.from_mapping({}),
                          open_store(settings.grant_store, timeout_s=settings.grant_store_timeout_s))


def with_server_turn(rewritten: Rewritten, server: PreparedServerTurn, call_filter: CallFilter | None,
                     contract: OutputContract | None,
                     ) -> tuple[Rewritten, CallFilter, OutputContract | None]:
    """The request with the server-side turn's token and the recipients the grammar admits; the
    guard's filter admitting the allowed server-side call items (no function when the selection
    named server-side tools only); a required turn satisfied by a server-side call too."""
    from .server_turn import TURN_KEY
    from ..wire import ALLOWLIST_KEY, no_function_wire, with_server_recipients
    body = dict(rewritten.body)
    body[TURN_KEY] = server.turn.token
    selection = server.selection
    if selection is not None and selection.entries:
        wire = body.get(ALLOWLIST_KEY)
        if server.only_server or not isinstance(wire, dict):
            names = [t["name"] for t in body.get("tools") or ()
                     if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)]
            wire = no_function_wire(selection.mode, names, body.get("parallel_tool_calls") is not False)
            body["tool_choice"] = selection.mode
        body[ALLOWLIST_KEY] = with_server_recipients(wire, selection.recipients(server.turn.tools))
    logger.info("vllm-allowed-tools: server-side tools %s, allowed %s%s",
                sorted({t.namespace for t in server.turn.tools.tools}),
                "all" if selection is None else sorted(selection.entries, key=str),
                ", resuming an answered approval" if server.turn.resume is not None else "")
    call_filter = ServerTurnFilter(call_filter, server.turn, functions=not server.only_server)
    if contract is not None and selection is not None and selection.entries:
        contract = contract.satisfied_by_any_call()   # a server-side call satisfies it too
    return replace(rewritten, body=body, changed=True), call_filter, contract
