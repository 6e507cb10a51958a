"""What the page says about a turn's tools: which the turn allows, which of them wait for the
person, and what let a gated call run.

The wire says none of this for a released call: a ``function_call`` the server released under a
standing grant looks like any other. The app knows the rest itself: the policy (when it started
the server or was given ``--policy``), the answers in its history, and the person's live grants
(read through the store API, as My approvals does). So a gated call with no accept of the person's
in the history ran under a grant, and the page names it ("ran under your session grant").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from approval_options import ApprovalOptions
from my_grants import GrantView

#: how a released call of a gated tool came to run, as the page words it
RELEASED_BY = {
    "approval": "Ran because you allowed it.",
    "session": "Ran under your session grant: you allowed {tool} for this chat, so it did not "
               "ask again.",
    "always": "Ran under your standing grant: you allowed {tool} in every chat, so it did not "
              "ask again.",
}


def covering(grants: Iterable[GrantView], tool: str, session_key: str) -> str | None:
    """The scope of a live grant of ``grants`` that covers ``tool`` in the chat ``session_key``
    (``session`` first), or None."""
    scopes = {g.scope for g in grants if g.tool == tool and
              (g.scope == "always" or g.to_json(session_key)["in_this_chat"])}
    return next((scope for scope in ("session", "always") if scope in scopes), None)


def turn_note(allowed: list[str], mode: str, options: ApprovalOptions,
              grants: list[GrantView], session_key: str) -> dict[str, Any]:
    """The page's note for one turn: each allowed tool and whether it asks the person first
    (``asks``), runs under a grant of theirs (``session`` / ``always``), runs without asking
    (``free``), or the app cannot tell (``unknown``: no policy given)."""
    tools = []
    for name in allowed:
        gated = options.needs_approval(name)
        grant = covering(grants, name, session_key) if gated is not False else None
        state = grant or {True: "asks", False: "free", None: "unknown"}[gated]
        tools.append({"name": name, "gate": state})
    return {"kind": "turn", "mode": mode, "tools": tools,
            "gated": [t["name"] for t in tools if t["gate"] in ("asks", "session", "always")]}


def released_by(call: dict[str, Any], history: list[dict[str, Any]], options: ApprovalOptions,
                grants: list[GrantView], session_key: str) -> dict[str, str] | None:
    """Why a released ``function_call`` ran, when its tool is gated: the person's accept in the
    history (``approval``) or a grant of theirs (``session`` / ``always``); None for a tool that
    runs without asking (or nothing the app can name)."""
    name = call.get("name", "")
    accepted = {item.get("elicitation_id") for item in history
                if item.get("type") == "elicitation_response" and item.get("action") == "accept"}
    for item in history:
        if item.get("type") == "elicitation" and item.get("call_id") == call.get("call_id") \
                and item.get("id") in accepted:
            return {"via": "approval", "text": RELEASED_BY["approval"]}
    if options.needs_approval(name) is False:
        return None
    scope = covering(grants, name, session_key)
    if scope is None:
        return None
    return {"via": "grant", "scope": scope, "text": RELEASED_BY[scope].format(tool=name)}
