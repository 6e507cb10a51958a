"""Digests that bind an approval to one exact call and one exact tool definition, so that an
approval given for one call can never release another. Both are SHA-256 over RFC 8785 canonical
JSON (:mod:`vllm_allowed_tools.request.digest`), so a client can recompute them; the rule and a
worked example: ``docs/approvals.md`` ("Digests").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..request import FunctionSpec, ToolIdentity, function_digest, text_digest, value_digest

__all__ = ["PREFIX", "arguments_digest", "call_arguments_digest", "definition_digest",
           "definition_matches", "input_digest"]

PREFIX = "sha256:"


def arguments_digest(arguments: str | Mapping[str, Any]) -> str:
    """``sha256:`` + hex SHA-256 of the RFC 8785 JSON of the arguments (a JSON text as models emit
    it, read strictly, or a parsed mapping). A text that is not one unambiguous JSON value, or whose
    value RFC 8785 cannot represent, is digested over ``raw:`` + its exact text."""
    if isinstance(arguments, str):
        return PREFIX + text_digest(arguments)
    return PREFIX + value_digest(dict(arguments))


def input_digest(text: str) -> str:
    """``sha256:`` + hex SHA-256 of the RFC 8785 JSON of the string ``text``: the arguments digest of
    a custom tool's call, whose ``input`` is raw text, never read as JSON (``docs/approvals.md``,
    "Custom tools"). A text RFC 8785 cannot represent (an unpaired surrogate) is digested over
    ``python-json:`` + its ASCII ``json.dumps``, as any value is."""
    return PREFIX + value_digest(text)


def call_arguments_digest(arguments: str, kind: str = "function") -> str:
    """The arguments digest of a call to a tool of ``kind``: :func:`arguments_digest` of a function's
    JSON text, :func:`input_digest` of a custom tool's raw input."""
    return input_digest(arguments) if kind == "custom" else arguments_digest(arguments)


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


def definition_matches(current: FunctionSpec | str, recorded: str) -> bool:
    """Is ``recorded`` (a digest an elicitation or grant carries) the digest of ``current`` (a spec,
    or the digest a caller computed for it)?"""
    if isinstance(current, str):
        return current == recorded
    return definition_digest(current) == recorded
