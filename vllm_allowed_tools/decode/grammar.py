"""The allowed-subset grammar: (policy, wire format) -> an xgrammar structural tag, built as data.

One builder for every registered wire format (:mod:`vllm_allowed_tools.formats`), used by both
constraint stages and by the offline helper, so they never disagree about what a turn may emit. Tags
are cached under the policy digests: building one for a large catalog costs more than a decode step,
and agent clients repeat the same turn. What each mode admits: docs/decode-path.md. No vLLM imports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from xgrammar import StructuralTag
from xgrammar import get_model_structural_tag as xgrammar_model_tag
from xgrammar.structural_tag import (
    JSONSchemaFormat,
    TagFormat,
    TagsWithSeparatorFormat,
    TriggeredTagsFormat,
)

from ..formats import NAME_PLACEHOLDER, GrammarSpec, wire_format
from .argument_slots import (
    ANY_OBJECT,
    clear_slot_cache,
    format_markers,
    json_ebnf,
    object_schema,
    with_object_arguments,
)
from .argument_schemas import every_tool_held, held_to_schema
from .call_lists import list_turn
from .custom_inputs import marked, with_custom_inputs
from .free_text import with_unmarked_free_text
from .lru import LRU as _LRU
from .marker_tokens import with_marker_tokens
from .safe_json import safe_json_ebnf
from .stage import tag_digest
from .vllm_builder import vllm_tag_builder

Mode = Literal["auto", "required"]

#: how strictly arguments are pinned, as vLLM's ``--tool-strict-level``: FUNCTION constrains the
#: call envelope (names) for every tool, PARAMETER also pins every tool's argument schema
STRICT_FUNCTION = 1
STRICT_PARAMETER = 2


@dataclass(frozen=True)
class AllowedFunction:
    """One allowed function as the model sees it: its flat name, JSON schema and ``strict``; for a
    custom tool with a grammar, ``input_grammar`` is its xgrammar EBNF (:mod:`.custom_inputs`)."""
    name: str
    parameters: Mapping[str, Any] | bool | None = field(hash=False, compare=False)
    strict: bool | None = None
    input_grammar: str | None = field(default=None, hash=False, compare=False)


@dataclass(frozen=True)
class GrammarKey:
    """Everything a built tag depends on. The catalog digest binds every function's name,
    description and schema; ``strict_names`` adds the per-request ``strict`` flags it leaves out."""
    wire_format: str
    catalog_digest: str
    allowlist_digest: str
    mode: Mode
    parallel_tool_calls: bool
    strict_names: frozenset[str] = frozenset()
    strict_level: int = STRICT_FUNCTION
    max_whitespace: int | None = None
    #: every tool's arguments held to its schema (:mod:`.argument_schemas`), not only strict ones'
    every_tool_held: bool = True


@dataclass(frozen=True)
class BuiltTag:
    """A structural tag, its JSON (what vLLM and the logits-processor stage take) and the JSON's
    sha256 (what compiled grammars are cached under)."""
    tag: StructuralTag
    json: str
    digest: str


@dataclass(frozen=True)
class _Turn:
    """What one build needs besides the format: the allowed functions and the turn's options."""
    functions: Sequence[AllowedFunction]
    mode: Mode
    parallel: bool
    strict_level: int
    max_whitespace: int | None
    wire_format: str = ""


def _arguments_schema(function: AllowedFunction, strict_level: int) -> Mapping[str, Any]:
    """Pinned schema for strict tools (or every tool at PARAMETER), any JSON object otherwise."""
    if function.strict is True or strict_level >= STRICT_PARAMETER:
        return object_schema(function.parameters)
    return ANY_OBJECT


def _tags(spec: GrammarSpec, turn: _Turn) -> StructuralTag:
    """Calls written as the format's call shapes; in auto mode free text until ``spec.trigger``."""
    tags = [TagFormat(begin=shape.begin.replace(NAME_PLACEHOLDER, function.name),
                      content=JSONSchemaFormat(json_schema=_arguments_schema(function, turn.strict_level),
                                               style=spec.argument_style,
                                               max_whitespace_cnt=turn.max_whitespace),
                      end=shape.end)
            for function in turn.functions for shape in spec.calls]
    if turn.mode == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=[spec.trigger], tags=tags,
                                                        stop_after_first=not turn.parallel))
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                                        stop_after_first=not turn.parallel))


