"""The approvals' part of one tool-bearing turn, before vLLM sees it: :func:`prepare_turn`.

The middleware hands over the rewritten request; the approvals check the client's hints, read the
grant store (standing grants, the client's answers to earlier elicitations) and say what to forward,
what the output guard and the response then need, and what to write to the store once vLLM has
accepted the request. It blocks on the store: call it off the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import AllowedToolsError
from ..request import ToolIdentity, TurnAllowlist, resolve_callable_catalog
from ..request.rewrite import Api, Rewritten, narrow_allowlist
from ..response import request_tools
from .chat import ChatApprovals, decide_chat_turn
from .engine import ApprovalEngine
from .hints import check_hints
from .response_bodies import (
    ResponseApprovals,
    prepare_request,
    principal_from_headers,
    session_of,
    strip_approval_hints,
)


@dataclass(frozen=True)
class PreparedTurn:
    """What the approvals make of a turn. At most one of ``chat``, ``responses`` and
    ``direct_output`` is set."""

    #: the request to forward: approval hints stripped; on Chat, the gated tools the turn may not
    #: call taken out of what the grammar admits; on Responses, answered elicitations replaced by
    #: what the model is to see
    rewritten: Rewritten
    #: Chat: decided before generation; the output guard refuses the calls it blocked
    chat: ChatApprovals | None = None
    #: Responses: applied to the answer (a gated call becomes an elicitation, or is released)
    responses: ResponseApprovals | None = None
    #: Responses: calls an approval released without the model, to answer with directly
    direct_output: list[dict[str, Any]] | None = None
    #: the grant-store writes to make once vLLM accepts the request (consumed answers, new grants)
    commit: Callable[[], Any] | None = None


def prepare_turn(engine: ApprovalEngine, data: Mapping[str, Any], rewritten: Rewritten, api: Api, *,
                 headers: Sequence[tuple[bytes, bytes]], render: bool) -> PreparedTurn:
    """The approvals' part of the turn ``data`` (the client's body as read) rewritten to
    ``rewritten``; ``headers``: the request's, for the principal. A render request never reaches the
    grant store: it cannot answer an elicitation. Raises AllowedToolsError (a 400, or a 503 when the
    store is down) before generation."""
    check_hints(data, engine.policy)   # a bad `approval` object: 400 before generation
    catalog = rewritten.allowlist or resolve_callable_catalog(data, api)
    _refuse_unmodelled_gated_custom_tools(data, api, engine, catalog)
    body = strip_approval_hints(rewritten.body)
    stripped = replace(rewritten, body=body, changed=rewritten.changed or body is not rewritten.body)
    if render:
        _refuse_approval_items(data)
        return PreparedTurn(stripped)
    principal = principal_from_headers(headers, engine.store.principal_secret)
    session = session_of(data)
    if api == "chat":
        chat = decide_chat_turn(engine, data, catalog, principal=principal, session=session)
        return PreparedTurn(narrow_allowlist(stripped, chat.blocked), chat=chat)
    prepared = prepare_request(engine, body, principal=principal, session=session, catalog=catalog)
    if prepared.direct_output is not None:
        return PreparedTurn(rewritten, direct_output=prepared.direct_output)
    changed = rewritten.changed or prepared.changed or prepared.body is not rewritten.body
    responses = ResponseApprovals(engine, data, catalog, principal=principal,
                                  session=session) if catalog is not None else None
    if responses is not None and responses.may_call_gated():
        engine.check_store()   # down: 503 now, before any generation
    return PreparedTurn(replace(rewritten, body=prepared.body, changed=changed), responses=responses,
                        commit=prepared.commit)


def _refuse_approval_items(body: Mapping[str, Any]) -> None:
    """Render endpoints never consume an elicitation or mint a grant, so they take no answers."""
    for index, item in enumerate(body.get("input") if isinstance(body.get("input"), list) else ()):
        if isinstance(item, dict) and item.get("type") in ("elicitation", "elicitation_response"):
            raise AllowedToolsError(
                f"input[{index}] is an `{item['type']}` item; render endpoints do not answer or "
                "replay approvals. Render the conversation without elicitation items, or send the "
                "answer to POST /v1/responses.", param=f"input[{index}]",
                code="approval_items_not_rendered")


def _refuse_unmodelled_gated_custom_tools(body: Mapping[str, Any], api: Api, engine: ApprovalEngine,
                                          catalog: TurnAllowlist | None) -> None:
    """A gated ``custom`` tool is approved like a function (Responses: its ``custom_tool_call`` is
    elicited; Chat: decided before generation), which needs the resolver's spec of it. One the
    catalog does not model (a namespace member, which vLLM does not render; a Chat custom tool
    where the resolver has no Chat custom shape) could only be served unasked: it is refused
    before generation, failing closed. Ungated ones are served as before."""
    modelled = {spec.flat_name for spec in catalog.catalog if spec.kind == "custom"} \
        if catalog is not None else set()
    for param, kind, namespace, name in request_tools(body, api):
        identity = ToolIdentity(namespace, name)
        if kind == "custom" and identity.flat_name not in modelled \
                and engine.policy.effective(identity).required:
            raise AllowedToolsError(
                f"{param} is the custom tool {identity.flat_name!r}, which this server's approval "
                "policy gates, and this server cannot ask for approval of its calls in this "
                "position (approvals cover top-level custom tools of POST /v1/responses). Define "
                "it as a top-level custom tool on /v1/responses, or ask the operator to exempt it.",
                param=param, code="custom_tool_needs_approval")
