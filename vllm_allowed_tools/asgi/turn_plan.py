"""One tool-bearing request's plan: everything decided about the turn before vLLM sees it.

:func:`plan_turn` builds it from the client's body and the server's settings, with no I/O; the
approvals (:meth:`TurnPlan.approved`, after they read the grant store) and the server-side turn
(:meth:`TurnPlan.sealed`) refine it into a new plan. The guard on the way out
(:class:`.guarded_send.GuardedSend`) reads the last one, so what the request was rewritten to and
what its answer is judged by cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..approvals.approval_turn import PreparedTurn
from ..approvals.response_bodies import ResponseApprovals
from ..call_filter import CallFilter
from ..decode.custom_capability import refuse_uncarried_custom_tools
from ..errors import AllowedToolsError
from ..formats import wire_format
from ..metrics import record_fallback
from ..request import resolve_callable_catalog
from ..request.custom_tools import read_custom_tools
from ..request.placement import LAST_MESSAGE, SYSTEM_MESSAGE, place_policy
from ..request.rewrite import Api, Rewritten, constrain_to_catalog, echo_of, filter_catalog, rewrite_request
from ..response import AllowedNames
from ..response.contract import OutputContract
from ..server_tools.request import PreparedServerTurn
from ..server_tools.server_turn import ServerTurn
from ..settings import PLAIN_CATALOG, Settings
from ..server_tools.forwarding import with_server_turn

#: ``code`` of the 400 for a tool-bearing request on a route the guard does not cover.
CODE_UNGUARDED_ENDPOINT = "unguarded_endpoint"


@dataclass(frozen=True)
class TurnPlan:
    """The request to forward and how its answer is judged.

    ``call_filter``: what every call leaving the server is checked against (None: the request has
    no tools, so only the Open Responses fixer runs); ``contract``: the turn's backstops (None for
    a render, which answers with the prompt); ``approvals``/``commit``: the Responses approvals
    applied to the answer and the grant-store writes made once vLLM accepts the request;
    ``server``: the request's server-side turn."""

    api: Api
    render: bool
    placement: str
    rewritten: Rewritten
    call_filter: CallFilter | None
    contract: OutputContract | None
    #: Chat: the request's custom tools, whose function calls go out as custom calls
    custom_names: frozenset[str] = frozenset()
    approvals: ResponseApprovals | None = None
    commit: Callable[[], object] | None = None
    server: PreparedServerTurn | None = None

    @property
    def echo(self) -> dict[str, Any]:
        """Responses fields to echo as the client sent them (``restore_echo``)."""
        return echo_of(self.rewritten, self.api)

    @property
    def server_turn(self) -> ServerTurn | None:
        """The server-side calls vLLM's loop decides (none for a render: nothing runs)."""
        return self.server.turn if self.server is not None and not self.render else None

    def body(self) -> bytes | None:
        """The body to forward, when it is not the client's own."""
        return json.dumps(self.rewritten.body).encode() if self.rewritten.changed else None

    def approved(self, turn: PreparedTurn) -> TurnPlan:
        """The plan after the approvals: their rewrite forwarded; on Chat, the calls they blocked
        refused by the guard; on Responses, their decisions applied to the answer."""
        call_filter = self.call_filter
        if turn.chat is not None and call_filter is not None:
            call_filter = turn.chat.call_filter(call_filter)
        return replace(self, rewritten=turn.rewritten, call_filter=call_filter,
                       approvals=turn.responses, commit=turn.commit)

    def sealed(self) -> TurnPlan:
        """The plan as sent: the policy block placed last (after the approvals read the client's
        own history) and the server-side turn joined in."""
        plan = replace(self, rewritten=_with_policy_block(self.rewritten, self.api, self.placement))
        if self.server is None:
            return plan
        rewritten, call_filter, contract = with_server_turn(plan.rewritten, self.server,
                                                            plan.call_filter, plan.contract)
        return replace(plan, rewritten=rewritten, call_filter=call_filter, contract=contract)


