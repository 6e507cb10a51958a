"""Refusal messages quote what the model sent; these keep a quote short enough to read, so a huge
name or argument never floods the model's context or the logs."""

from __future__ import annotations

from typing import Any

MAX_LISTED_NAMES = 20
MAX_QUOTED = 120


def short(value: Any, limit: int = MAX_QUOTED) -> str:
    """``value`` (a string as is, anything else as its repr), cut to ``limit`` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def listed_names(names: list[str]) -> str:
    """The first :data:`MAX_LISTED_NAMES` names, comma separated, with a count of the rest."""
    shown = ", ".join(names[:MAX_LISTED_NAMES])
    if len(names) > MAX_LISTED_NAMES:
        shown += f", ... ({len(names) - MAX_LISTED_NAMES} more)"
    return shown
