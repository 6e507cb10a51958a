"""Which tools a person's message asks for: the app's simple, documented rule.

The demo model is tiny and random: left to ``tool_choice: "auto"`` it calls whatever it likes. So
the app decides, from words in the message, which tools the first request of a turn *must* call
(``allowed_tools`` in ``required`` mode over those tools), and asks for a plain text answer
(``tool_choice: "none"``) once the calls have run. A message naming no tool gets a text answer.
With a real model, send ``"auto"`` (or an ``allowed_tools`` subset in ``auto`` mode) instead.
"""

from __future__ import annotations

import re
from typing import Any

#: tool -> words that ask for it (whole words, any case)
KEYWORDS: dict[str, tuple[str, ...]] = {
    "get_weather": ("weather", "forecast"),
    "create_calendar": ("calendar", "meeting", "schedule"),
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
