"""A custom tool's grammar inside a turn's structural tag: what constrains the call's ``input``.

vLLM 0.32 serves a Responses ``custom`` tool as a function of one string field, ``input``: the model
writes the format's ordinary call, and vLLM answers a ``custom_tool_call`` whose input is that
field's value. So a custom call is constrained where its argument slot is: a format that writes
arguments as JSON carries the input as a JSON string (``{"input": "..."}``, the string's content
admitted by :func:`.json_string.json_string_grammar` of the tool's grammar); a format that writes
XML parameters carries it raw (the grammar as it is), framed as the format's parser reads a value.

How: every custom function enters the format's builder (ours, xgrammar's or vLLM's) with a marked
arguments schema (:func:`marked`), so the call envelope is written as for any function; the marked
argument node is then replaced by the input's grammar, as data (a sequence of constant strings and a
grammar node: :func:`with_custom_inputs`). A marked node left over (a JSON array of calls, a
builder that compiles schemas itself) means the format cannot carry the grammar: a
:class:`~..errors.CapabilityError` naming the format and the tool, never an unconstrained call.
No vLLM imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from xgrammar import StructuralTag

from ..errors import CapabilityError
from .json_string import EBNFReadError, json_string_grammar
from .lark_ebnf import RULE_FOR_RULE

#: the key, in a marked arguments schema, that names the custom tool it stands for
MARKER_KEY = "$comment"
MARKER_PREFIX = "vllm-allowed-tools: the input of custom tool "
#: the capability a format lacks when it cannot carry a custom tool's grammar
CAPABILITY = "custom_tool_grammar"

#: argument style -> (what opens the one ``input`` value, what closes it), as the format's parser
#: reads it back exactly: JSON's string quotes (the content is the grammar's JSON spellings); the
#: XML styles' parameter markup, for qwen_xml with the line break its parser strips on each side
#: (written always, so an input that starts or ends with one keeps it), for the others verbatim
VALUE_FRAMES: Mapping[str, tuple[str, str]] = {
    "json": ('{"input": "', '"}'),
    "qwen_xml": ("<parameter=input>\n", "\n</parameter>"),
    "minimax_xml": ('<parameter name="input">', "</parameter>\n"),
    "glm_xml": ("<arg_key>input</arg_key><arg_value>", "</arg_value>"),
}


def marker(name: str) -> str:
    return MARKER_PREFIX + name


def marker_schema(name: str) -> dict[str, Any]:
    """The arguments schema a custom function is built with (vLLM's shim, marked with its name)."""
    return {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
            "additionalProperties": False, MARKER_KEY: marker(name)}


def marked(functions: Sequence[Any]) -> list[Any]:
    """``functions`` (``AllowedFunction``\\ s) with each custom one's arguments marked and pinned
    (a non-strict tool's arguments are any object: the mark would be dropped)."""
    return [dataclasses.replace(function, parameters=marker_schema(function.name), strict=True)
            if getattr(function, "input_grammar", None) else function for function in functions]


def with_custom_inputs(tag: StructuralTag | None, functions: Sequence[Any],
                       wire_format_name: str) -> StructuralTag | None:
    """``tag`` with each marked argument node replaced by its custom tool's input grammar; raises
    CapabilityError when the format leaves one where no grammar can go (never a call whose input
    nothing constrains)."""
    grammars = {f.name: f.input_grammar for f in functions if getattr(f, "input_grammar", None)}
    if tag is None or not grammars:
        return tag
    by_marker = {marker(name): (name, ebnf) for name, ebnf in grammars.items()}

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        schema = node.get("json_schema") if node.get("type") == "json_schema" else None
        found = by_marker.get(schema.get(MARKER_KEY)) if isinstance(schema, Mapping) else None
        style = node.get("style") or "json"
        if found is not None and style in VALUE_FRAMES:
            return input_node(found[1], style, wire_format_name, found[0])
        return {key: visit(value) for key, value in node.items()}

    dumped = visit(tag.model_dump())
    left = sorted({by_marker[mark][0] for mark in _markers(dumped) if mark in by_marker})
    if left:
        raise uncarried(wire_format_name, left[0])
    return StructuralTag.model_validate(dumped)


def input_node(ebnf: str, style: str, wire_format_name: str, name: str) -> dict[str, Any]:
    """The structural-tag node of one custom input in ``style``: the value's frame around the
    grammar (JSON-escaped for the ``json`` style), marked as a client's for the llguidance
    translation (:data:`.lark_ebnf.RULE_FOR_RULE`)."""
    opening, closing = VALUE_FRAMES[style]
    if style == "json":
        try:
            ebnf = json_string_grammar(ebnf)
        except EBNFReadError as exc:
            raise CapabilityError(
                f"the grammar of custom tool {name!r} cannot be written inside a JSON string, which "
                f"is how the {wire_format_name} tool-call format carries a custom tool's input "
                f"({exc}); send the tool with a grammar without that construct, or with "
                "format {\"type\": \"text\"}", capability=CAPABILITY, param="tools") from None
    return {"type": "sequence", "elements": [{"type": "const_string", "value": opening},
                                             {"type": "grammar", "grammar": RULE_FOR_RULE + ebnf},
                                             {"type": "const_string", "value": closing}]}


def uncarried(wire_format_name: str, name: str) -> CapabilityError:
    """The refusal of a custom grammar tool the format's grammar cannot constrain."""
    return CapabilityError(
        f"custom tool {name!r} has a grammar, and this server's tool-call format "
        f"({wire_format_name}) has no argument slot a grammar can constrain in this turn's mode "
        "(its calls are one JSON document, or its grammar is built by code), so the tool's calls "
        "could not be held to its grammar. Leave the tool out of an allowed_tools selection in "
        "`required` mode, send it with format {\"type\": \"text\"}, or serve the model with a "
        "format that writes calls in tags (for example hermes or qwen3_coder)",
        capability=CAPABILITY, param="tool_choice")


def _markers(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        mark = node.get(MARKER_KEY)
        if isinstance(mark, str) and mark.startswith(MARKER_PREFIX):
            yield mark
        for value in node.values():
            yield from _markers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _markers(value)
