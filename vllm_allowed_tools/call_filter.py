"""What a guard asks of a turn's policy about one call the model made: may it go out, and if not,
what the error says.

Every filter the guards are handed subclasses :class:`CallFilter`, so the decision is one typed
method call: a filter that lacks ``allows`` cannot be built, and renaming a method is an error at
the call site, never a quietly different decision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

#: a call's kind: a function tool's call, a custom tool's call, or a built-in tool's call (a
#: Responses output item the server runs: ``web_search_call``, ``mcp_call``, ...; its name is the
#: item type)
CallKind = Literal["function", "custom", "builtin"]


class CallFilter(ABC):
    """One turn's judge of calls by kind and name (the flat name the model emits)."""

    __slots__ = ()

    @abstractmethod
    def allows(self, kind: CallKind, name: str | None) -> bool:
        """Whether a call of ``kind`` named ``name`` may leave the server; a call without a name
        never may."""

    def knows(self, kind: CallKind, name: str) -> bool | None:
        """Whether the request offered ``name`` at all (None: this filter cannot tell); it only
        chooses the refusal's wording ("not in the catalog" or "not allowed this turn")."""
        return None

    def refusal_message(self, kind: CallKind, name: str | None, *, public_name: bool) -> str | None:
        """The error text for a refused call when this filter has its own reason (None: the
        guard's usual text). ``public_name``: the text may name the tool (a unary answer)."""
        return None
