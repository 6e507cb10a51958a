"""JSON as the request path reads it: one strict parser, and private copies of client values.

A validator, a digest and a handler must never read different values from the same text. What
digests are taken over is :mod:`.digest` (RFC 8785)."""
from __future__ import annotations

import copy
import json
from typing import Any

__all__ = ["NotStrictJSON", "copy_json", "strict_json_loads"]


class NotStrictJSON(ValueError):
    """JSON text that only parses by picking one of several readings (a repeated key, NaN)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            shown = key if len(key) <= 60 else key[:57] + "..."
            raise NotStrictJSON(f"duplicate key {shown!r}")
        result[key] = value
    return result


def _no_constants(token: str) -> Any:
    raise NotStrictJSON(f"{token} is not valid JSON")


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that refuses repeated keys and ``NaN``/``Infinity``: with those, a validator,
    a digest and a handler could each read a different value from the same text."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)


def copy_json(value: Any) -> Any:
    """A private copy of a client value (a JSON round trip is much faster than deepcopy)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return copy.deepcopy(value)
