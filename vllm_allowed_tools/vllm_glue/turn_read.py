"""vLLM's request, read once into what its turn's grammar is decided from (:class:`TurnRead`).

The parser wrappers (:mod:`.parsers`) read the request here, hand the read to
:func:`..decode.turn_grammar.decide_turn` (or, when vLLM's parser asks for a tag,
:func:`..decode.turn_grammar.turn_tag_for`) and write the decision back; nothing below reads the
request again. Also the request as vLLM's own tag builder sees it on a plain turn
(:func:`tools_held_to_schema`).
"""

from __future__ import annotations

from typing import Any

from ..decode.argument_schemas import every_tool_held, held_to_schema
from ..decode.grammar import AllowedFunction
from ..decode.turn_grammar import Outputs, TurnRead, Wrapper
from ..request.custom_tools import input_grammar
from ..server_tools.server_turn import registered
from ..wire import XARGS_TAG, WireAllowlist, tool_choice_of
from .server_tool_hook import tool_schemas


def read_turn(request: Any, allowlist: WireAllowlist | None, wrapper: Wrapper) -> TurnRead:
    """``request`` (after the base parser's own adjustment) as its turn's grammar needs it. A plain
    turn (no ``allowlist``) reads no server-side state: vLLM's own path serves it."""
    outputs = getattr(request, "structured_outputs", None)
    server = allowlist is not None and bool(allowlist.server)
    listings = {builtin: tool_schemas(builtin) for builtin, _ in allowlist.server
                if builtin != "python"} if server else {}
    server_turn = registered(getattr(request, "model_extra", None)) if server else None
    custom = allowlist.custom if allowlist is not None else {}
    # the client's response format, a policy turn's (a plain turn's is vLLM's business); where
    # vLLM's own parser already set a tag format's structural tag (DelegatingParser.
    # _apply_structural_tag, the client's format beside the calls) the turn keeps it and asks none
    tagged = wrapper.tag_model is not None and outputs is not None and outputs.structural_tag is not None
    client_format = allowlist is not None and not tagged and request.extract_structured_outputs() is not None
    return TurnRead(
        wrapper=wrapper, allowlist=allowlist,
        catalog=tuple(AllowedFunction(name=function.name, parameters=function.parameters,
                                      strict=getattr(function, "strict", None),
                                      input_grammar=input_grammar(custom.get(function.name), function.name))
                      for function in (getattr(tool, "function", None) or tool
                                       for tool in function_tools(request))),
        choice=tool_choice_of(request, "chat" if hasattr(request, "messages") else "responses"),
        parallel_tool_calls=getattr(request, "parallel_tool_calls", None) is not False,
        has_tools=bool(getattr(request, "tools", None)),
        outputs=None if outputs is None else Outputs(outputs.structural_tag, outputs.json),
        client_format=client_format,
        xargs_tag=(getattr(request, "vllm_xargs", None) or {}).get(XARGS_TAG),
        max_tokens=requested_max_tokens(request),
        reasoning_shown=getattr(request, "include_reasoning", True) is not False,
        server_listings=listings,
        wants_grammar_after_a_call=server_turn is not None and server_turn.grammar_after_a_call is None,
        server_turn=server_turn)


def tool_name(tool: Any) -> str | None:
    """The name of a tool (Chat's nested ``function`` or Responses' flat)."""
    function = getattr(tool, "function", None)
    return getattr(function, "name", None) if function is not None else getattr(tool, "name", None)


def function_tools(request: Any) -> list[Any]:
    """The request's function tools as the model sees them (namespace members flattened)."""
    tools = list(request.tools or [])
    try:
        from vllm.tool_parsers.utils import get_function_tools
        return list(get_function_tools(tools))
    except ImportError:  # pragma: no cover - older vLLM without namespace flattening
        return tools


def requested_max_tokens(request: Any) -> int | None:
    """The request's output budget: Chat's ``max_completion_tokens`` / ``max_tokens``, Responses'
    ``max_output_tokens`` (None when it sets none)."""
    for field in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(request, field, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def tools_held_to_schema(request: Any) -> Any:
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