def plan_turn(data: dict[str, Any], api: Api, settings: Settings, *, placement: str, render: bool,
              filter_catalogs: bool, approvals: bool,
              server: PreparedServerTurn | None = None) -> TurnPlan:
    """The plan for ``data`` (the client's body, or the server-side step's rewrite of it), or an
    AllowedToolsError (a 400) before generation. ``placement``: where the template takes the
    policy; ``filter_catalogs``: the template cannot take it at all, so the catalog sent is the
    allowed subset; ``approvals``: the operator's approvals are on."""
    parser = settings.launch.tool_call_parser
    rewritten = rewrite_request(data, api, placement,
                                check_turn=lambda turn: refuse_uncarried_custom_tools(turn, parser))
    request = rewritten.request
    _refuse_final_message_continuation(request, rewritten, placement)
    _refuse_unguardable_fields(request, api, approvals=approvals, render=render)
    if filter_catalogs and rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        rewritten = replace(rewritten, body=filter_catalog(rewritten.body, rewritten.allowlist))
        record_fallback("filter_catalog")
    call_filter = output_filter(rewritten, request, api)
    # a render answers with the prompt, not with the model's output: nothing for the backstops
    contract = output_contract(rewritten, request, api,
                                strict_all=settings.launch.strict_level_parameter) \
        if call_filter is not None and not render else None
    if settings.plain_decoding == PLAIN_CATALOG:
        rewritten = constrain_to_catalog(rewritten, api, required=_calls_in_own_syntax(parser))
    custom_names = read_custom_tools(request.get("tools"), api).names \
        if api == "chat" and not render else frozenset()
    return TurnPlan(api=api, render=render, placement=placement, rewritten=rewritten,
                    call_filter=call_filter, contract=contract, custom_names=custom_names,
                    server=server)


def _calls_in_own_syntax(parser: str | None) -> bool:
    """Whether a plain ``required`` turn on ``parser`` is decoded in the format's call syntax (its
    calls are no JSON: vLLM's required path would make the model write a JSON array, a syntax it
    was not trained to write there and its parser does not read)."""
    if parser is None:
        return False
    try:
        return wire_format(parser).grammar.call_syntax == "pythonic"
    except ValueError:   # not one of ours: vLLM's own parser, vLLM's own required path
        return False


def _with_policy_block(rewritten: Rewritten, api: Api, placement: str) -> Rewritten:
    """The request with the policy block as a message, where the template takes it so."""
    allowlist = rewritten.allowlist
    if placement not in (SYSTEM_MESSAGE, LAST_MESSAGE) or allowlist is None \
            or not allowlist.has_allowlist:
        return rewritten
    body = place_policy(rewritten.body, api, placement, allowlist.mode or allowlist.choice,
                        sorted(allowlist.allowed_flat_names))
    return replace(rewritten, body=body, changed=True)


def _refuse_final_message_continuation(data: dict, rewritten: Rewritten, placement: str) -> None:
    if placement in (SYSTEM_MESSAGE, LAST_MESSAGE) and data.get("continue_final_message") is True \
            and rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        raise AllowedToolsError(
            "`continue_final_message` cannot be combined with allowed_tools on this server: the "
            "served template takes the per-turn policy as a message after the history, so the "
            "final message would no longer be the last. Send the request without it.",
            param="continue_final_message", code="unsupported_with_allowed_tools")


def output_filter(rewritten: Rewritten, body: dict, api: Api) -> CallFilter | None:
    """What the guard checks calls against: the allowlist when the turn has one, else the catalog
    (a call to a name the request never offered is refused in every mode); None without tools."""
    if rewritten.allowlist is not None and rewritten.allowlist.has_allowlist:
        return rewritten.allowlist
    if body.get("tools"):
        return AllowedNames.from_request(body, api)
    return None


def output_contract(rewritten: Rewritten, body: dict, api: Api, *, strict_all: bool) -> OutputContract:
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
    return OutputContract.for_turn(turn, strict_all=strict_all, custom_grammars=grammars,
                                   max_tokens=_output_limit(body) if api == "chat" else None)


def _output_limit(body: dict) -> int | None:
    """The Chat request's output limit (``max_completion_tokens``, else ``max_tokens``)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


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
