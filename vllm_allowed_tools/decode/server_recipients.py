"""The harmony grammar of a turn that may call server-side tools: only the allowed recipients.

vLLM's own harmony tag leaves the recipient free as soon as a built-in tool is offered
(``get_harmony_structural_tag``: ``to=`` then any text). Here the turn's tag admits the allowed
functions (vLLM's builder, as for any turn) and, for each allowed server-side tool, exactly its
recipients as vLLM's dispatch reads them (``container.<tool>``, ``browser.<search|open|find>``,
``python``), the arguments a JSON object (``python``: the code, any text). The tool catalog stays
whole in the prompt; only what may be written is narrowed.

Every call of such a turn ends with ``<|call|>`` and nothing else: vLLM's tags end a call at any
stop token (``""``), and a call ended by ``<|return|>`` reads as complete to vLLM's loop, which would
run it. ``<|call|>`` is a stop token, which xgrammar admits only where its grammar has ended, so a
grammar naming it as content needs it out of the grammar's stop set (vLLM still stops on it:
:func:`..vllm_glue.harmony_tools.stop_tokens_for_grammar`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from xgrammar import StructuralTag
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    JSONSchemaFormat,
    OptionalFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    TagFormat,
)

from .marker_tokens import with_marker_tokens

#: the tools vLLM's browser dispatches (``browser.<name>``)
BROWSER_TOOLS = ("search", "open", "find")
#: a call's end: harmony's <|call|>, as its token (the marker rewrite), never another stop token
CALL_END = "<|call|>"
_OBJECT = {"type": "object"}


#: the preamble messages a harmony tag admits before its call: ``<|channel|>X<|message|>``
PREAMBLE_BEGINS = ("<|channel|>analysis<|message|>", "<|channel|>commentary<|message|>")


def _preamble(channel: str, max_tokens: int | None = None) -> OptionalFormat:
    return OptionalFormat(content=SequenceFormat(elements=[
        TagFormat(begin=f"<|channel|>{channel}<|message|>", content=AnyTextFormat(max_tokens=max_tokens),
                  end="<|end|>"),
        ConstStringFormat(value="<|start|>assistant")]))


def preamble_bound(mode: str) -> int | None:
    """The most tokens each preamble message of a harmony turn in ``mode`` may hold: a
    ``required`` turn's (``VLLM_ALLOWED_TOOLS_HARMONY_PREAMBLE_TOKENS``, 0 for none), so its call
    comes within the turn's token budget; None (no bound) for ``auto``, which may answer instead."""
    from ..settings import current
    return (current().harmony_preamble_tokens or None) if mode == "required" else None


def bound_preambles(node: Any, max_tokens: int | None) -> None:
    """In place: the free text of each preamble message in ``node`` (a harmony tag's format, as
    vLLM builds it: an analysis and a commentary message before the call) holds at most
    ``max_tokens`` tokens (xgrammar counts them as the model writes them; then only ``<|end|>``
    may follow). A new ``any_text`` each: vLLM's tags share one instance."""
    if max_tokens is None:
        return
    if isinstance(node, TagFormat) and node.begin in PREAMBLE_BEGINS and isinstance(node.content, AnyTextFormat):
        node.content = node.content.model_copy(update={"max_tokens": max_tokens})
    for child in (getattr(node, name) for name in getattr(type(node), "model_fields", ())):
        for item in child if isinstance(child, list) else [child]:
            bound_preambles(item, max_tokens)


