"""One chat: the Responses ``input`` history the app keeps and resends, and how the page sees it.

The history is the client's own record, as the OpenResponses approvals proposal asks: the person's
messages, the model's messages and calls, the tools' outputs, and every ``elicitation`` item the
server sent together with the person's ``elicitation_response`` to it. Nothing is dropped when an
approval is answered; the server reads the echoes only as pointers to its own records.

:class:`Viewer` turns history items into what the page renders (the same shape whether the page
loads the whole chat or receives items while they stream).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from approval_options import ApprovalOptions

#: what the model reads first; a small model needs telling to reuse the request's own words in a
#: call and to answer a tool's result (or a decline) in words rather than echo it
SYSTEM_PROMPT = ("You are a helpful assistant. When you call a tool, use the names and details "
                 "from the user's request. When a tool has run or was declined, tell the user in "
                 "one short sentence what happened.")


def new_session_key() -> str:
    """The chat's ``prompt_cache_key``: the session a "this session" grant is bound to."""
    return "approval-chat-" + secrets.token_hex(8)


@dataclass
class Conversation:
    """One chat of one person; its ``session`` key is what "this session" grants are bound to."""

    session: str = field(default_factory=new_session_key)
    history: list[dict[str, Any]] = field(
        default_factory=lambda: [{"role": "system", "content": SYSTEM_PROMPT}])
    #: elicitation items of the last response, waiting for the person's answers
    pending: list[dict[str, Any]] = field(default_factory=list)
    #: the tools this turn's first request had to call (an accept is resent allowing them)
    turn_tools: list[str] = field(default_factory=list)
    #: history index of a person's message -> the page's note on that turn's tools
    turn_notes: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: call id -> why a gated call ran (the person's accept, or a grant of theirs)
    released: dict[str, dict[str, str]] = field(default_factory=dict)

    def answer_to(self, elicitation_id: str) -> dict[str, Any] | None:
        """The person's ``elicitation_response`` to one elicitation, if the history holds one."""
        for item in self.history:
            if item.get("type") == "elicitation_response" and \
                    item.get("elicitation_id") == elicitation_id:
                return item
        return None

    def call_name(self, call_id: str) -> str | None:
        for item in self.history:
            if item.get("type") == "function_call" and item.get("call_id") == call_id:
                return item.get("name")
        return None


class Viewer:
    """Turns history items into the page's views; approval views carry their options."""

    def __init__(self, options: ApprovalOptions) -> None:
        self._options = options

    def views(self, chat: Conversation) -> list[dict[str, Any]]:
        """Every history item the page shows, in order, each turn's note after its message."""
        shown = []
        for index, item in enumerate(chat.history):
            view = self.view(chat, item)
            if view is not None:
                shown.append(view)
            if index in chat.turn_notes:
                shown.append(chat.turn_notes[index])
        return shown

    def view(self, chat: Conversation, item: dict[str, Any]) -> dict[str, Any] | None:
        """The page's view of one history item (None: not shown, e.g. the system prompt)."""
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant"):
                return None
            return {"kind": role, "text": _text(item.get("content"))}
        if kind == "function_call":
            return {"kind": "call", "call_id": item["call_id"], "name": item["name"],
                    "arguments": readable_arguments(item.get("arguments", "")),
                    "released": chat.released.get(item["call_id"])}
        if kind == "function_call_output":
            return {"kind": "result", "call_id": item["call_id"],
                    "name": chat.call_name(item["call_id"]), "output": item.get("output", "")}
        if kind == "elicitation":
            return self._approval(chat, item)
        if kind == "elicitation_response":
            return {"kind": "answer", **_answer_view(item)}
        return None

    def _approval(self, chat: Conversation, item: dict[str, Any]) -> dict[str, Any]:
        answer = chat.answer_to(item["id"])
        waiting = any(p["id"] == item["id"] for p in chat.pending)
        scopes = list(item.get("requested_scopes") or [])
        options = self._options.for_prompt(item.get("name", ""), item.get("namespace"), scopes)
        return {"kind": "approval", "id": item["id"], "name": item.get("name"),
                "namespace": item.get("namespace"), "message": item.get("message", ""),
                "arguments": readable_arguments(item.get("arguments", "")),
                "requested_scopes": scopes, "expires_at": item.get("expires_at"),
                "state": "pending" if waiting else ("answered" if answer else "unanswered"),
                "answer": _answer_view(answer) if answer else None,
                "options": [option.to_json() for option in options]}


def readable_arguments(arguments: str) -> dict[str, Any] | str:
    """A call's arguments as an object to list key by key, or the raw text when they are not one."""
    try:
        value = json.loads(arguments)
    except (TypeError, ValueError):
        return arguments
    return value if isinstance(value, dict) else arguments


def _answer_view(answer: dict[str, Any]) -> dict[str, Any]:
    return {"elicitation_id": answer["elicitation_id"], "action": answer["action"],
            "scope": answer.get("scope"), "reason": answer.get("reason")}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and part.get("type") in ("output_text", "input_text"))
    return ""
