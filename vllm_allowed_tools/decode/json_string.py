"""A grammar over text -> the grammar of that text written inside a JSON string.

A ``custom`` tool's input is raw text its grammar (Lark or a regex) admits. Wire formats that carry
raw text (XML parameter values, harmony's channel text) take the grammar as it is; formats whose
calls are JSON carry the input as a JSON string (``{"input": "..."}``), where a quote, a backslash
or a control character of the input is written escaped. :func:`json_string_grammar` rewrites the
grammar's terminals so that it admits exactly the escaped spellings: a string it admits, read as a
JSON string, is a string the source grammar admits, and every string the source admits, written by
``json.dumps``, is admitted.

What the rewrite admits for a character the input may hold: characters from U+0020 on but ``"`` and
``\\`` as they are (``/`` also as ``\\/``); ``"`` and ``\\`` as ``\\"`` and ``\\\\``; a control
character as its short escape (``\\n``, ``\\t``, ...) where JSON has one, and as ``\\u00XX`` (either
hex case). A ``\\uXXXX`` escape of any other character is not admitted (a model writes those raw).

Works on xgrammar's printed EBNF (``str(Grammar.from_lark(...))``): string literals and character
classes are rewritten, everything else is kept. No vLLM imports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence

MAX_CODEPOINT = 0x10FFFF
QUOTE, BACKSLASH, SLASH = 0x22, 0x5C, 0x2F
#: the characters JSON never writes raw in a string
_MUST_ESCAPE = frozenset({QUOTE, BACKSLASH, *range(0x20)})
_SHORT = {0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t", QUOTE: '\\"',
          BACKSLASH: "\\\\"}
_ESCAPES = {"n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "f": 0x0C, "b": 0x08, "a": 0x07, "e": 0x1B,
            "0": 0x00}

Ranges = list[tuple[int, int]]


class EBNFReadError(ValueError):
    """The EBNF holds a construct this rewrite does not read (it never guesses)."""


def json_string_grammar(ebnf: str) -> str:
    """``ebnf`` (xgrammar's EBNF, root rule ``root``) with every terminal rewritten into the
    spellings JSON gives it inside a string (see the module docstring)."""
    return "".join(_rewrite(ebnf))


def _rewrite(ebnf: str) -> Iterator[str]:
    pos = 0
    while pos < len(ebnf):
        char = ebnf[pos]
        if char == '"':
            codepoints, pos = _read_literal(ebnf, pos)
            yield _literal_spellings(codepoints)
        elif char == "[":
            ranges, pos = _read_class(ebnf, pos)
            yield _class_spellings(ranges)
        elif ebnf.startswith("TagDispatch(", pos):
            raise EBNFReadError("a TagDispatch rule cannot be written inside a JSON string")
        else:
            yield char
            pos += 1


def _read_escape(text: str, pos: int) -> tuple[int, int]:
    """(codepoint, next position) of the escape at ``text[pos] == '\\\\'``."""
    kind = text[pos + 1] if pos + 1 < len(text) else ""
    for letter, width in (("x", 2), ("u", 4), ("U", 8)):
        if kind == letter:
            digits = text[pos + 2:pos + 2 + width]
            if len(digits) != width or not re.fullmatch(r"[0-9A-Fa-f]+", digits):
                raise EBNFReadError(f"a malformed \\{letter} escape at {pos}")
            return int(digits, 16), pos + 2 + width
    if kind in _ESCAPES:
        return _ESCAPES[kind], pos + 2
    if kind:
        return ord(kind), pos + 2
    raise EBNFReadError("the EBNF ends inside an escape")


def _read_literal(text: str, pos: int) -> tuple[list[int], int]:
    out: list[int] = []
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == '"':
            return out, pos + 1
        if char == "\\":
            codepoint, pos = _read_escape(text, pos)
            out.append(codepoint)
        else:
            out.append(ord(char))
            pos += 1
    raise EBNFReadError("an unterminated string literal")


def _read_class(text: str, pos: int) -> tuple[Ranges, int]:
    pos += 1
    negated = text.startswith("^", pos)
    if negated:
        pos += 1
    ranges: Ranges = []
    while pos < len(text) and text[pos] != "]":
        low, pos = _class_char(text, pos)
        high = low
        if text.startswith("-", pos) and pos + 1 < len(text) and text[pos + 1] != "]":
            high, pos = _class_char(text, pos + 1)
        if high < low:
            raise EBNFReadError(f"a character range that runs backwards at {pos}")
        ranges.append((low, high))
    if pos >= len(text):
        raise EBNFReadError("an unterminated character class")
    ranges = _merged(ranges)
    return (_complement(ranges) if negated else ranges), pos + 1


def _class_char(text: str, pos: int) -> tuple[int, int]:
    if text[pos] == "\\":
        return _read_escape(text, pos)
    return ord(text[pos]), pos + 1


def _merged(ranges: Sequence[tuple[int, int]]) -> Ranges:
    out: Ranges = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    start = 0
    for low, high in ranges:
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return out


def _without(ranges: Ranges, removed: frozenset[int]) -> Ranges:
    out: Ranges = []
    for low, high in ranges:
        start = low
        for point in sorted(p for p in removed if low <= p <= high):
            if point > start:
                out.append((start, point - 1))
            start = point + 1
        if start <= high:
            out.append((start, high))
    return out


def _contains(ranges: Ranges, point: int) -> bool:
    return any(low <= point <= high for low, high in ranges)


def _ebnf_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)   # EBNF string literals take JSON's escapes


def _class_text(point: int) -> str:
    if point in (0x5D, 0x5B, 0x5E, 0x2D, QUOTE, BACKSLASH):
        return "\\" + chr(point)
    if 0x20 < point < 0x7F:
        return chr(point)
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def _escaped_spellings(point: int) -> list[str]:
    """The JSON spellings of a character that is never written raw (as EBNF alternatives)."""
    spellings = [_ebnf_literal(_SHORT[point])] if point in _SHORT else []
    if point < 0x20:
        high, low = f"{point:02x}"
        spellings.append(_ebnf_literal("\\u00" + high) + (f" [{low}{low.upper()}]" if low.isalpha()
                                                           else " " + _ebnf_literal(low)))
    return spellings


def _char_spellings(point: int) -> str:
    if point in _MUST_ESCAPE:
        spellings = _escaped_spellings(point)
        return spellings[0] if len(spellings) == 1 else "(" + " | ".join(f"({s})" for s in spellings) + ")"
    if point == SLASH:
        return '("/" | "\\\\/")'
    return _ebnf_literal(chr(point))


def _literal_spellings(codepoints: Sequence[int]) -> str:
    if not codepoints:
        return '""'
    parts: list[str] = []
    plain: list[str] = []
    for point in codepoints:
        if point in _MUST_ESCAPE or point == SLASH:
            if plain:
                parts.append(_ebnf_literal("".join(plain)))
                plain = []
            parts.append(_char_spellings(point))
        else:
            plain.append(chr(point))
    if plain:
        parts.append(_ebnf_literal("".join(plain)))
    return parts[0] if len(parts) == 1 else "(" + " ".join(parts) + ")"


def _class_spellings(ranges: Ranges) -> str:
    raw = _without(ranges, _MUST_ESCAPE)
    alternatives = []
    if raw:
        alternatives.append("[" + "".join(_class_text(low) if low == high else
                                          f"{_class_text(low)}-{_class_text(high)}"
                                          for low, high in raw) + "]")
    if _contains(ranges, SLASH):
        alternatives.append('"\\\\/"')
    controls = [point for point in range(0x20) if _contains(ranges, point)]
    if len(controls) == 0x20:   # every control character: one \u00XX rule and the short escapes
        alternatives.append('"\\\\u00" [01] [0-9a-fA-F]')
        alternatives.extend(_ebnf_literal(_SHORT[point]) for point in sorted(_SHORT) if point < 0x20)
        controls = []
    for point in (*controls, QUOTE, BACKSLASH):
        if _contains(ranges, point):
            alternatives.extend(_escaped_spellings(point))
    if not alternatives:
        raise EBNFReadError("an empty character class")
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(f"({a})" for a in alternatives) + ")"
