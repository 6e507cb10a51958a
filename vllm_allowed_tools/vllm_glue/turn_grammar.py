"""The grammar a request is decoded with, as the wrappers hand it to vLLM or to our logits processor.

The wrappers in :mod:`.parsers` decide *when* a turn is constrained; this module builds *what*: the
allowed subset's tag (cached), the format's own tag for plain requests on formats whose base parser
has none, and the move of a grammar from vLLM's structured outputs to the logits-processor stage.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..decode.argument_schemas import every_tool_held, held_to_schema
from ..decode.grammar import AllowedFunction, BuiltTag, build_structural_tag, built, tag_digest, turn_tag
from ..decode.split import split_for_request
from ..formats import wire_format as format_named
from ..request.custom_tools import input_grammar
from ..settings import current
from ..wire import (
    XARGS_DIGEST,
    XARGS_MUST_CALL,
    XARGS_REFUSED_TOKENS,
    XARGS_TAG,
    ToolChoice,
    WireAllowlist,
    tool_choice_of,
)
from .capabilities import json_schema_stays_native

logger = logging.getLogger(__name__)

#: the reserve of a turn whose shortest call could not be sized
FALLBACK_RESERVE = 64


def tool_name(tool: Any) -> str | None:
    """The name of a tool (Chat's nested ``function`` or Responses' flat)."""
    function = getattr(tool, "function", None)
    return getattr(function, "name", None) if function is not None else getattr(tool, "name", None)


def request_tool_choice(request) -> ToolChoice:
    """The request's ``tool_choice`` as :mod:`..wire` reads it (Chat Completions requests are the
    ones with ``messages``)."""
    return tool_choice_of(request, "chat" if hasattr(request, "messages") else "responses")


def function_tools(request) -> list[Any]:
    """The request's function tools as the model sees them (namespace members flattened)."""
    tools = list(request.tools or [])
    try:
        from vllm.tool_parsers.utils import get_function_tools
        return list(get_function_tools(tools))
    except ImportError:  # pragma: no cover - older vLLM without namespace flattening
        return tools


def catalog_functions(request, allowlist: WireAllowlist | None = None) -> list[AllowedFunction]:
    """Every function of the request's catalog, in catalog order; a custom tool (vLLM's function
    shim) with the grammar the allowlist carries for it, which then constrains its input."""
    functions = [getattr(tool, "function", None) or tool for tool in function_tools(request)]
    custom = allowlist.custom if allowlist is not None else {}
    return [AllowedFunction(name=function.name, parameters=function.parameters,
                            strict=getattr(function, "strict", None),
                            input_grammar=input_grammar(custom.get(function.name), function.name))
            for function in functions]


def allowed_functions(request, allowlist: WireAllowlist) -> list[AllowedFunction]:
    """The allowed functions in catalog order."""
    return [function for function in catalog_functions(request, allowlist)
            if function.name in allowlist.allowed]


def tools_held_to_schema(request):
    """A plain request as vLLM's own tag builder should see it: each function tool whose schema
    xgrammar compiles marked ``strict``, so ``required``, named choices and calls after a trigger
    follow the schema, string lengths left to the guard where they compile slowly
    (:mod:`..decode.argument_schemas`); a shallow copy, the client's request is
    untouched (the guard reads the client's own ``strict``)."""
    tools = list(getattr(request, "tools", None) or [])
    if not tools:
        return request

    def definition(tool):   # Chat nests the function; Responses' function tool is flat
        return getattr(tool, "function", None) or tool

    def pinned(tool, schema, strict):
        inner = definition(tool)
        held = inner.model_copy(update={"strict": strict, "parameters": schema})
        return tool.model_copy(update={"function": held}) if inner is not tool else held

    functions = [tool for tool in tools if getattr(tool, "type", None) == "function"
                 and hasattr(definition(tool), "parameters") and hasattr(definition(tool), "strict")]
    held = held_to_schema(functions, every_tool=every_tool_held(), name=lambda t: definition(t).name,
                          parameters=lambda t: definition(t).parameters,
                          strict=lambda t: definition(t).strict, pinned=pinned)
    swap = {id(old): new for old, new in zip(functions, held) if new is not old}
    if not swap:
        return request
    return request.model_copy(update={"tools": [swap.get(id(tool), tool) for tool in tools]})


