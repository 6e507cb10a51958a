"""How long the shortest call a turn's grammar admits is, for a turn that must call and reasons first.

A ``required`` turn of a reasoning model spends its token budget on reasoning before the grammar
starts; when ``max_tokens`` is small the call would be cut. The constraint stage therefore ends
reasoning while the budget still holds the shortest call (:mod:`.reasoning_hold`), and this module
says how many tokens that call needs: the shortest string the turn's structural tag admits, read
from the tag's nodes (a ``token`` node is one token; a JSON schema slot its smallest instance), which
the glue tokenizes. An estimate, generous rather than short (:func:`reserve_tokens` adds a margin): a
model may tokenize the same text in more pieces than the tokenizer's canonical split.

No vLLM or xgrammar import.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_DEPTH = 12              # nested schemas deeper than this count as an empty object
#: markup an XML argument style's grammar spells (qwen, minimax, glm): not JSON arguments
_XML_KEYS = ("<parameter", "<arg_key>", "<arg_value>")
_XML_MARKUP = 32         # characters of markup around one XML-style argument (a generous stand-in)


def minimal_json(schema: Any, defs: Mapping[str, Any] | None = None, depth: int = 0) -> Any:
    """A small value ``schema`` admits (the smallest for the keywords read here: ``type``,
    ``enum``, ``const``, ``required``, ``properties``, ``minItems``, ``minLength``, ``minimum``,
    ``anyOf`` / ``oneOf``, local ``$ref``); an object for anything it cannot read."""
    if not isinstance(schema, Mapping) or depth > _DEPTH:
        return {}
    defs = defs if defs is not None else {**schema.get("$defs", {}), **schema.get("definitions", {})}
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return min(schema["enum"], key=lambda value: len(json.dumps(value)))
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs:
        return minimal_json(defs[ref.rsplit("/", 1)[-1]], defs, depth + 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            options = [minimal_json(option, defs, depth + 1) for option in schema[key]]
            return min(options, key=lambda value: len(json.dumps(value)))
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = "null" if "null" in kind else (kind[0] if kind else None)
    if kind == "string":
        return "a" * max(0, int(schema.get("minLength", 0) or 0))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return int(math.ceil(low)) + (1 if "exclusiveMinimum" in schema else 0) \
            if isinstance(low, (int, float)) and low > 0 else 0
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "array":
        item = minimal_json(schema.get("items", {}), defs, depth + 1)
        return [item] * max(0, int(schema.get("minItems", 0) or 0))
    properties = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
    required = [key for key in schema.get("required", ()) if isinstance(key, str)]
    return {key: minimal_json(properties.get(key, {}), defs, depth + 1) for key in required}


def _arguments_text(node: Mapping[str, Any]) -> str:
    value = minimal_json(node.get("json_schema"))
    style = node.get("style", "json")
    if style == "json":
        return json.dumps(value, separators=(",", ":"))
    # XML styles: each required argument as its key, its value and the style's markup around them
    if not isinstance(value, Mapping):
        return ""
    return "".join(f"{key}{json.dumps(item)}" + " " * _XML_MARKUP for key, item in value.items())


def _ends(end: Any) -> list[Any]:
    if isinstance(end, list):
        return end or [""]
    return [end]


def _length(pieces: Sequence[Any]) -> int:
    """A comparison key: characters of text, a token as four."""
    return sum(4 if isinstance(piece, int) else len(piece) for piece in pieces)


def _shortest(options: Sequence[list[Any]]) -> list[Any]:
    return min(options, key=_length) if options else []


def _text(value: Any) -> list[Any]:
    """A ``begin`` / ``end`` (a string, or a ``token`` node)."""
    if isinstance(value, Mapping):
        return [value.get("token")] if isinstance(value.get("token"), int) else [str(value.get("token", ""))]
    return [value] if value else []


def _name_in(begin: Sequence[Any], schemas: Mapping[str, Any]) -> str | None:
    """The function a tag's ``begin`` names (the longest name it holds), None when none."""
    text = "".join(piece for piece in begin if isinstance(piece, str))
    named = [name for name in schemas if name and name in text]
    return max(named, key=len) if named else None


