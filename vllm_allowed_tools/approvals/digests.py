"""Digests that bind an approval to one exact call and one exact tool definition, so that an
approval given for one call can never release another. How each is computed: ``docs/approvals.md``.
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
    """``sha256:`` of the canonical JSON of the arguments; arguments that are not one unambiguous
    JSON value are digested over their exact text under another prefix."""
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
