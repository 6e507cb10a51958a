"""The argument and definition digests approvals computed before they followed RFC 8785, kept only
to recognise what was stored then: a ``session`` / ``always`` grant in a store written by an earlier
server, or an elicitation pending across an upgrade. Never used to mint anything new.

A grant holds digests, not the call or the definition, so stored rows cannot be rewritten to the new
rule; instead the lookup asks for both. That widens nothing: each earlier digest is computed from
the very call and definition being checked, so it matches exactly what the earlier server would
have matched. The earlier rule was SHA-256 over Python's ``json.dumps`` with sorted keys, no
whitespace and non-ASCII kept as is; for arguments the hashed text had a ``json:`` prefix (``raw:``
and the exact text for arguments that are not strict JSON, as now).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..request import FunctionSpec, strict_json_loads

__all__ = ["legacy_arguments_digest", "legacy_definition_digest"]

_PREFIX = "sha256:"


def _legacy_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)


def legacy_arguments_digest(arguments: str) -> str | None:
    """The arguments digest an earlier server gave this arguments text; None where it could not
    compute one (it failed the request then, so nothing was stored under it)."""
    try:
        value = strict_json_loads(arguments)
    except (ValueError, RecursionError):
        text = "raw:" + arguments
    else:
        try:
            text = "json:" + _legacy_json(value)
        except RecursionError:
            return None
    return _PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def legacy_definition_digest(spec: FunctionSpec) -> str | None:
    """The definition digest an earlier server gave ``spec``; None where it could not compute one,
    and for a custom tool (an earlier server approved none: nothing was stored for one)."""
    if spec.kind == "custom":
        return None
    try:
        text = _legacy_json({"namespace": spec.identity.namespace, "name": spec.identity.name,
                             "description": spec.description, "parameters": spec.parameters})
        return _PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()
    except (ValueError, TypeError, RecursionError):  # an unpaired surrogate, a key of mixed types
        return None
