"""The approval scopes a person may choose, shared by the policy file, tool definitions' hints and
the wire items so that all three accept exactly the same words."""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["SCOPES", "canonical_scopes"]

#: Every approval scope, narrowest first. ``once`` mints no grant; the others do.
SCOPES: tuple[str, ...] = ("once", "session", "always")


def canonical_scopes(chosen: Collection[str]) -> tuple[str, ...]:
    """``chosen`` in the canonical (narrowest first) order, each scope once."""
    return tuple(scope for scope in SCOPES if scope in chosen)
