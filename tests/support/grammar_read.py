"""What a string means under a structural tag: the calls it holds, read by the tag's own structure.

The other half of :mod:`.grammar_walk`: a walk writes a string the grammar admits; :func:`read_calls`
says what it wrote (which call tag, which function, the exact text of its arguments), reading the
tag's nodes (``tag``, ``sequence``, ``or``, ``tags_with_separator``, ``triggered_tags``, ``any_text``,
``regex``, ``json_schema`` in its styles, ...) with backtracking, never a parser, so a test can compare
it with what a parser reads. :func:`xml_parameters` splits XML argument text into its parameters.

No vLLM or xgrammar import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

WHITESPACE = frozenset(" \n\t\r")


def tag_dict(tag: Any) -> dict[str, Any]:
    """A structural tag as a dict (from its JSON, a mapping or an xgrammar ``StructuralTag``)."""
    if isinstance(tag, str):
        return json.loads(tag)
    if isinstance(tag, Mapping):
        return dict(tag)
    return tag.model_dump()   # an xgrammar StructuralTag


def tag_nodes(tag: Any) -> Iterator[dict[str, Any]]:
    """Every node of a structural tag, depth first (a test looks for the ``grammar`` slots or a
    frame's ``const_string`` without knowing where a format nests them)."""
    stack: list[Any] = [tag_dict(tag)]
    while stack:
        node = stack.pop()
        if isinstance(node, Mapping):
            yield node
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))


def markers_as_text(node: Any, texts: Mapping[int, str] | None = None) -> Any:
    """A tag dict with its ``token`` formats read as their text (a string token is its text; an id,
    ``texts[id]``): a ``token`` node becomes a ``const_string``, a token ``begin``/``end`` its text,
    and a ``sequence`` of markup pieces ending in a ``tag`` (what
    :func:`vllm_allowed_tools.decode.marker_tokens.with_marker_tokens` makes of a tag whose begin
    holds markers) that tag again, its ``begin`` the pieces' text, so its function name is found."""
    if isinstance(node, list):
        return [markers_as_text(item, texts) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "token":
        token = node["token"]
        return {"type": "const_string", "value": token if isinstance(token, str) else (texts or {})[token]}
    out = {key: markers_as_text(value, texts) for key, value in node.items()}
    if out.get("type") == "tag":
        for key in ("begin", "end"):
            if isinstance(out[key], dict):
                out[key] = out[key]["value"]
    if out.get("type") == "sequence" and out["elements"] and out["elements"][-1].get("type") == "tag" \
            and all(element.get("type") == "const_string" for element in out["elements"][:-1]):
        last = out["elements"][-1]
        if isinstance(last["begin"], str) and len(out["elements"]) > 1:
            prefix = "".join(element["value"] for element in out["elements"][:-1])
            return {**last, "begin": prefix + last["begin"]}
    return out


@dataclass(frozen=True)
class WrittenCall:
    """One call as the tag reads a string: ``name`` is the function whose name the call tag's
    ``begin`` holds (None for an argument node outside any tag, e.g. a bare JSON array of calls);
    ``arguments`` the exact text of the argument node (a ``json_schema`` or ``grammar`` node; where
    a call tag has none, its whole content), ``style`` that node's style (``json``, ``qwen_xml``,
    ``minimax_xml``, ``glm_xml``; ``text`` for content that is not a schema), ``begin`` and ``end``
    the call tag's markup as written."""
    name: str | None
    arguments: str
    style: str
    begin: str = ""
    end: str = ""
    schema: Any = field(default=None, compare=False)


class ReadError(ValueError):
    """The string is not one the tag admits, as far as :func:`read_calls` can tell."""


def read_calls(tag: Any, text: str, names: Sequence[str] | Mapping[str, Any]) -> list[WrittenCall]:
    """The calls ``text`` holds under ``tag`` (first full reading found), for functions ``names``
    (a mapping gives each one's parameters schema: an argument ``grammar`` node carries none, and an
    XML reading needs it to tell a JSON-typed value)."""
    root = markers_as_text(tag_dict(tag))
    node = root.get("format", root)
    table = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names)
    for end, captures in _match(node, text, 0, table, None):
        if end == len(text):
            return [capture if isinstance(capture, WrittenCall) else
                    WrittenCall(None, text[capture[1]:capture[2]], capture[3], schema=capture[4])
                    for capture in captures]
    raise ReadError(f"the tag does not read {text!r}")


_Captures = tuple[Any, ...]
#: function name -> its parameters schema (None where unknown)
_Names = Mapping[str, Any]


def _ws_ends(text: str, pos: int) -> Iterator[int]:
    """``pos`` and every position after more whitespace."""
    yield pos
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
        yield pos