def shortest_pieces(node: Any, schemas: Mapping[str, Any] | None = None, name: str | None = None) -> list[Any]:
    """The shortest output ``node`` (a structural tag's format, as JSON data) admits, as pieces.
    ``schemas`` (function name -> parameters) size an argument slot the tag holds as a compiled
    ``grammar`` (the JSON slots :mod:`.safe_json` rewrote), inside a tag whose ``begin`` names
    the function."""
    schemas = schemas or {}
    if not isinstance(node, Mapping):
        return []
    kind = node.get("type")

    def inner(child: Any, within: str | None = name) -> list[Any]:
        return shortest_pieces(child, schemas, within)
    if kind == "structural_tag":
        return inner(node.get("format"))
    if kind == "const_string":
        return [node.get("value", "")]
    if kind == "token":
        return _text(node)
    if kind == "json_schema" or kind == "qwen_xml_parameter":
        return [_arguments_text(node)]
    if kind == "grammar":   # an argument slot compiled to EBNF: the function's smallest arguments
        if name not in schemas:
            return []
        ebnf = str(node.get("grammar", ""))
        style = "xml" if any(markup in ebnf for markup in _XML_KEYS) else "json"
        return [_arguments_text({"json_schema": schemas[name], "style": style})]
    if kind == "sequence":   # a name written before a slot (harmony's `` to=functions.NAME``) sizes it
        pieces: list[Any] = []
        for element in node.get("elements", ()):
            pieces += inner(element, name)
            name = _name_in(pieces, schemas) or name
        return pieces
    if kind in ("or", "dispatch", "token_dispatch"):
        elements = node.get("elements") or [rule[1] for rule in node.get("rules", ()) if len(rule) == 2]
        return _shortest([inner(element) for element in elements])
    if kind == "tag":
        begin = _text(node.get("begin"))
        ends = [_text(end) for end in _ends(node.get("end"))]
        return [*begin, *inner(node.get("content"), _name_in(begin, schemas) or name), *_shortest(ends)]
    if kind in ("triggered_tags", "token_triggered_tags", "tags_with_separator"):
        if not node.get("at_least_one"):
            return []
        return _shortest([inner(tag) for tag in node.get("tags", ())])
    if kind == "plus":
        return inner(node.get("content"))
    if kind == "repeat":
        return inner(node.get("content")) * max(0, int(node.get("min", 0)))
    if kind == "regex":   # sized as one character (a call id's digits, a name's first letter)
        return ["0"] if node.get("pattern") else []
    if kind == "exclude_token":
        return [0]   # one token
    # any_text, any_tokens, optional, star: may be empty
    return []


def reserve_tokens(pieces: Sequence[Any], count_text: Callable[[str], int]) -> int:
    """Tokens to keep for the call ``pieces`` spell: text counted by ``count_text`` (the model's
    tokenizer), a token piece as one, plus a quarter and two for a model that splits text finer."""
    tokens = sum(1 if isinstance(piece, int) else 0 for piece in pieces)
    text = "".join(piece for piece in pieces if isinstance(piece, str))
    tokens += count_text(text) if text else 0
    return tokens + tokens // 4 + 2


def shortest_call_text(tag: Any, schemas: Mapping[str, Any] | None = None) -> list[Any]:
    """The shortest call a tag (its JSON text, or the data) admits, as pieces; ``schemas`` as in
    :func:`shortest_pieces`."""
    data = json.loads(tag) if isinstance(tag, str) else tag
    return shortest_pieces(data, schemas)


def shortest_array_call(schema: Any) -> list[Any]:
    """The shortest output of a JSON-array format's ``required`` grammar (the array's schema)."""
    data = json.loads(schema) if isinstance(schema, str) else schema
    value = minimal_json(data)
    if isinstance(data, Mapping) and data.get("type") == "array" and value == []:
        value = [minimal_json(data.get("items", {}), {**data.get("$defs", {})})]
    return [json.dumps(value, separators=(",", ":"))]


def cap_optional_text(node: Any, max_tokens: int, optional: bool = False) -> None:
    """In place, on a tag's JSON data: every ``any_text`` inside an ``optional`` (harmony's
    analysis and commentary preamble messages before the call; a call's own text is never
    optional) holds at most ``max_tokens`` tokens."""
    if isinstance(node, list):
        for item in node:
            cap_optional_text(item, max_tokens, optional)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "any_text" and optional:
        current = node.get("max_tokens")
        node["max_tokens"] = max_tokens if current is None else min(current, max_tokens)
    inside = optional or node.get("type") == "optional"
    for value in node.values():
        cap_optional_text(value, max_tokens, inside)
