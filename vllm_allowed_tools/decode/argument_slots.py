"""A turn's argument slots, as the format's parser reads them back: every JSON slot of a built
structural tag becomes a :mod:`.safe_json` grammar (an object; strings that cannot spell the
format's markers; paired surrogates; finite numbers), XML values are framed as the parser strips
them, and GLM's star of parameters admits each key once. No vLLM imports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from xgrammar import StructuralTag

from ..formats import wire_format
from ..ebnf import ebnf_text
from .lru import LRU as _LRU
from .safe_json import safe_json_ebnf

#: the arguments of a tool that pins nothing: a JSON object, keys and values free (every function's
#: parameters are an object schema, so any other JSON value is a call no client can run)
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


def object_schema(schema: Mapping[str, Any] | bool | None) -> Mapping[str, Any]:
    """``schema`` as the schema of an arguments object: an open schema (``true``, ``{}``, missing)
    becomes any object, a schema that names no type is typed ``object``; a typed one is kept."""
    if not isinstance(schema, Mapping) or not schema:
        return ANY_OBJECT
    return schema if "type" in schema else {**schema, "type": "object"}



#: markers a format's parser finds that neither its registry entry nor its tag spells in full
#: (harmony: HarmonyParser reads every special token of the conversation, stop tokens included)
_EXTRA_MARKERS: Mapping[str, tuple[str, ...]] = {
    "harmony": ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>",
                "<|return|>"),
}
#: the markup pieces inside a tag's begin/end/trigger strings that a parser looks for: ``<...>``
#: tags (``<tool_call>``, ``<|tool_call_end|>``, ``<｜tool▁sep｜>``), a tag opened up to its first
#: attribute (``<invoke``, ``<function=``: never a function's name, so the set stays one per
#: format, whatever the catalog), ``[TOOL_CALLS]``-like markers
_MARKUP_PIECE = re.compile(r'<[^<>\s"=]*>|<[^<>\s"=]+=?|\[[A-Z_]+\]')


def format_markers(wire_format_name: str) -> tuple[str, ...]:
    """What a JSON string inside the format's arguments may not spell raw (:mod:`.safe_json`):
    its special tokens, call triggers and the markup pieces of its call shapes."""
    entry = wire_format(wire_format_name)
    spec = entry.grammar
    shapes = [text for call in spec.calls for text in (call.begin, call.end)] + [spec.trigger or ""]
    return tuple(dict.fromkeys((*entry.special_tokens, *entry.call_triggers,
                                *_EXTRA_MARKERS.get(spec.vllm_model or "", ()),
                                *(piece for text in shapes for piece in _MARKUP_PIECE.findall(text)))))


def tag_markers(node: Any) -> list[str]:
    """The markup pieces of every begin/end/trigger/constant string in a dumped tag."""
    if isinstance(node, list):
        return [piece for item in node for piece in tag_markers(item)]
    if not isinstance(node, dict):
        return []
    found = []
    for key, value in node.items():
        texts = value if isinstance(value, list) else [value]
        if key in ("begin", "end", "triggers") or (key == "value" and node.get("type") == "const_string"):
            found += [piece for text in texts if isinstance(text, str) for piece in _MARKUP_PIECE.findall(text)]
        elif isinstance(value, (dict, list)):
            found += tag_markers(value)
    return found


def with_object_arguments(tag: StructuralTag, *, one_line: bool, markers: Sequence[str] = ()) -> StructuralTag:
    """Every JSON argument slot of ``tag`` admits only an object (builtin templates leave a
    non-strict tool's arguments as any JSON value); with ``one_line``, written without a line
    break, as ``", "`` / ``": "`` separated JSON (formats whose parser reads no line break inside
    arguments: vLLM's DeepSeek parsers match arguments with a regex that stops at one).

    Every JSON slot (JSON-typed XML values too) becomes a grammar node from :mod:`.safe_json`: its
    strings cannot spell ``markers`` nor the tag's own markup (a parser takes a marker inside a
    string for the marker), no lone surrogate escape, finite numbers. A ``star`` of GLM parameters
    (vLLM's tag for a non-strict tool) admits each key once (:func:`_each_key_once`)."""
    dumped = tag.model_dump()
    forbidden = tuple(dict.fromkeys((*markers, *tag_markers(dumped))))

    def visit(node: Any, markup: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [visit(item, markup) for item in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and (node.get("style", "json") == "json"
                                                  or node.get("style") in _XML_VALUE_FRAMES):
            return {"type": "grammar", "grammar": _slot_grammar(node, one_line, forbidden, markup)}
        if node.get("type") == "star" and _each_key_once(node) is not None:
            return visit(_each_key_once(node), markup)
        if node.get("type") == "tag":   # a string inside may not spell the markup that ends it
            ends = node["end"] if isinstance(node["end"], list) else [node["end"]]
            markup = markup + tuple(piece for end in ends for piece in end.split())
        return {key: visit(value, markup) for key, value in node.items()}
    return StructuralTag.model_validate(visit(dumped, ()))


def _slot_limits() -> tuple[int, int | None]:
    return 2048, 64 << 20


#: a JSON slot's grammar by (its node, one_line, the markers, the enclosing markup): the same
#: schema recurs across a catalog (every non-strict tool's ``{"type": "object"}``) and across the
#: turns that build one catalog's tags, and the rewrite costs milliseconds a slot
_SLOTS = _LRU(limits=_slot_limits)


def _slot_grammar(node: Mapping[str, Any], one_line: bool, forbidden: tuple[str, ...],
                  markup: tuple[str, ...]) -> str:
    """The :mod:`.safe_json` grammar for one JSON argument slot (a JSON- or XML-style
    ``json_schema`` node), cached in :data:`_SLOTS`."""
    key = (json.dumps(node, sort_keys=True, default=str), one_line, forbidden, markup)
    found = _SLOTS.get(key)
    if found is not None:
        return found
    if node.get("style", "json") == "json":
        schema = object_schema(node.get("json_schema"))
        ebnf = _one_line_json(schema) if one_line else json_ebnf({**node, "json_schema": schema})
        text = safe_json_ebnf(ebnf, forbidden)
    else:
        _, closing, _, inner = _XML_VALUE_FRAMES[node["style"]]
        text = safe_json_ebnf(_xml_values_unframed(node, markup),
                              (*forbidden, *inner, *markup, json.loads(closing)))
    _SLOTS.put(key, text, len(key[0]) + len(text))
    return text


def _each_key_once(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """A ``star`` over GLM parameters (``<arg_key>k</arg_key><arg_value>...``, vLLM's glm_4_7 tag
    for a non-strict tool) as each declared key at most once, in declared order; None for any
    other star. A repeated key is no JSON object one can stream: vLLM's engine streams the
    arguments as a growing prefix and cannot take back the value it sent for the first one."""
    content = node.get("content") or {}
    options = content.get("elements") if content.get("type") == "or" else [content]
    keys = []
    for option in options or ():
        first = (option.get("elements") or [None])[0] if option.get("type") == "sequence" else None
        if not (isinstance(first, dict) and first.get("type") == "const_string"
                and str(first.get("value", "")).startswith("<arg_key>")):
            return None
        keys.append(first["value"].split("</arg_key>")[0])
    if not keys or len(set(keys)) != len(keys):
        return None
    return {"type": "sequence", "elements": [{"type": "optional", "content": option} for option in options]}


def json_ebnf(node: Mapping[str, Any]) -> str:
    """The EBNF xgrammar builds for a JSON-style ``json_schema`` node (its whitespace bound kept)."""
    from xgrammar import Grammar
    return ebnf_text(Grammar.from_structural_tag(StructuralTag.model_validate({"format": dict(node)})))


#: XML argument styles -> (the literals that open and close one value, the whitespace its parser
#: strips from each side, the markup its parser finds inside a value). xgrammar frames every
#: non-string value (an enum's too) with free whitespace, and lets a string value hold any markup
#: but the closing tag; vLLM's parsers keep a value's text verbatim (qwen3 and seed_oss strip one
#: wrapping line break) and take markup for markup, so "\tlow " comes back out of its enum and a
#: "<parameter=" in a string starts a parameter
_XML_VALUE_FRAMES: Mapping[str, tuple[str, str, str, tuple[str, ...]]] = {
    "qwen_xml": ('">"', '"</parameter>"', '"\\n"?', ("<parameter=", "</function>")),
    "minimax_xml": ('"\\">"', '"</parameter>"', "", ("<parameter name=", "</invoke>")),
    "glm_xml": ('"<arg_value>"', '"</arg_value>"', "", ("<arg_key>", "</arg_key>", "<arg_value>")),
}


def xml_value_markup(style: str) -> tuple[str, ...]:
    """The markup an XML argument ``style`` writes around a value that its parser finds inside a
    call (``<parameter=``, ``</parameter>``, ...); none for another style."""
    if style not in _XML_VALUE_FRAMES:
        return ()
    _, closing, _, inner = _XML_VALUE_FRAMES[style]
    return (*inner, json.loads(closing))


_WHITESPACE_RUN = "[ \\n\\r\\t]*"
_FREE_WHITESPACE = r'(?:\[ \\n\\r\\t\]\*|whitespace_\d+\{0, ?\d+\})'
_STRING_EXCLUDES = re.compile(r'excludes=\(("(?:[^"\\]|\\.)*"(?:, *"(?:[^"\\]|\\.)*")*)\)')


def _xml_values_unframed(node: Mapping[str, Any], markup: Sequence[str]) -> str:
    """The EBNF xgrammar builds for an XML argument ``node``, with the free whitespace around each
    value replaced by what the format's parser strips (nothing, or one line break), and string
    values kept from spelling the format's ``markup`` (the enclosing tags' ends as well)."""
    from xgrammar import Grammar
    opening, closing, stripped, inner = _XML_VALUE_FRAMES[node["style"]]
    # built unbounded (a bounded run is printed in shapes too varied to find), bounded below
    bound = node.get("max_whitespace_cnt")
    ebnf = ebnf_text(Grammar.from_structural_tag(StructuralTag.model_validate({"format": {
        **node, "json_schema": object_schema(node.get("json_schema")), "max_whitespace_cnt": None}})))
    opened = f"{opening} {stripped}" if stripped else opening
    closed = f"{stripped} {closing}" if stripped else closing
    ebnf = re.sub(re.escape(opening) + " " + _FREE_WHITESPACE, lambda _: opened, ebnf)
    ebnf = re.sub(_FREE_WHITESPACE + " " + re.escape(closing), lambda _: closed, ebnf)
    if bound is not None:
        ebnf = ebnf.replace(_WHITESPACE_RUN, f"[ \\n\\r\\t]{{0, {int(bound)}}}")
    extra = ", ".join(json.dumps(piece) for piece in dict.fromkeys((*inner, *markup)))
    return _STRING_EXCLUDES.sub(lambda match: f"excludes=({match.group(1)}, {extra})", ebnf)


def _one_line_json(schema: Mapping[str, Any]) -> str:
    """The EBNF of ``schema``'s JSON with fixed separators and no free whitespace (strings can hold
    no raw line break either: JSON escapes it)."""
    from xgrammar import Grammar
    return ebnf_text(Grammar.from_json_schema(json.dumps(schema, sort_keys=True), any_whitespace=False))


def clear_slot_cache() -> None:
    _SLOTS.clear()