def _name_in(begin: str, names: Sequence[str]) -> str | None:
    present = [name for name in names if re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", begin)]
    return max(present, key=len) if present else None


def _match(node: Any, text: str, pos: int, names: _Names, in_call: str | None) -> Iterator[tuple[int, _Captures]]:
    kind = node.get("type")
    if kind == "const_string":
        if text.startswith(node["value"], pos):
            yield pos + len(node["value"]), ()
    elif kind == "sequence":
        yield from _sequence(node["elements"], text, pos, names, in_call)
    elif kind == "or":
        for element in node["elements"]:
            yield from _match(element, text, pos, names, in_call)
    elif kind == "optional":
        yield from _match(node["content"], text, pos, names, in_call)
        yield pos, ()
    elif kind in ("star", "plus"):
        yield from _star(node["content"], text, pos, names, in_call, at_least=1 if kind == "plus" else 0)
    elif kind == "tag":
        yield from _tag(node, text, pos, names, in_call)
    elif kind == "tags_with_separator":
        yield from _separated(node, text, pos, names, in_call)
    elif kind == "triggered_tags":
        yield from _triggered(node, text, pos, names, in_call)
    elif kind == "any_text":
        limit = len(text)
        for exclude in node.get("excludes") or ():
            found = text.find(exclude, pos)
            if found != -1:
                limit = min(limit, found + len(exclude) - 1)
        for end in range(pos, limit + 1):
            yield end, ()
    elif kind == "regex":
        pattern = re.compile(node["pattern"])
        for end in range(pos, len(text) + 1):
            if pattern.fullmatch(text, pos, end):
                yield end, ()
    elif kind in ("json_schema", "grammar"):
        if kind == "json_schema":
            style, schema = node.get("style", "json"), node.get("json_schema")
        else:
            style, schema = grammar_style(node["grammar"]), names.get(in_call) if in_call else None
        for end in _arguments(text, pos, style, schema):
            yield end, (("args", pos, end, style, schema),)
    else:
        raise ReadError(f"read_calls does not know the {kind!r} format")


def _sequence(elements: Sequence[Any], text: str, pos: int, names: _Names,
              in_call: str | None) -> Iterator[tuple[int, _Captures]]:
    if not elements:
        yield pos, ()
        return
    for middle, first in _match(elements[0], text, pos, names, in_call):
        for end, rest in _sequence(elements[1:], text, middle, names, in_call):
            yield end, first + rest


def _star(content: Any, text: str, pos: int, names: _Names, in_call: str | None,
          at_least: int) -> Iterator[tuple[int, _Captures]]:
    for middle, first in _match(content, text, pos, names, in_call):
        if middle == pos:
            continue
        for end, rest in _star(content, text, middle, names, in_call, max(0, at_least - 1)):
            yield end, first + rest
    if at_least == 0:
        yield pos, ()


def _tag(node: Any, text: str, pos: int, names: _Names, in_call: str | None) -> Iterator[tuple[int, _Captures]]:
    begin = node["begin"]
    if not text.startswith(begin, pos):
        return
    start = pos + len(begin)
    name = None if in_call else _name_in(begin, names)
    ends = node["end"] if isinstance(node["end"], list) else [node["end"]]
    for content_end, captures in _match(node["content"], text, start, names, in_call or name):
        for end in ends:
            if not text.startswith(end, content_end):
                continue
            if name is None:
                yield content_end + len(end), captures
                continue
            arguments = [capture for capture in captures if isinstance(capture, tuple) and capture[0] == "args"]
            if len(arguments) == 1 and not _repeats(node["content"]):
                _, a_start, a_end, style, schema = arguments[0]
            else:   # no single argument node (XML parameters spelled out by the tag): the content
                a_start, a_end, style, schema = start, content_end, "text", None
            yield content_end + len(end), (WrittenCall(name, text[a_start:a_end], style, begin, end, schema),)


def _repeats(node: Any) -> bool:
    """``node`` holds a repetition (``star``/``plus``) or an ``optional`` outside any schema: the
    tag spells parameters out itself (vLLM's GLM tag: a star of parameters; ours: each optional)."""
    if isinstance(node, list):
        return any(_repeats(item) for item in node)
    if not isinstance(node, dict) or node.get("type") in ("json_schema", "grammar"):
        return False
    return node.get("type") in ("star", "plus", "optional") or any(_repeats(value) for value in node.values())


def _separated(node: Any, text: str, pos: int, names: _Names, in_call: str | None,
               count: int = 0) -> Iterator[tuple[int, _Captures]]:
    if count and node.get("stop_after_first"):
        yield pos, ()
        return
    separator = node.get("separator", "")
    if count:
        if not text.startswith(separator, pos):
            if count or not node.get("at_least_one"):
                yield pos, ()
            return
        after = pos + len(separator)
    else:
        after = pos
    for tag in node["tags"]:
        for middle, first in _match(tag, text, after, names, in_call):
            for end, rest in _separated(node, text, middle, names, in_call, count + 1):
                yield end, first + rest
    if count or not node.get("at_least_one"):
        yield pos, ()


def _triggered(node: Any, text: str, pos: int, names: _Names, in_call: str | None,
               count: int = 0) -> Iterator[tuple[int, _Captures]]:
    if count and node.get("stop_after_first"):
        yield pos, ()
        return
    triggers = node.get("triggers") or []
    starts = sorted({found for trigger in triggers for found in _find_all(text, trigger, pos)})
    for start in starts:
        for tag in node["tags"]:
            for middle, first in _match(tag, text, start, names, in_call):
                for end, rest in _triggered(node, text, middle, names, in_call, count + 1):
                    yield end, first + rest
    if (count or not node.get("at_least_one")) and not starts:
        yield len(text), ()   # free text to the end


def _find_all(text: str, needle: str, pos: int) -> Iterator[int]:
    found = text.find(needle, pos)
    while found != -1:
        yield found
        found = text.find(needle, found + 1)


_XML_PARAMETER = {
    "qwen_xml": (re.compile(r"<parameter=([A-Za-z_][A-Za-z0-9_]*)>"), "</parameter>"),
    "minimax_xml": (re.compile(r'<parameter name="([A-Za-z_][A-Za-z0-9_]*)">'), "</parameter>"),
    "glm_xml": (re.compile(r"<arg_key>([A-Za-z_][A-Za-z0-9_]*)</arg_key>[ \n\r\t]*<arg_value>"), "</arg_value>"),
}


def grammar_style(ebnf: str) -> str:
    """The argument style an EBNF ``grammar`` node writes (the allowed-subset builder turns XML
    argument nodes into grammars): told by the parameter markup it spells."""
    for style, literal in (("glm_xml", "<arg_value>"), ("minimax_xml", '<parameter name=\\"'),
                           ("qwen_xml", "<parameter=")):
        if literal in ebnf:
            return style
    return "json"


def _arguments(text: str, pos: int, style: str, schema: Any = None) -> Iterator[int]:
    """Where an argument node of ``style`` starting at ``pos`` can end."""
    if style == "json":
        start = pos
        while start < len(text) and text[start] in WHITESPACE:
            start += 1
        try:
            _, end = json.JSONDecoder().raw_decode(text, start)
        except ValueError:
            return
        yield from _ws_ends(text, end)
        return
    if style not in _XML_PARAMETER:
        raise ReadError(f"read_calls does not know the {style!r} argument style")
    end = pos
    for _key, _raw, stop in xml_parameters_at(text, pos, style, schema):
        end = stop
    yield from _ws_ends(text, end)


def _json_typed(schema: Any, key: str) -> bool:
    """The grammar writes ``key``'s value as a JSON object or array (its property's type)."""
    prop = schema.get("properties", {}).get(key) if isinstance(schema, Mapping) else None
    return isinstance(prop, Mapping) and prop.get("type") in ("object", "array")


def xml_parameters_at(text: str, pos: int, style: str, schema: Any = None) -> Iterator[tuple[str, str, int]]:
    """The ``(key, raw value, end)`` of each XML parameter of ``style`` from ``pos`` on (framing
    whitespace between parameters skipped). The raw value is everything up to the closing tag, or,
    for a property ``schema`` types as an object or array, the JSON value (which may hold the
    closing tag inside a string) with the whitespace around it."""
    opening, closing = _XML_PARAMETER[style]
    decoder = json.JSONDecoder()
    while True:
        start = pos
        while start < len(text) and text[start] in WHITESPACE:
            start += 1
        match = opening.match(text, start)
        if not match:
            return
        stop = -1
        if _json_typed(schema, match.group(1)):
            value = match.end()
            while value < len(text) and text[value] in WHITESPACE:
                value += 1
            try:
                _, after = decoder.raw_decode(text, value)
            except ValueError:
                after = -1
            while 0 <= after < len(text) and text[after] in WHITESPACE:
                after += 1
            if after >= 0 and text.startswith(closing, after):
                stop = after
        if stop == -1:
            stop = text.find(closing, match.end())
        if stop == -1:
            return
        pos = stop + len(closing)
        yield match.group(1), text[match.end():stop], pos


def xml_parameters(text: str, style: str, schema: Any = None) -> list[tuple[str, str]]:
    """The ``(key, raw value)`` pairs of an XML argument text (:attr:`WrittenCall.arguments`;
    ``schema``: its ``json_schema``, for the parameters whose values are JSON objects)."""
    return [(key, raw) for key, raw, _ in xml_parameters_at(text, 0, style, schema)]


def python_calls(text: str) -> list[tuple[str, Any]]:
    """(name, keyword arguments) of each call in a pythonic call list, read with ``ast`` (each
    value a literal: ``ast.literal_eval``), not by any tool parser."""
    import ast
    tree = ast.parse(text, mode="eval").body
    if not isinstance(tree, ast.List) or not all(isinstance(item, ast.Call) for item in tree.elts):
        raise ValueError(f"not a list of calls: {text!r}")
    return [(item.func.id, {keyword.arg: ast.literal_eval(keyword.value) for keyword in item.keywords})
            for item in tree.elts if isinstance(item.func, ast.Name)]
