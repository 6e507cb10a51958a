"""The digests that bind approvals, grants, idempotency keys and caches to one exact value: SHA-256
over the value's RFC 8785 form (the JSON Canonicalization Scheme), so a client or a gateway can
recompute any of them with a standard RFC 8785 library instead of imitating this package.

RFC 8785 reads every number as an IEEE-754 double (``1``, ``1.0`` and ``1e0`` are one number, and
``-0.0`` is ``0``), writes it the way ECMAScript does, and sorts object keys by their UTF-16 code
units. It cannot represent NaN, the infinities, integers beyond +/-(2**53 - 1) (the ``rfc8785``
library refuses them rather than round them, and rounding would make two integers one digest) or
unpaired surrogates. A request must never fail on such a value, so its digest is taken over a
fallback form instead, which starts with a prefix no RFC 8785 text starts with, so it never equals
a canonical one:

* a JSON text (:func:`text_digest`): ``raw:`` followed by the exact text (also for a text that is not
  strict JSON), so such a value is bound byte for byte;
* a parsed value (:func:`value_digest`): ``python-json:`` followed by ``json.dumps`` of it with
  sorted keys, no whitespace and ASCII only.

The rule as clients read it, with a worked example: ``docs/approvals.md`` ("Digests").
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any

import rfc8785

from .json_text import strict_json_loads

__all__ = ["RAW_TEXT_PREFIX", "VALUE_FALLBACK_PREFIX", "NotCanonicalJSON", "canonical_json_bytes",
           "text_digest", "value_digest"]

logger = logging.getLogger(__name__)

#: what a JSON text RFC 8785 cannot canonicalize is hashed under, followed by the text itself
RAW_TEXT_PREFIX = "raw:"
#: what a parsed value RFC 8785 cannot canonicalize is hashed under, followed by its Python JSON
VALUE_FALLBACK_PREFIX = "python-json:"

_MAX_SAFE_INTEGER = 2**53 - 1


class NotCanonicalJSON(ValueError):
    """A value RFC 8785 cannot represent. ``path`` names the first such field (``ids[2]``, ``a.b``;
    empty for the value itself); the message says what to send instead."""

    def __init__(self, name: str, suffix: str, why: str) -> None:
        self.path = suffix[1:] if suffix.startswith(".") else suffix
        super().__init__(f"{name}{suffix} {why}")


def canonical_json_bytes(value: Any, *, name: str = "value") -> bytes:
    """The RFC 8785 canonical JSON of ``value``: the one serialization every digest is taken over.

    Raises :class:`NotCanonicalJSON` naming the field (``name`` is what the message calls
    ``value``) when RFC 8785 cannot represent it, and ``RecursionError`` when it is nested deeper
    than Python can walk."""
    try:
        return rfc8785.dumps(value)
    except (rfc8785.CanonicalizationError, UnicodeError):
        suffix, why = _first_unrepresentable(value, "") or ("", "is not a JSON value")
        raise NotCanonicalJSON(name, suffix, why) from None


def value_digest(value: Any) -> str:
    """Hex SHA-256 of ``canonical_json_bytes(value)``; a value RFC 8785 cannot represent is hashed
    as ``python-json:`` + its sorted, compact, ASCII-only ``json.dumps`` (never an error for a
    parsed JSON body)."""
    try:
        data = canonical_json_bytes(value)
    except (NotCanonicalJSON, RecursionError) as exc:
        logger.debug("digest of a value RFC 8785 cannot represent, under %r: %s",
                     VALUE_FALLBACK_PREFIX, exc)
        data = (VALUE_FALLBACK_PREFIX + json.dumps(value, sort_keys=True, separators=(",", ":"),
                                                   ensure_ascii=True, default=repr)).encode("ascii")
    return hashlib.sha256(data).hexdigest()


def text_digest(text: str) -> str:
    """Hex SHA-256 of the RFC 8785 form of the value JSON ``text`` holds, read strictly (repeated
    keys and NaN are refused: parsers disagree on them). A text that does not read strictly, or
    whose value RFC 8785 cannot represent, is hashed as ``raw:`` + the exact text (UTF-8)."""
    try:
        data = canonical_json_bytes(strict_json_loads(text))
    except (ValueError, RecursionError):  # NotStrictJSON, JSONDecodeError, NotCanonicalJSON
        data = (RAW_TEXT_PREFIX + text).encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()


def _first_unrepresentable(value: Any, path: str) -> tuple[str, str] | None:
    """(path, why) of the first part of ``value`` RFC 8785 refuses, depth first (``path`` as
    ``.key[index]``, from ``path``); None if none. Walked only after a refusal, to name the field."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return path, f"has the key {key!r}, which is not a string; JSON keys are strings"
            where = f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"
            if not _is_text(key):
                return where, "is a key holding an unpaired surrogate, which is not Unicode text"
            found = _first_unrepresentable(item, where)
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found = _first_unrepresentable(item, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    why = _why_unrepresentable(value)
    return None if why is None else (path, why)


def _why_unrepresentable(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        if abs(value) <= _MAX_SAFE_INTEGER:
            return None
        return (f"is the integer {value}, outside +/-(2**53 - 1), the integers an IEEE-754 double "
                "(a JSON number under RFC 8785) holds exactly; send it as a string")
    if isinstance(value, float):
        if math.isfinite(value):
            return None
        return f"is {value!r}, which JSON cannot carry; send a finite number or a string"
    if isinstance(value, str):
        return None if _is_text(value) else "holds an unpaired surrogate, which is not Unicode text"
    return f"is a Python {type(value).__name__}, not a JSON value"


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
