"""Digests that bind an approval to one exact call and one exact tool definition.

Both are ``"sha256:<64 hex>"`` strings (the algorithm is named on the wire so it can change later).

* :func:`arguments_digest`: over the **canonical JSON** of the call's arguments
  (:func:`vllm_allowed_tools.request.allowlist.canonical_json`: sorted keys, no whitespace), so formatting and
  key order do not matter but every value does (``1`` and ``1.0`` differ, as do ``"1"`` and ``1``).
  Arguments that are not one unambiguous JSON value (invalid JSON, duplicate keys, ``NaN`` /
  ``Infinity``) are digested over their exact text with a different prefix: such a call can still be
  approved, but only byte for byte, and it never collides with a canonical one. Duplicate keys are
  not canonicalized because two JSON parsers may disagree on which value wins, and an approval must
  mean the same call to whoever executes it.
* :func:`definition_digest`: the catalog's own :attr:`FunctionSpec.digest` (identity, description and
  parameters; ``strict`` is not part of it), so a changed definition never matches an old approval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from ..request import FunctionSpec, ToolIdentity, canonical_json, function_digest, strict_json_loads

__all__ = ["PREFIX", "arguments_digest", "canonical_arguments", "definition_digest"]

PREFIX = "sha256:"


def canonical_arguments(arguments: str | Mapping[str, Any]) -> str | None:
    """The canonical JSON text of ``arguments`` (a JSON string as models emit it, or a parsed
    mapping), or None when the text is not one unambiguous JSON value."""
    if not isinstance(arguments, str):
        return canonical_json(arguments)
    try:
        value = strict_json_loads(arguments)
    except (ValueError, RecursionError):
        return None
    return canonical_json(value)


def arguments_digest(arguments: str | Mapping[str, Any]) -> str:
    """``sha256:`` of the canonical arguments (see the module docstring)."""
    canonical = canonical_arguments(arguments)
    text = "json:" + canonical if canonical is not None else "raw:" + str(arguments)
    return PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def definition_digest(spec: FunctionSpec | None = None, *, identity: ToolIdentity | None = None,
                      description: str | None = None,
                      parameters: Mapping[str, Any] | None = None) -> str:
    """``sha256:`` of a tool definition: from a :class:`FunctionSpec`, or from its parts (a missing
    ``parameters`` is the empty object schema, as in :meth:`FunctionSpec.build`)."""
    if spec is not None:
        return PREFIX + spec.digest
    if identity is None:
        raise TypeError("definition_digest needs a FunctionSpec or an identity")
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    return PREFIX + function_digest(identity, description, params)
