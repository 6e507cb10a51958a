"""An auto turn's free text, as the format's parser reads it: no marker of the format in it, but as
the opening of a call. No vLLM imports.

An auto turn's grammar is a ``triggered_tags`` node: free text, an allowed call after each trigger,
free text between and after the calls. The format's parser reads that text as well, and a marker
in it breaks the reading: vLLM's DeepSeek pattern matches from a stray ``<｜tool▁call▁begin｜>``
and fails on the real call after it (the base parser then returns no call), MiniMax's reads an
``<invoke name=...>`` anywhere, Granite 4's (vLLM's) reads no call after a stray ``</tool_call>``,
and the parser wrapper takes every call trigger for the start of a call (no text from there on).
Builtin templates exclude some (``<think>``; GLM's own tags), none all. So, for every format whose
grammar has free text (:func:`with_unmarked_free_text`):

* a trigger that starts with one of the format's ``call_triggers`` (the texts the wrapper reads a
  call from) is narrowed to it: Qwen3-Coder's ``<tool_call>\\n<function=`` becomes ``<tool_call>``,
  so a ``<tool_call>`` in the text always opens an allowed call;
* the free text excludes every marker of the format (:func:`text_markers`) that is not part of a
  trigger: an exclude that a trigger holds would keep the trigger itself from being written, and a
  trigger inside a marker opens a call before the marker is complete.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from xgrammar import StructuralTag

from ..formats import wire_format
from .argument_slots import format_markers, tag_markers, xml_value_markup


def text_markers(wire_format_name: str, tag: Mapping[str, Any]) -> tuple[str, ...]:
    """Every marker of the format a dumped ``tag`` is built for: its special tokens, call triggers
    and call-shape markup (:func:`.argument_slots.format_markers`), the markup of the tag's own
    begin/end/trigger strings, the markup its XML argument styles write inside a call
    (``<parameter=``, ``</parameter>``; ``<arg_key>``...), and the format's ``auto_text_excludes``."""
    xml = [text for node in _nodes(tag) if node.get("type") == "json_schema"
           for text in xml_value_markup(str(node.get("style")))]
    return tuple(dict.fromkeys((*format_markers(wire_format_name), *tag_markers(tag), *xml,
                                *wire_format(wire_format_name).grammar.auto_text_excludes)))


def _nodes(node: Any):
    if isinstance(node, list):
        for item in node:
            yield from _nodes(item)
    elif isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _nodes(value)


def narrowed_triggers(triggers: Sequence[str], call_triggers: Sequence[str]) -> list[str]:
    """``triggers`` with each one that starts with a longer-than-nothing call trigger replaced by
    it (the shortest such), in order, without repeats."""
    narrowed = []
    for trigger in triggers:
        opening = min((call for call in call_triggers if call and trigger.startswith(call)),
                      key=len, default=trigger)
        if opening not in narrowed:
            narrowed.append(opening)
    return narrowed


def excludable(markers: Sequence[str], triggers: Sequence[str]) -> list[str]:
    """The ``markers`` free text can be kept from: none that a trigger holds or that holds one."""
    return [marker for marker in markers
            if marker and not any(marker in trigger or trigger in marker for trigger in triggers)]


def with_unmarked_free_text(tag: StructuralTag | None, wire_format_name: str) -> StructuralTag | None:
    """``tag`` with every ``triggered_tags`` node's triggers narrowed to the format's call triggers
    and its free text kept from the format's markers (module docstring). A tag without free text
    (a required turn) comes back as it was."""
    if tag is None:
        return None
    dumped = tag.model_dump()
    if not any(node.get("type") == "triggered_tags" for node in _nodes(dumped)):
        return tag
    call_triggers = wire_format(wire_format_name).call_triggers
    markers = text_markers(wire_format_name, dumped)

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        node = {key: visit(value) for key, value in node.items()}
        if node.get("type") == "triggered_tags":
            triggers = narrowed_triggers(node["triggers"], call_triggers)
            excludes = excludable([*(node.get("excludes") or ()), *markers], triggers)
            node = {**node, "triggers": triggers, "excludes": list(dict.fromkeys(excludes))}
        return node
    return StructuralTag.model_validate(visit(dumped))