def _xgrammar_builtin(spec: GrammarSpec, turn: _Turn) -> StructuralTag:
    """xgrammar's own template for the format, given only the allowed functions."""
    tools = [{"type": "function", "function": {
        "name": function.name,
        "parameters": function.parameters if function.parameters is not None else {},
        "strict": function.strict is True or turn.strict_level >= STRICT_PARAMETER}}
        for function in turn.functions]
    tag = xgrammar_model_tag(spec.xgrammar_model, tools=tools, tool_choice=turn.mode, reasoning=False,
                             parallel_tool_calls=turn.parallel, max_whitespace_cnt=turn.max_whitespace)
    return _renamed(tag, spec.rename) if spec.rename else tag


#: the fields of a structural tag's nodes that hold markup (never a schema or a tool's text)
_MARKUP_FIELDS = ("begin", "end", "triggers", "excludes")


def _renamed(tag: StructuralTag, rename: Sequence[tuple[str, str]]) -> StructuralTag:
    """``tag`` with its markup strings renamed in one pass (longest match first: ``</think>`` is
    never read as ``<think>``)."""
    table = dict(rename)
    pattern = re.compile("|".join(re.escape(old) for old in sorted(table, key=len, reverse=True)))

    def markup(text: str) -> str:
        return pattern.sub(lambda match: table[match.group(0)], text)

    def visit(node: Any) -> Any:
        if isinstance(node, list):
            return [visit(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {key: ([markup(v) for v in value] if isinstance(value, list) else markup(value))
                if key in _MARKUP_FIELDS and isinstance(value, (str, list)) else visit(value)
                for key, value in node.items()}
    return StructuralTag.model_validate(visit(tag.model_dump()))


def _vllm_builtin(spec: GrammarSpec, turn: _Turn) -> StructuralTag | None:
    """vLLM's own builder for ``spec.vllm_model``, given only the allowed functions (lent by the
    plugin: :mod:`.vllm_builder`)."""
    return vllm_tag_builder()(spec.vllm_model, turn.functions, turn.mode, turn.parallel,
                              turn.strict_level, turn.max_whitespace)


def _call_array(spec: GrammarSpec, turn: _Turn, key: str | None = None) -> dict[str, Any]:
    """The JSON schema of required mode's array of ``{"name", <arguments_key>}`` calls (``key``:
    another arguments key, auto mode's)."""
    key = key or spec.arguments_key
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [function.name]},
        key: _arguments_schema(function, turn.strict_level)},
        "required": ["name", key]} for function in turn.functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not turn.parallel:
        schema["maxItems"] = 1
    return schema


def _json_array(spec: GrammarSpec, turn: _Turn) -> StructuralTag | None:
    """Required mode: a JSON array of ``{"name", <arguments_key>}`` calls (what vLLM's serving
    layer, or the format's parser, reads for these formats), as a JSON-schema node (made a
    :mod:`.safe_json` grammar node in :func:`build_structural_tag`, after custom inputs are
    checked); pythonic calls and auto mode: :func:`.call_lists.list_turn`."""
    if turn.mode == "auto" or spec.call_syntax != "json":
        return list_turn(spec, turn, _arguments_schema, _call_array)
    return StructuralTag(format=JSONSchemaFormat(json_schema=_call_array(spec, turn),
                                                 max_whitespace_cnt=turn.max_whitespace))


