"""The calls of an output under a policy, read where the grammar puts them: from the first call
trigger on (text before it is never a call), and what the wrapper does when that gives none.

Text before the calls can mislead the base parser: vLLM's DeepSeek pattern matches from a stray
``<｜tool▁call▁begin｜>`` in the text (V3 raises on the real call after it, V3.1 reads a call
named `` now. <｜tool▁calls▁begin｜>...``), MiniMax's reads an ``<invoke name=...>`` anywhere,
Llama's reads every ``{`` as the start of a call and nothing once one is not. The auto grammar
keeps the format's markers out of the text (:mod:`..decode.free_text`), so a well-formed turn no
longer writes such text; what the grammar did not shape (Llama's text may still hold a ``{``; a
turn with no grammar) is read here the same way: the call section on its own, the text before it
the message text. A call cut off by the token limit leaves the complete calls before it. Call
markup that still gives no call is logged, never sent as text (docs/response-path.md). A required
turn of a JSON-array format, whose whole output is the array of calls, is read as vLLM's serving
layer reads it where the wrapper reads it itself (:func:`read_required_array`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

from pydantic import TypeAdapter, ValidationError

from ..formats import WireFormat
from .stream_calls import call_start

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

logger = logging.getLogger(__name__)

Parse = Callable[[str], ExtractedToolCallInformation]


def reread_calls(parse: Parse, output: str, triggers: Sequence[str],
                 whole: ExtractedToolCallInformation) -> ExtractedToolCallInformation:
    """The calls of ``output`` given its base parse ``whole``: where text comes before the first
    trigger, the calls of the call section read alone (keeping ``whole``'s content, which the
    wrapper cuts at the first call start: the text before the calls); else ``whole`` where it read
    calls; else the complete calls before the last call start (a call cut off after them), read
    from the output's start, then from the section's. Where a format's calls are JSON objects
    opened by a trigger (Llama's ``{"name": ``), each call read alone wins when it finds more:
    text between the calls may hold a ``{``, which Llama's parser takes for a call's start."""
    info = _reread_section(parse, output, triggers, whole)
    alone = _json_calls_at_triggers(parse, output, triggers)
    if len(alone) > len(info.tool_calls or []):
        return ExtractedToolCallInformation(tools_called=True, tool_calls=alone, content=whole.content)
    return info


def _json_calls_at_triggers(parse: Parse, output: str, triggers: Sequence[str]) -> list[ToolCall]:
    """Each JSON object that starts at a trigger beginning with ``{`` (the auto grammar opens a
    call there and nowhere else in text), read alone by the base parser; the text between them
    skipped, objects inside a call's arguments too. Stops at the first that is not a complete
    call (one cut off by the token limit)."""
    openers = [trigger for trigger in triggers if trigger.startswith("{")]
    calls: list[ToolCall] = []
    position = 0
    while openers:
        starts = [index for index in (output.find(opener, position) for opener in openers) if index != -1]
        if not starts:
            break
        start = min(starts)
        try:
            _, end = _DECODER.raw_decode(output, start)
        except ValueError:
            break
        read = parse(output[start:end])
        if len(read.tool_calls or []) != 1:
            break
        calls.extend(read.tool_calls)
        position = end
    return calls


_DECODER = json.JSONDecoder()


def _reread_section(parse: Parse, output: str, triggers: Sequence[str],
                    whole: ExtractedToolCallInformation) -> ExtractedToolCallInformation:
    first = call_start(output, triggers)
    first = first if first and any(output.startswith(trigger, first) for trigger in triggers) else None
    if first:
        section = parse(output[first:])
        if section.tool_calls:
            return ExtractedToolCallInformation(tools_called=True, tool_calls=section.tool_calls,
                                                content=whole.content)
    if whole.tools_called:
        return whole
    last = max((output.rfind(trigger) for trigger in triggers), default=-1)
    if last > 0 and call_start(output[:last], triggers) is not None:
        earlier = parse(output[:last])
        if earlier.tools_called:
            return earlier
        if first and first < last:
            earlier = parse(output[first:last])
            if earlier.tool_calls:
                return ExtractedToolCallInformation(tools_called=True, tool_calls=earlier.tool_calls,
                                                    content=whole.content)
    return whole


def log_unread_markup(entry: WireFormat, output: str, info: ExtractedToolCallInformation) -> None:
    """Say so when the read ``info`` of ``output`` (format ``entry``) has call markup and no call:
    a debug line where no call end follows the last call start (the token limit cut the call: the
    response says ``length`` / ``incomplete``), a warning otherwise (a complete call its parser
    could not read; or, for a format without call ends, one of the two)."""
    start = call_start(output, entry.call_triggers)
    if info.tool_calls or not info.tools_called or start is None:
        return
    last = max([output.rfind(trigger) for trigger in entry.call_triggers] + [start])
    cut = bool(entry.call_ends) and not any(end in output[last:] for end in entry.call_ends)
    (logger.debug if cut else logger.warning)(
        "vllm-allowed-tools: the %s parser read no call from the call markup the model wrote (%d "
        "characters from the first call start on, %s); the text before it is the answer",
        entry.parser_name, len(output) - start,
        "cut off" if cut else "unreadable" if entry.call_ends else "unreadable or cut off")


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
