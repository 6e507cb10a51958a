"""Which tools a person's message asks for: the app's simple, documented rule.

The model is small (SmolLM2-135M-Instruct): left to ``tool_choice: "auto"`` with the whole catalog
it mostly answers in prose, and now and then calls a tool the message never asked for. So the app
decides each turn, from words in the message, which tools the first request *may* call, and sends
``allowed_tools`` in ``required`` mode over just those: the catalog stays whole (the server's
prompt cache reuses it) and the policy says which part of it this turn can use. Once the calls have
run (or were declined) it asks for a plain text answer (``tool_choice: "none"``). A message naming
no tool gets a text answer. With a larger model, ``allowed_tools`` in ``auto`` mode over a wider
subset lets the model decide whether to call at all.
"""

from __future__ import annotations

import re
from typing import Any

#: tool -> words that ask for it (whole words, any case); "meeting" is not one: "email the
#: meeting notes" asks for an email, not a calendar entry
KEYWORDS: dict[str, tuple[str, ...]] = {
    "get_weather": ("weather", "forecast"),
    "add_calendar_event": ("calendar", "schedule"),
    "send_email": ("email", "mail", "e-mail"),
    "delete_file": ("delete", "remove"),
}


def tools_asked_for(message: str) -> list[str]:
    """The tools whose keywords occur in ``message``, in :data:`KEYWORDS` order."""
    words = set(re.findall(r"[a-z][a-z-]*", message.lower()))
    return [tool for tool, keys in KEYWORDS.items() if words & set(keys)]


def must_call(tools: list[str]) -> dict[str, Any] | str:
    """The ``tool_choice`` that makes this request call one of ``tools`` (``"none"``: none)."""
    if not tools:
        return "none"
    return {"type": "allowed_tools", "mode": "required",
            "tools": [{"type": "function", "name": name} for name in tools]}


TEXT_ANSWER = "none"