def call_array_schema(wire_format_name: str, functions: Sequence[AllowedFunction], *,
                      parallel_tool_calls: bool = True, strict_level: int = STRICT_FUNCTION) -> dict[str, Any]:
    """The JSON schema of a JSON-array format's required turn over ``functions``: the language of
    :func:`build_structural_tag`'s grammar for it, but for what :mod:`.safe_json` takes out (a
    marker or a lone surrogate escape inside a string, non-finite numbers). For a backend that
    compiles JSON schemas but no grammars (outlines)."""
    spec = wire_format(wire_format_name).grammar
    if spec.kind != "json_array" or spec.call_syntax != "json":
        raise ValueError(f"{wire_format_name} is no JSON-array format (or writes its calls otherwise)")
    turn = _Turn(functions=marked(functions), mode="required", parallel=parallel_tool_calls,
                 strict_level=max(strict_level, STRICT_FUNCTION), max_whitespace=None)
    return _call_array(spec, turn)


def _safe_call_array(tag: StructuralTag, wire_format_name: str) -> StructuralTag:
    """A JSON-array turn's tag as one grammar node: xgrammar's EBNF of the array, whose strings
    cannot spell the format's markers (vLLM's parser takes one for the marker: no call) nor a lone
    surrogate escape (the serving layer's pydantic read refuses it), its numbers finite."""
    ebnf = json_ebnf(tag.format.model_dump())
    return StructuralTag.model_validate(
        {"format": {"type": "grammar", "grammar": safe_json_ebnf(ebnf, format_markers(wire_format_name))}})


def _code(spec: GrammarSpec, turn: _Turn) -> StructuralTag | None:
    return spec.builder(turn.functions, turn.mode, turn.parallel, turn.strict_level, turn.max_whitespace)


_BUILDERS: dict[str, Callable[[GrammarSpec, _Turn], StructuralTag | None]] = {
    "tags": _tags, "xgrammar": _xgrammar_builtin, "vllm": _vllm_builtin, "json_array": _json_array,
    "code": _code}


def build_structural_tag(wire_format_name: str, functions: Sequence[AllowedFunction], mode: Mode, *,
                         parallel_tool_calls: bool = True, strict_level: int = STRICT_FUNCTION,
                         max_whitespace: int | None = None,
                         every_tool: bool | None = None) -> StructuralTag | None:
    """The grammar for one turn: only ``functions`` (the allowed ones, in catalog order) may be
    called, each with arguments held to its schema (every tool's, or only strict ones' where
    ``every_tool`` is False; None: the operator's setting). ``None`` where the format has nothing
    to constrain in that mode (auto mode of trigger-less formats)."""
    spec = wire_format(wire_format_name).grammar
    if mode not in ("auto", "required"):
        raise ValueError(f"mode must be 'auto' or 'required', got {mode!r}")
    if not functions:
        raise ValueError("an allowed subset is never empty (the policy resolver refuses that)")
    held = held_to_schema(functions, every_tool=every_tool_held() if every_tool is None else every_tool)
    turn = _Turn(functions=marked(held), mode=mode, parallel=parallel_tool_calls,
                 strict_level=max(strict_level, STRICT_FUNCTION),   # the allowlist is a contract
                 max_whitespace=None if max_whitespace is None else max(1, max_whitespace),  # xgrammar: >= 1
                 wire_format=wire_format(wire_format_name).name)
    tag = with_custom_inputs(_BUILDERS[spec.kind](spec, turn), held, wire_format(wire_format_name).name)
    if tag is None:
        return tag
    if spec.kind == "json_array":   # a JSON array's calls are typed above
        return _safe_call_array(tag, wire_format_name) if tag.format.type == "json_schema" else tag
    tag = with_unmarked_free_text(tag, wire_format_name)   # before: it reads XML argument styles
    tag = with_object_arguments(tag, one_line=spec.arguments_on_one_line,
                                markers=format_markers(wire_format_name))
    return with_marker_tokens(tag, dict(spec.marker_tokens))   # after: it reads ends as text


def built(tag: StructuralTag) -> BuiltTag:
    text = json.dumps(tag.model_dump(), separators=(",", ":"))
    return BuiltTag(tag=tag, json=text, digest=tag_digest(text))


#: a built tag's memory per character of its JSON (the StructuralTag's pydantic objects and the
#: JSON text; measured with tracemalloc by benchmarks/scale_memory.py)
TAG_BYTES_PER_JSON_CHAR = 7


