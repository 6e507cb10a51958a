"""JSON as the request path reads and hashes it: one strict parser, one canonical serialization.

A validator, a digest and a handler must never read different values from the same text, and every
digest of the package is taken over the same bytes."""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

__all__ = ["NotStrictJSON", "canonical_json", "copy_json", "sha256_text", "strict_json_loads"]


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


def canonical_json(obj: Any) -> str:
    """The one JSON serialization every digest is computed over (sorted keys, no whitespace).

    Values JSON cannot represent (never present in a parsed request body) serialize as their
    ``repr`` so that a digest is still computed instead of failing the request.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)


def sha256_text(text: str) -> str:
    """Hex sha256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def copy_json(value: Any) -> Any:
    """A private copy of a client value (a JSON round trip is much faster than deepcopy)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return copy.deepcopy(value)
