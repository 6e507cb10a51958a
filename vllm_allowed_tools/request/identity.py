"""How a tool is named on the wire: one join of namespace and name for every part of the package."""
from __future__ import annotations

from typing import Any

__all__ = ["NAMESPACE_SEPARATOR", "flat_name"]

# vLLM flattens a Responses namespace member to ``namespace__name`` before the template renders it.
NAMESPACE_SEPARATOR = "__"


def flat_name(name: Any, namespace: Any = None) -> str | None:
    """The name the model sees and emits: ``name``, or ``namespace__name`` for a namespace member.

    None when ``name`` is not a non-empty string, so a malformed call never matches a real tool."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(namespace, str) and namespace:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return name