def _tag_cache_limits() -> tuple[int, int | None]:
    from ..settings import current
    settings = current()
    return settings.tag_cache_entries, settings.tag_cache_mb << 20


_TAGS = _LRU(limits=_tag_cache_limits)
_NONE = object()


def cached_subset_tag(key: GrammarKey,
                      functions: Callable[[], Sequence[AllowedFunction]]) -> BuiltTag | None:
    """The built tag for ``key``; ``functions`` (the allowed subset) is only called on a miss.

    The cached tag is shared: callers must not mutate it (vLLM's ``limit_to_single_tool_call`` is
    idempotent on a tag built with ``parallel_tool_calls=False``, which the key already says)."""
    cached = _TAGS.get(key)
    if cached is not None:
        return None if cached is _NONE else cached
    tag = build_structural_tag(key.wire_format, functions(), key.mode,
                               parallel_tool_calls=key.parallel_tool_calls,
                               strict_level=key.strict_level, max_whitespace=key.max_whitespace,
                               every_tool=key.every_tool_held)
    result = built(tag) if tag is not None else None
    _TAGS.put(key, _NONE if result is None else result,
              0 if result is None else len(result.json) * TAG_BYTES_PER_JSON_CHAR)
    return result


def allowed_tools_grammar(body: Mapping[str, Any], wire_format: str, api: Literal["chat", "responses"] = "chat",
                          *, strict_level: int = STRICT_FUNCTION,
                          max_whitespace: int | None = None) -> BuiltTag | None:
    """The grammar for a request body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
    for callers without our server (vLLM's offline ``LLM``): pass the result through
    :func:`vllm_allowed_tools.decode.split.constraint_extra_args` into ``SamplingParams.extra_args``.

    Raises InvalidSelectionError (naming the field) exactly as the server's 400 would; None when the
    body selects no allowlist (plain choices are vLLM's own business)."""
    from ..request import resolve_allowlist
    policy = resolve_allowlist(body, api)
    if policy is None or not policy.has_allowlist or policy.mode is None:
        return None
    from ..request.custom_tools import input_grammar
    functions = [AllowedFunction(spec.flat_name, spec.parameters, spec.strict,
                                 input_grammar(spec.grammar, spec.flat_name))
                 for spec in policy.allowed_specs]
    return turn_tag(wire_format, functions, catalog_digest=policy.catalog_digest,
                    allowlist_digest=policy.allowlist_digest, mode=policy.mode,
                    parallel_tool_calls=policy.parallel_tool_calls, strict_level=strict_level,
                    max_whitespace=max_whitespace)


def turn_tag(wire_format: str, functions: Sequence[AllowedFunction], *, catalog_digest: str,
             allowlist_digest: str, mode: Mode, parallel_tool_calls: bool,
             strict_level: int = STRICT_FUNCTION, max_whitespace: int | None = None) -> BuiltTag | None:
    """The cached tag for one turn's allowed ``functions``: the key is the policy digests plus the
    functions' ``strict`` flags (which the catalog digest leaves out); a miss builds from them."""
    key = GrammarKey(wire_format=wire_format, catalog_digest=catalog_digest,
                     allowlist_digest=allowlist_digest, mode=mode,
                     parallel_tool_calls=parallel_tool_calls,
                     strict_names=frozenset(f.name for f in functions if f.strict is True),
                     strict_level=strict_level, max_whitespace=max_whitespace,
                     every_tool_held=every_tool_held())
    return cached_subset_tag(key, lambda: functions)


def tag_cache_stats() -> tuple[int, int, int]:
    """(hits, misses, entries) of the built-tag cache."""
    return _TAGS.hits, _TAGS.misses, len(_TAGS)


def tag_cache_bytes() -> int:
    """What the built-tag cache holds, by its estimate (:data:`TAG_BYTES_PER_JSON_CHAR`)."""
    return _TAGS.bytes


def clear_tag_cache() -> None:
    _TAGS.clear()
    clear_slot_cache()