def _object_schema(schema: Any) -> dict[str, Any]:
    """A tool's input schema as the call's arguments grammar: an object, no keys it does not name
    (an MCP server validates its arguments against it; extra keys never reach the tool)."""
    if not isinstance(schema, Mapping) or schema.get("type") not in (None, "object"):
        return dict(_OBJECT)
    out = {k: v for k, v in schema.items() if k not in ("title", "$schema")}
    out["type"] = "object"
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def server_call_formats(recipients: Sequence[tuple[str, str | None]], max_whitespace: int | None,
                        listings: Callable[[str], Mapping[str, Any] | None] = lambda builtin: None) -> list[Any]:
    """One format per allowed recipient (``(built-in, tool name or None for any of its tools)``);
    ``listings``: the tools the tool server lists for a built-in (name -> input schema), which
    give a recipient without a name its names and every call its arguments' schema."""
    formats: list[Any] = []
    ws = {} if max_whitespace is None else {"max_whitespace_cnt": max(1, max_whitespace)}
    for builtin, name in recipients:
        if builtin == "python":
            formats.append(TagFormat(begin="<|channel|>commentary to=python<|message|>",
                                     content=AnyTextFormat(excludes=["<|start|>", "<|end|>"]),
                                     end=CALL_END))
            continue
        listed = listings(builtin) or {}
        names: Sequence[str | None] = [name]
        if name is None:
            names = sorted(listed) if listed else (BROWSER_TOOLS if builtin == "browser" else [None])
        for tool in names:
            arguments = JSONSchemaFormat(json_schema=_object_schema(listed.get(tool or "")), **ws)
            if tool is not None:
                formats.append(TagFormat(
                    begin=f"<|channel|>commentary to={builtin}.{tool} <|constrain|>json<|message|>",
                    content=arguments, end=CALL_END))
            else:   # any tool of this server: a plain identifier, as MCP names are
                formats.append(SequenceFormat(elements=[
                    ConstStringFormat(value=f"<|channel|>commentary to={builtin}."),
                    RegexFormat(pattern=r"[A-Za-z_][A-Za-z0-9_\-]{0,63}"),
                    ConstStringFormat(value=" <|constrain|>json<|message|>"), arguments,
                    ConstStringFormat(value=CALL_END)]))
    return formats


def with_server_calls(function_tag: StructuralTag | None, recipients: Sequence[tuple[str, str | None]],
                      mode: str, max_whitespace: int | None,
                      listings: Callable[[str], Mapping[str, Any] | None] = lambda builtin: None) -> StructuralTag:
    """The turn's tag: ``function_tag`` (vLLM's harmony tag over the allowed functions, or None
    when none is allowed) with the allowed server-side recipients added to its alternatives; in
    ``auto`` mode a final answer stays admitted."""
    extra = server_call_formats(recipients, max_whitespace, listings)
    if function_tag is not None:
        body = function_tag.format
        if isinstance(body, SequenceFormat) and body.elements and isinstance(body.elements[-1], OrFormat):
            body.elements[-1].elements.extend(extra)
            return _as_tokens(function_tag)
        return _as_tokens(StructuralTag(format=OrFormat(elements=[body, *extra])))
    alternatives = list(extra)
    if mode == "auto":
        alternatives += [TagFormat(begin=f"<|channel|>final{constrain}<|message|>",
                                   content=AnyTextFormat(), end=["<|end|>", ""])
                         for constrain in ("", " <|constrain|>json", " json")]
    bound = preamble_bound(mode)
    return _as_tokens(StructuralTag(format=SequenceFormat(elements=[
        _preamble("analysis", bound), _preamble("commentary", bound), OrFormat(elements=alternatives)])))


def _as_tokens(tag: StructuralTag) -> StructuralTag:
    """``tag`` with harmony's markers admitted only as their tokens, as the functions' tag has them
    (:mod:`.marker_tokens`; the recipients added here are written as text first), and every call
    ending with ``<|call|>``."""
    from ..formats import wire_format
    markers = dict(wire_format("openai").grammar.marker_tokens)
    rewritten = with_marker_tokens(tag, markers)
    if rewritten is None or CALL_END not in markers:
        return rewritten
    return StructuralTag.model_validate(_calls_end_with(rewritten.model_dump(), markers[CALL_END]))


def _calls_end_with(node: Any, token: int | str) -> Any:
    """``node`` (a tag's JSON) with each call's stop end (``""`` after arguments held to a schema
    or grammar: the functions' tags) replaced by ``token``; a final answer (free text) keeps its
    stop end."""
    if isinstance(node, list):
        return [_calls_end_with(item, token) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _calls_end_with(value, token) for key, value in node.items()}
    if out.get("type") == "tag" and (out.get("content") or {}).get("type") not in (None, "any_text"):
        end = out["end"]
        ends = [{"type": "token", "token": token} if e == "" else e
                for e in (end if isinstance(end, list) else [end])]
        out["end"] = ends[0] if len(ends) == 1 else ends
    return out