def plain_request_tag(wire_format: str, request, strict_level):
    """A request without an allowlist, on a format whose tag is ours: ``required`` and named
    choices get the format's own grammar over the catalog (or the named function); anything else
    is free text, as vLLM leaves it without a structural tag."""
    choice = request_tool_choice(request)
    named = choice.named.tool_name if choice.named is not None else None
    functions = catalog_functions(request)
    if choice.string == "required":
        mode, parallel = "required", request.parallel_tool_calls is not False
    elif named is not None:
        functions = [function for function in functions if function.name == named]
        mode, parallel = "required", False
    else:
        return None
    if not functions:
        return None
    return build_structural_tag(wire_format, functions, mode, parallel_tool_calls=parallel,
                                strict_level=int(strict_level), max_whitespace=current().whitespace_limit)


def request_subset_tag(wire_format: str, request, allowlist: WireAllowlist, strict_level) -> BuiltTag | None:
    """The cached tag for this turn (see grammar.turn_tag)."""
    return turn_tag(wire_format, allowed_functions(request, allowlist),
                    catalog_digest=allowlist.catalog_digest, allowlist_digest=allowlist.allowlist_digest,
                    mode=allowlist.mode,  # type: ignore[arg-type]
                    parallel_tool_calls=allowlist.parallel_tool_calls, strict_level=int(strict_level),
                    max_whitespace=current().whitespace_limit)


def hand_grammar_to_logits_processor(request, wire_format: str, allowlist: WireAllowlist) -> None:
    """Move the grammar from vLLM's native structured outputs to our logits processor's request
    arguments (the same grammar: a structural tag, or the JSON-schema fallback wrapped in one),
    with its split into catalog and envelope where it has one (decode/split.py). A JSON schema the
    native backend compiles exactly stays there (capabilities.json_schema_stays_native)."""
    outputs = getattr(request, "structured_outputs", None)
    if outputs is None or (outputs.structural_tag is None and outputs.json is not None
                           and json_schema_stays_native(outputs.json)):
        return
    if outputs.structural_tag is not None:
        tag_json = outputs.structural_tag
    elif outputs.json is not None:
        from xgrammar import StructuralTag
        from xgrammar.structural_tag import JSONSchemaFormat
        schema = json.loads(outputs.json) if isinstance(outputs.json, str) else outputs.json
        tag_json = built(StructuralTag(format=JSONSchemaFormat(json_schema=schema))).json
    else:
        return
    split = split_for_request(
        wire_format, tag_json, catalog_functions(request, allowlist), allowed_functions(request, allowlist),
        catalog_digest=allowlist.catalog_digest, allowlist_digest=allowlist.allowlist_digest,
        mode=allowlist.mode,  # type: ignore[arg-type]
        parallel_tool_calls=allowlist.parallel_tool_calls,
        max_whitespace=current().whitespace_limit) \
        if outputs.structural_tag and not allowlist.server else None
    request.vllm_xargs = {**(request.vllm_xargs or {}), XARGS_TAG: tag_json,
                          XARGS_DIGEST: tag_digest(tag_json),
                          **(split.extra_args() if split is not None else {})}
    request.structured_outputs = None


def must_call(request, allowlist: WireAllowlist | None) -> bool:
    """Whether the turn must call: an allowlist in ``required`` mode with something callable, or
    (no allowlist) plain ``required`` or a named tool."""
    if allowlist is not None:
        return allowlist.mode == "required" and bool(allowlist.allowed or allowlist.server)
    choice = request_tool_choice(request)
    return choice.string == "required" or (choice.named is not None and choice.named.tool_name is not None)


