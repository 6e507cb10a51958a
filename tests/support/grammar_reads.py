"""What the grammar-read tests share (test_grammar_reads.py: the ``required`` grammars,
test_grammar_reads_auto.py: the JSON-array formats' ``auto`` ones): the catalog both walk, the
walk settings, one format's parser set-up, and reading a walk's tokens back through vLLM's
serving-side parser, unary and streamed in chunkings."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any


from vllm_allowed_tools.decode.argument_slots import object_schema

from support.grammar_read import WrittenCall, xml_parameters
from support.grammar_walk import GrammarWalker

WALKS = int(os.environ.get("VLLM_ALLOWED_TOOLS_WALKS", "100"))
SPELLINGS = {
    "markers": {"pieces": False, "markup_in_text": False},
    "pieces": {"pieces": True, "markup_in_text": False},
    "markup-in-values": {"pieces": False, "markup_in_text": True},
}

# ------------------------------------------------------------------------------------- the catalog
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer"},
    "alert": {"type": "boolean"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}, "label": {"type": "string"}},
              "required": ["lat"], "additionalProperties": False}},
    "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
          "required": ["query"]}
NOTE = {"type": "object", "properties": {"note_id": {"type": "string"}}, "required": ["note_id"],
        "additionalProperties": False}
EMAIL = {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}}}
#: name -> (schema, strict); two allowed (one strict, one not), two not
CATALOG = {"get_weather": (WEATHER, True), "search_docs": (SEARCH, False),
           "delete_note": (NOTE, True), "send_email": (EMAIL, False)}
ALLOWED = ["get_weather", "search_docs"]


#: allowed name -> the arguments schema its grammar pins (every tool's own, strict or not:
#: decode/argument_schemas.py)
ARGUMENT_SCHEMAS = {name: object_schema(CATALOG[name][0]) for name in ALLOWED}


def chat_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                              "parameters": schema, "strict": strict}}
            for name, (schema, strict) in CATALOG.items()]


@dataclass
class Setup:
    family: str
    tag: Any
    walker: GrammarWalker
    parser_cls: type
    tokenizer: Any
    request: Any
    stop_id: int
    ids: dict[str, list[int]]

    def token_ids(self, token: str) -> list[int]:
        if token not in self.ids:
            self.ids[token] = self.tokenizer.encode(token, add_special_tokens=False)
        return self.ids[token]


def json_equal(a: Any, b: Any) -> bool:
    """Equal as JSON values: numbers by value, but a boolean is never a number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[key], b[key]) for key in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------------- what the walk wrote
#: the markup newlines a format's parser strips from an XML string value (one each side)
XML_STRING_TRIM = {"qwen3_coder": "\n", "qwen3_xml": "\n", "seed_oss": "\n"}
#: the XML style of formats whose call tag spells the parameters out itself (non-strict GLM)
XML_STYLE = {"glm45": "glm_xml", "glm47": "glm_xml"}
WS = " \n\r\t"


def _trim(value: str, mark: str | None) -> str:
    return value.removeprefix(mark).removesuffix(mark) if mark else value


def xml_value(family: str, raw: str, prop: Any, strict: bool) -> Any:
    trimmed = _trim(raw, XML_STRING_TRIM.get(family))
    if not isinstance(prop, dict):
        return trimmed
    if not strict:
        from vllm.tool_parsers.utils import coerce_to_schema_type, extract_types_from_schema
        return coerce_to_schema_type(trimmed, extract_types_from_schema(prop))
    if "enum" in prop:
        return raw.strip(WS)
    if prop.get("type") == "string":
        return trimmed
    return json.loads(raw.strip(WS))


def written_values(family: str, call: WrittenCall) -> tuple[str, Any]:
    """(name, arguments) one call tag of a walk wrote (:func:`~support.grammar_read.read_calls`),
    its arguments as the format's parser should read them: JSON as ``json`` reads it; XML
    parameters, for a strict tool, the value the grammar pins (a string property's raw text, less
    the markup newlines the parser strips; an enum value, number, boolean or object without the
    whitespace the grammar frames it with), for a non-strict one the raw text converted as vLLM's
    engine converts it."""
    schema, strict = CATALOG[call.name]
    style = XML_STYLE.get(family, call.style) if call.style == "text" else call.style
    if style == "json":
        return call.name, json.loads(call.arguments)
    properties = schema.get("properties", {})
    return call.name, {key: xml_value(family, raw, properties.get(key), strict)
                       for key, raw in xml_parameters(call.arguments, style, call.schema)}


# ------------------------------------------------------------------------- what the server reads
def chunkings(count: int, seed: int) -> dict[str, list[int]]:
    """Chunk sizes covering ``count`` tokens: one token a chunk, and two random chunkings."""
    result = {"per-token": [1] * count}
    for name, largest in (("random-4", 4), ("random-12", 12)):
        rng, sizes = random.Random(f"{seed}/{name}"), []
        while sum(sizes) < count:
            sizes.append(rng.randint(1, largest))
        result[name] = sizes
    return result


def unary_calls(setup: Setup, tokens: tuple[str, ...]) -> tuple[list[tuple[str, str]], str | None]:
    ids = [i for token in tokens for i in setup.token_ids(token)] + [setup.stop_id]
    parser = setup.parser_cls(setup.tokenizer, setup.request.tools)
    _, content, calls = parser.parse("".join(tokens), setup.request, enable_auto_tools=True,
                                     model_output_token_ids=ids)
    return [(call.name, call.arguments) for call in calls or []], content


def streamed_calls(setup: Setup, tokens: tuple[str, ...], sizes: list[int]) -> tuple[list[tuple[str, str]], str]:
    parser = setup.parser_cls(setup.tokenizer, setup.request.tools)
    chunks, start = [], 0
    for size in sizes:
        piece = tokens[start:start + size]
        chunks.append(("".join(piece), [i for token in piece for i in setup.token_ids(token)]))
        start += size
    chunks.append(("", [setup.stop_id]))
    calls: dict[int, list[str]] = {}
    content = ""
    for number, (text, ids) in enumerate(chunks):
        delta = parser.parse_delta(text, ids, setup.request, prompt_token_ids=[],
                                   finished=number == len(chunks) - 1)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            if call.function is not None:
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    return [tuple(calls[index]) for index in sorted(calls)], content
