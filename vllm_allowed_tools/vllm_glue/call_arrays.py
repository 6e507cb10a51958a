"""Required turns of the JSON-array formats (granite, mistral, pythonic, ...): the grammar handed to
vLLM and the read of a bare array.

A JSON-array format has no call markup to hang a structural tag on: a required turn's whole output
is the array of calls. Its grammar is decode/grammar.py's array of allowed calls as a safe_json
grammar node (strings cannot spell the format's markers), or the plain JSON schema where the
backend compiles a schema but no grammar (outlines).
"""

from __future__ import annotations

import json

from pydantic import TypeAdapter, ValidationError
from vllm.sampling_params import StructuredOutputsParams
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

from ..decode.grammar import call_array_schema
from ..settings import STAGE_LOGITS_PROCESSOR
from ..errors import CapabilityError
from ..formats import wire_format
from ..wire import WireAllowlist
from .capabilities import active_constraint_stage, json_schema_stays_native
from .turn_grammar import allowed_functions, request_subset_tag

try:  # vLLM 0.32 / 0.33
    from vllm.entrypoints.generate.base.protocol import (
        ExtractedToolCallInformation,
        FunctionCall,
        FunctionDefinition,
        ToolCall,
    )
except ImportError:  # pragma: no cover - older layout
    from vllm.entrypoints.openai.engine.protocol import (
        ExtractedToolCallInformation,
        FunctionCall,
        FunctionDefinition,
        ToolCall,
    )


def required_array_grammar(parser: str, request, allowlist: WireAllowlist) -> StructuredOutputsParams:
    """The structured outputs of a required turn of JSON-array format ``parser``."""
    tag = request_subset_tag(parser, request, allowlist, ToolStrictLevel.FUNCTION)
    if tag is None:
        raise CapabilityError(f"the {parser!r} format produced no grammar for a required turn",
                              capability="structural_tag", status=500)
    schema = None
    if active_constraint_stage() == STAGE_LOGITS_PROCESSOR and \
            wire_format(parser).grammar.call_syntax == "json":   # pythonic calls are no JSON
        schema = call_array_schema(parser, allowed_functions(request, allowlist),
                                   parallel_tool_calls=allowlist.parallel_tool_calls)
    if schema is not None and json_schema_stays_native(schema):
        # a backend that compiles this JSON schema but no grammar (outlines) keeps the schema:
        # its strings may then spell a marker or a lone surrogate (docs/decode-path.md)
        return StructuredOutputsParams(json=schema)
    return StructuredOutputsParams(structural_tag=tag.json)   # the array as a safe_json grammar node


def auto_list_grammar(parser: str, request, allowlist: WireAllowlist) -> StructuredOutputsParams | None:
    """The structured outputs of an auto turn of JSON-array format ``parser``: free text, and
    after its trigger (or at the message's start) only allowed calls (decode/call_lists.py);
    None for a format without one (the output guard holds it)."""
    tag = request_subset_tag(parser, request, allowlist, ToolStrictLevel.FUNCTION)
    if tag is None:
        return None
    if request.extract_structured_outputs() is not None:
        raise CapabilityError(
            "allowed_tools in auto mode together with a response format is not supported on the "
            f"{parser!r} format (its calls and the format's JSON would be one grammar); drop the "
            "response format", capability="structural_tag+response_format")
    return StructuredOutputsParams(structural_tag=tag.json)


def without_client_formats(request):
    """``request`` with no response format of the client's left beside the turn's grammar (vLLM
    would take either as the one structured output)."""
    if hasattr(request, "response_format"):
        request.response_format = None
    if hasattr(request, "text") and not hasattr(request, "messages"):
        request.text = None
    return request


def read_required_array(model_output: str) -> ExtractedToolCallInformation:
    """vLLM's serving-layer read of a required turn (DelegatingParser._extract_tool_calls:
    ``list[FunctionDefinition]`` from the whole output, ``parameters`` as the arguments)."""
    try:
        parsed = TypeAdapter(list[FunctionDefinition]).validate_json(model_output or "")
    except ValidationError:
        parsed = []
    calls = [ToolCall(function=FunctionCall(name=call.name, arguments=json.dumps(
        call.parameters, ensure_ascii=False))) for call in parsed]
    return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls, content=None)