def requested_max_tokens(request) -> int | None:
    """The request's output budget: Chat's ``max_completion_tokens`` / ``max_tokens``, Responses'
    ``max_output_tokens`` (None when it sets none)."""
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def call_reserve(request, tokenizer) -> int | None:
    """The tokens the shortest call the request's grammar admits needs (:mod:`..decode.call_budget`),
    from the grammar the wrapper set (the logits-processor stage's, or vLLM's structured outputs);
    None without one."""
    from ..decode.call_budget import reserve_tokens, shortest_array_call, shortest_call_text
    outputs = getattr(request, "structured_outputs", None)
    tag = (getattr(request, "vllm_xargs", None) or {}).get(XARGS_TAG) or \
        (outputs.structural_tag if outputs is not None else None)
    if tag is not None:
        schemas = {function.name: function.parameters for function in catalog_functions(request)}
        pieces = shortest_call_text(tag, schemas)
    elif outputs is not None and outputs.json is not None:
        pieces = shortest_array_call(outputs.json)
    else:
        return None

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None \
            else len(text) // 2 + 1
    return reserve_tokens(pieces, count)


def mark_turn(request, allowlist: WireAllowlist | None, tokenizer, wire_format: str) -> None:
    """What the logits processor holds a tool-bearing turn to beyond its grammar (both stages):
    a turn that must call, its reserve (:func:`mark_must_call`); on a format whose parser reads
    some stop tokens as text (gpt-oss's ``<|endoftext|>``), those tokens, never written
    (:mod:`..decode.refused_tokens`: a call would end with them in its arguments)."""
    mark_must_call(request, allowlist, tokenizer)
    refused = [token for _, token in format_named(wire_format).grammar.text_stop_tokens]
    if refused and getattr(request, "tools", None):
        request.vllm_xargs = {**(request.vllm_xargs or {}), XARGS_REFUSED_TOKENS: refused}


def mark_must_call(request, allowlist: WireAllowlist | None, tokenizer) -> None:
    """A turn that must call carries the reserve of its shortest call to the logits processor
    (both stages): while it reasons it cannot stop, and its reasoning ends while the budget holds
    the call (:mod:`..decode.reasoning_hold`)."""
    # include_reasoning: false constrains a Chat turn from its first token on the native stage,
    # where a hold (which sees the reasoning as open) would refuse the stop after the call
    if not must_call(request, allowlist) or getattr(request, "include_reasoning", True) is False:
        return
    try:
        reserve = call_reserve(request, tokenizer)
    except Exception:   # an estimate must never fail a request: keep a generous stand-in
        logger.warning("vllm-allowed-tools: could not size the shortest call; reserving %d tokens",
                       FALLBACK_RESERVE, exc_info=True)
        reserve = FALLBACK_RESERVE
    if reserve is not None:
        request.vllm_xargs = {**(request.vllm_xargs or {}), XARGS_MUST_CALL: reserve}


#: harmony markup of the two preamble messages around their text (``<|channel|>``, the channel,
#: ``<|message|>``, ``<|end|>``, ``<|start|>``, ``assistant``: six tokens each)
HARMONY_PREAMBLE_MARKUP = 12


def preambles_within_budget(parser, tag, request, allowlist: WireAllowlist):
    """gpt-oss (``parser``'s tag model is harmony): a ``required`` turn's tag whose two preamble
    messages (analysis, commentary) leave
    the request's budget room for its shortest call: each holds at most half of what the budget
    has left after the call and the messages' markup (never more than
    ``VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS``). ``tag`` as it is when the request sets no
    budget or the bound already fits; else a copy (tags are cached)."""
    from ..decode.call_budget import cap_optional_text, reserve_tokens, shortest_call_text
    budget = requested_max_tokens(request)
    if tag is None or budget is None or parser.structural_tag_model != "harmony" \
            or allowlist.mode != "required":
        return tag
    tokenizer = getattr(parser, "model_tokenizer", None)
    schemas = {function.name: function.parameters for function in catalog_functions(request)}
    pieces = shortest_call_text(tag.model_dump(), schemas)
    reserve = reserve_tokens(pieces, lambda text: len(tokenizer.encode(text, add_special_tokens=False))
                             if tokenizer is not None else len(text) // 2 + 1)
    bound = max(0, (budget - reserve - HARMONY_PREAMBLE_MARKUP) // 2)
    configured = current().harmony_preamble_tokens
    if configured and configured <= bound:
        return tag
    data = tag.model_dump()
    cap_optional_text(data, bound)
    return type(tag).model_validate(data)
