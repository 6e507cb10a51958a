"""Grammars vLLM owns: its registered structural-tag builders, given only the allowed functions.

Formats whose grammar vLLM builds itself (GLM's XML arguments, MiniMax's ``<invoke>`` calls) are
``vllm`` grammars in the registry: the tag for an allowed subset is exactly the one vLLM's parser
would build from that subset alone, so a vLLM upgrade that changes the builder changes ours with it.
The plugin lends it to :mod:`vllm_allowed_tools.decode` (:func:`.plugin.register_tag_builder`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai.types.responses import FunctionTool
from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag, limit_to_single_tool_call
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
from xgrammar.structural_tag import JSONSchemaFormat, OrFormat, TagFormat

from ..decode.grammar import STRICT_PARAMETER, AllowedFunction
from ..decode.server_recipients import bound_preambles, preamble_bound


def vllm_structural_tag(model: str, functions: Sequence[AllowedFunction], mode: str, parallel: bool,
                        strict_level: int, max_whitespace: int | None):
    """vLLM's tag for ``model`` over ``functions`` (each ``strict`` pinned as vLLM pins it at
    ``strict_level``), limited to one call without ``parallel``, its argument grammars capped at
    ``max_whitespace`` (xgrammar's option on every ``JSONSchemaFormat``)."""
    tools = [FunctionTool(type="function", name=function.name,
                          parameters=dict(function.parameters) if isinstance(function.parameters, dict)
                          else None,
                          strict=function.strict is True or strict_level >= STRICT_PARAMETER)
             for function in functions]
    level = ToolStrictLevel.PARAMETER if strict_level >= STRICT_PARAMETER else ToolStrictLevel.FUNCTION
    tag = get_model_structural_tag(model=model, tools=tools, tool_choice=mode, reasoning=False,
                                   strict_level=level)
    if tag is None:
        return None
    as_served(model, tag)
    if model == "harmony":   # a required turn's preamble leaves room for its call
        bound_preambles(tag.format, preamble_bound(mode))
    if not parallel:
        limit_to_single_tool_call(tag)
    if max_whitespace is not None:
        _cap_whitespace(tag.format, max_whitespace)
    return tag


def as_served(model: str, tag: Any) -> Any:
    """``tag`` (vLLM's, for ``model``) with the changes we serve it with, in place: harmony calls
    end only at the call token, and a final answer's channel carries no bare constraint word."""
    if model == "harmony":
        _calls_end_at_the_call_token(tag.format)
        _no_bare_constraint_on_final(tag.format)
    return tag


#: the header of a final answer with its constraint written as a plain word: the harmony parser
#: reads ``<|channel|>final json<|message|>...`` as a call to a tool named ``json``
_FINAL_BARE_CONSTRAINT = "<|channel|>final json<|message|>"


def _no_bare_constraint_on_final(node: Any) -> None:
    """vLLM's harmony tag admits a final answer on the channel ``final json`` (besides ``final``
    and ``final <|constrain|>json``); the harmony parser reads that header's ``json`` as the
    recipient, so the answer came back as a call to ``json``, which no allowlist holds (the guard
    then refuses the turn). Those alternatives are dropped; the other two stay."""
    if isinstance(node, OrFormat):
        node.elements = [element for element in node.elements if not _bare_final(element)] \
            or node.elements
    for child in (getattr(node, name) for name in getattr(type(node), "model_fields", ())):
        for item in child if isinstance(child, list) else [child]:
            _no_bare_constraint_on_final(item)


def _bare_final(node: Any) -> bool:
    return isinstance(node, TagFormat) and node.begin == _FINAL_BARE_CONSTRAINT


def _calls_end_at_the_call_token(node: Any) -> None:
    """A harmony function call ends with ``<|call|>``, a stop token (written ``""`` in the tag: the
    grammar ends and only a stop token may follow). vLLM's tag also lets a call end with
    ``<|end|>``: spelled in ordinary tokens it passes the grammar, and the harmony parser, which
    reads token ids, takes it into the arguments (``{"q": "x"}<|end|>``), so calls keep only the
    stop."""
    if isinstance(node, TagFormat) and isinstance(node.content, JSONSchemaFormat) \
            and " to=functions." in node.begin and isinstance(node.end, list) and "" in node.end:
        node.end = [""]
    for child in (getattr(node, name) for name in getattr(type(node), "model_fields", ())):
        for item in child if isinstance(child, list) else [child]:
            _calls_end_at_the_call_token(item)


def _cap_whitespace(node: Any, limit: int) -> None:
    if isinstance(node, JSONSchemaFormat):
        node.max_whitespace_cnt = limit
    for child in (getattr(node, name) for name in getattr(type(node), "model_fields", ())):
        for item in child if isinstance(child, list) else [child]:
            _cap_whitespace(item, limit)

