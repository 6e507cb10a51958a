"""Approvals on Chat Completions, decided before generation.

Chat has no item that could carry an elicitation, so a gated call without a live grant can never be
released there. That is known when the request arrives: a turn that could only produce such calls
is a 400, and in other turns those tools are taken out of what the grammar admits. The rules:
``docs/approvals.md`` ("Chat Completions").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..call_filter import CallFilter, CallKind
from ..request import TurnAllowlist
from .engine import ApprovalEngine, ProposedCall
from .approval_errors import ApprovalInputError
from .hints import approval_hint

__all__ = ["CODE_TOOL_NEEDS_APPROVAL", "ChatApprovals", "ChatCallFilter", "decide_chat_turn"]

#: ``code`` of the 400 for a Chat turn whose ``tool_choice`` can only call gated tools without a grant.
CODE_TOOL_NEEDS_APPROVAL = "tool_needs_approval"

_HOW_TO_APPROVE = (
    "Chat Completions cannot carry an approval request, so such a call could only be refused after "
    "generation. Send the request to POST /v1/responses instead (the call then comes back as an "
    "`elicitation` item for the user to answer), or first obtain there a grant for this API key "
    "that is not bound to arguments: scope `always`, or scope `session` with the same "
    "`prompt_cache_key` as this request.")


@dataclass(frozen=True)
class ChatApprovals:
    """What the approval policy leaves callable in one Chat turn (decided when it arrives).

    ``blocked``: flat names of gated tools (functions and custom tools alike) no live grant covers;
    the grammar does not admit them and the output guard refuses them. ``granted``: flat name -> the grant that releases its calls.
    """

    blocked: frozenset[str] = frozenset()
    granted: Mapping[str, str] = field(default_factory=dict)

    def call_filter(self, base: CallFilter) -> ChatCallFilter:
        """The output guard's filter: ``base`` without the blocked tools."""
        return ChatCallFilter(base, self.blocked)


class ChatCallFilter(CallFilter):
    """The guard's backstop on Chat: a blocked tool is never let out, whatever the grammar did."""

    __slots__ = ("base", "blocked")

    def __init__(self, base: CallFilter, blocked: frozenset[str]) -> None:
        self.base = base
        self.blocked = blocked

    def allows(self, kind: CallKind, name: str | None) -> bool:
        if kind in ("function", "custom") and name in self.blocked:
            return False
        return self.base.allows(kind, name)

    def knows(self, kind: CallKind, name: str) -> bool | None:
        return self.base.knows(kind, name)

    def refusal_message(self, kind: CallKind, name: str | None, *, public_name: bool) -> str | None:
        """A blocked tool's refusal says how to approve it; anything else is ``base``'s."""
        if kind not in ("function", "custom") or name not in self.blocked:
            return self.base.refusal_message(kind, name, public_name=public_name)
        flat_name = name
        shown = f"tool {flat_name!r}" if public_name else "a tool"
        return (f"The model produced a call to {shown} that needs approval under this server's "
                f"policy; the response was withheld (allowed_tools_violation). Sending the same "
                f"request again cannot release that call. {_HOW_TO_APPROVE}")


def decide_chat_turn(engine: ApprovalEngine, body: Mapping[str, Any], turn: TurnAllowlist | None,
                     *, principal: str, session: str | None,
                     now: float | None = None) -> ChatApprovals:
    """Which of the turn's callable tools are gated without a live grant; raises
    :class:`ApprovalInputError` (400 ``tool_needs_approval``) when ``tool_choice`` forces a call
    and every tool it may call is such a tool. Blocking (it reads the grant store)."""
    if turn is None or turn.choice == "none":
        return ChatApprovals()
    now = engine.clock() if now is None else now
    hints = _chat_hints(body)
    blocked: set[str] = set()
    granted: dict[str, str] = {}
    for spec in turn.allowed_specs:
        hint, where = hints.get(spec.flat_name, (None, "approval"))
        call = ProposedCall.from_spec(spec, call_id="", arguments="", hint=hint, hint_param=where)
        if not engine.needs_approval(call):
            continue
        grant_id = _standing_grant(engine, call, principal, session, now)
        if grant_id is None:
            blocked.add(spec.flat_name)
        else:
            granted[spec.flat_name] = grant_id
    _refuse_forced_blocked(turn, blocked)
    return ChatApprovals(frozenset(blocked), granted)


def _standing_grant(engine: ApprovalEngine, call: ProposedCall, principal: str,
                    session: str | None, now: float) -> str | None:
    """The id of a live grant releasing every call of ``call``'s tool (not bound to arguments, its
    scope still offered by the policy), or None."""
    effective = engine.policy.effective(call.identity, call.hint, hint_param=call.hint_param)
    for grant in engine.matching_grants(call, principal=principal, session=session, now=now,
                                        unbound_only=True):
        if grant.arguments_digest is None and grant.is_live(now) \
                and effective.allows_grant(grant.scope, False):
            return grant.id
    return None


def _refuse_forced_blocked(turn: TurnAllowlist, blocked: set[str]) -> None:
    """A turn that must call a tool (named, ``required``, ``allowed_tools`` in ``required`` mode)
    while every tool it may call is blocked: a 400 now, instead of a call refused after generation."""
    callable_names = turn.allowed_flat_names
    if not blocked or any(name not in blocked for name in callable_names):
        return
    if turn.choice == "named":
        param, what = "tool_choice.function.name", f"tool_choice names {callable_names[0]!r}"
    elif turn.choice == "required":
        param, what = "tool_choice", ("tool_choice is `required` and every tool in `tools` ("
                                      f"{', '.join(callable_names)}) needs approval")
    elif turn.choice == "allowed" and turn.mode == "required":
        param, what = "tool_choice.allowed_tools.tools", (
            "tool_choice is `allowed_tools` in `required` mode and every allowed tool ("
            f"{', '.join(callable_names)}) needs approval")
    else:
        return   # auto: the model may answer in text; the grammar admits no call
    if turn.choice == "named":
        what += ", which needs approval under this server's policy"
    raise ApprovalInputError(
        f"{what}, and no live grant for this API key and session covers it. {_HOW_TO_APPROVE} Or "
        "let the model choose (`tool_choice: auto`): tools that need approval are then not called.",
        param=param, code=CODE_TOOL_NEEDS_APPROVAL)


def _chat_hints(body: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """flat name -> (the Chat tool definition's approval hint, where it sits)."""
    hints: dict[str, tuple[Any, str]] = {}
    for index, tool in enumerate(body.get("tools") or []):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if isinstance(name, str):
            where = "approval" if "approval" in tool else "function.approval"
            hints[name] = (approval_hint(tool), f"tools[{index}].{where}")
    return hints

