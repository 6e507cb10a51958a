"""The allowed-subset grammar: (policy, wire format) -> an xgrammar structural tag, built as data.

One builder for every wire format our parsers cover, used by both constraint stages (vLLM's native
structured outputs and our logits-processor stage) and by the offline helper, so the two stages can
never disagree about what a turn may emit. No vLLM imports.

* ``required``: only allowed calls, at least one, nothing around them;
* ``auto``: free text, and after a call trigger only allowed names (formats whose calls have a
  trigger); formats without one (``mistral``, ``pythonic``) get no grammar in auto mode and rely on
  output filtering and the guard, exactly as on the native path;
* ``parallel_tool_calls: false`` stops after the first call.

Building a tag for a 128-tool catalog costs more than a decode step, and agent clients repeat the
same (catalog, subset) turn after turn, so :func:`allowed_subset_tag` caches the built tag under a
:class:`GrammarKey` made of the policy digests.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from xgrammar import StructuralTag
from xgrammar import get_model_structural_tag as xgrammar_model_tag
from xgrammar.structural_tag import (
    JSONSchemaFormat,
    TagFormat,
    TagsWithSeparatorFormat,
    TokenTriggeredTagsFormat,
    TriggeredTagsFormat,
)

Mode = Literal["auto", "required"]

#: how strictly arguments are pinned, as vLLM's ``--tool-strict-level``: FUNCTION constrains the
#: call envelope (names) for every tool, PARAMETER also pins every tool's argument schema
STRICT_FUNCTION = 1
STRICT_PARAMETER = 2

#: wire format -> the xgrammar builtin template that matches vLLM's parser of that name
_XGRAMMAR_BUILTINS = {"llama3_json": "llama", "qwen3_coder": "qwen_3_coder"}
#: formats whose parser reads a JSON array in required mode (vLLM's JSON-schema fallback)
_JSON_ARRAY_FORMATS = frozenset({"mistral", "pythonic"})
WIRE_FORMATS = frozenset({"hermes", *_XGRAMMAR_BUILTINS, *_JSON_ARRAY_FORMATS})


@dataclass(frozen=True)
class AllowedFunction:
    """One allowed function as the model sees it: its flat name, JSON schema and ``strict``."""
    name: str
    parameters: Mapping[str, Any] | bool | None = field(hash=False, compare=False)
    strict: bool | None = None


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


@dataclass(frozen=True)
class BuiltTag:
    """A structural tag, its JSON (what vLLM and the logits-processor stage take) and the JSON's
    sha256 (what compiled grammars are cached under)."""
    tag: StructuralTag
    json: str
    digest: str


def _arguments_schema(function: AllowedFunction, strict_level: int) -> Mapping[str, Any] | bool:
    """Pinned schema for strict tools (or every tool at PARAMETER), any JSON object otherwise."""
    if function.strict is True or strict_level >= STRICT_PARAMETER:
        return function.parameters if function.parameters is not None else True
    return True


def _hermes(functions: Sequence[AllowedFunction], mode: Mode, parallel: bool,
            strict_level: int) -> StructuralTag:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, with or without newlines."""
    tags = [TagFormat(begin=f'{start}{{"name": "{function.name}", "arguments": ',
                      content=JSONSchemaFormat(json_schema=_arguments_schema(function, strict_level)),
                      end=end)
            for function in functions
            for start, end in (("<tool_call>\n", "}\n</tool_call>"), ("<tool_call>", "}</tool_call>"))]
    if mode == "auto":
        return StructuralTag(format=TriggeredTagsFormat(triggers=["<tool_call>"], tags=tags,
                                                        stop_after_first=not parallel))
    return StructuralTag(format=TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                                        stop_after_first=not parallel))


def _xgrammar_builtin(template: str, functions: Sequence[AllowedFunction], mode: Mode,
                      parallel: bool, strict_level: int) -> StructuralTag:
    tools = [{"type": "function", "function": {
        "name": function.name,
        "parameters": function.parameters if function.parameters is not None else {},
        "strict": function.strict is True or strict_level >= STRICT_PARAMETER}}
        for function in functions]
    tag = xgrammar_model_tag(template, tools=tools, tool_choice=mode, reasoning=False)
    if not parallel:
        _stop_after_first_call(tag.format)
    return tag


def _stop_after_first_call(node: Any) -> None:
    """Stop every tool-call list in ``node`` after its first call, in place (the call lists repeat
    calls, never arguments, in every template we build on)."""
    if isinstance(node, (TriggeredTagsFormat, TagsWithSeparatorFormat, TokenTriggeredTagsFormat)):
        node.stop_after_first = True
    if hasattr(type(node), "model_fields"):
        for name in type(node).model_fields:
            _stop_after_first_call(getattr(node, name))
    elif isinstance(node, (list, tuple)):
        for item in node:
            _stop_after_first_call(item)


def _json_array(functions: Sequence[AllowedFunction], mode: Mode, parallel: bool,
                strict_level: int) -> StructuralTag | None:
    """Required mode: a JSON array of ``{"name", "arguments"}`` calls (what vLLM's serving layer
    parses for these formats); auto mode has no trigger to hang a grammar on."""
    if mode == "auto":
        return None
    calls = [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [function.name]},
        "arguments": (_arguments_schema(function, strict_level)
                      if _arguments_schema(function, strict_level) is not True else {"type": "object"})},
        "required": ["name", "arguments"]} for function in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuralTag(format=JSONSchemaFormat(json_schema=schema))


def cap_json_whitespace(node: Any, limit: int) -> None:
    """Bound the whitespace between JSON tokens in every argument grammar of ``node``, in place."""
    if isinstance(node, JSONSchemaFormat):
        node.max_whitespace_cnt = limit
    elif hasattr(type(node), "model_fields"):
        for name in type(node).model_fields:
            cap_json_whitespace(getattr(node, name), limit)
    elif isinstance(node, (list, tuple)):
        for item in node:
            cap_json_whitespace(item, limit)


def build_structural_tag(wire_format: str, functions: Sequence[AllowedFunction], mode: Mode, *,
                         parallel_tool_calls: bool = True, strict_level: int = STRICT_FUNCTION,
                         max_whitespace: int | None = None) -> StructuralTag | None:
    """The grammar for one turn: only ``functions`` (the allowed ones, in catalog order) may be
    called. ``None`` where the format has nothing to constrain in that mode (auto mode of
    trigger-less formats)."""
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"unknown wire format {wire_format!r}; expected one of "
                         f"{', '.join(sorted(WIRE_FORMATS))}")
    if mode not in ("auto", "required"):
        raise ValueError(f"mode must be 'auto' or 'required', got {mode!r}")
    if not functions:
        raise ValueError("an allowed subset is never empty (the policy resolver refuses that)")
    strict_level = max(strict_level, STRICT_FUNCTION)   # the allowlist is a contract, not a hint
    if wire_format == "hermes":
        tag = _hermes(functions, mode, parallel_tool_calls, strict_level)
    elif wire_format in _XGRAMMAR_BUILTINS:
        tag = _xgrammar_builtin(_XGRAMMAR_BUILTINS[wire_format], functions, mode,
                                parallel_tool_calls, strict_level)
    else:
        tag = _json_array(functions, mode, parallel_tool_calls, strict_level)
    if tag is not None and max_whitespace is not None:
        cap_json_whitespace(tag, max(1, max_whitespace))   # xgrammar needs at least 1
    return tag


def tag_digest(tag_json: str) -> str:
    return hashlib.sha256(tag_json.encode("utf-8")).hexdigest()


def built(tag: StructuralTag) -> BuiltTag:
    import json
    text = json.dumps(tag.model_dump(), separators=(",", ":"))
    return BuiltTag(tag=tag, json=text, digest=tag_digest(text))


class _LRU:
    """A small thread-safe LRU map (the API server builds tags from several threads)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            self.misses += 1
            return None

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._items)


_TAGS = _LRU(capacity=512)
_NONE = object()


def allowed_subset_tag(key: GrammarKey,
                       functions: Callable[[], Sequence[AllowedFunction]]) -> BuiltTag | None:
    """The built tag for ``key``; ``functions`` (the allowed subset) is only called on a miss.

    The cached tag is shared: callers must not mutate it (vLLM's ``limit_to_single_tool_call`` is
    idempotent on a tag built with ``parallel_tool_calls=False``, which the key already says)."""
    cached = _TAGS.get(key)
    if cached is not None:
        return None if cached is _NONE else cached
    tag = build_structural_tag(key.wire_format, functions(), key.mode,
                               parallel_tool_calls=key.parallel_tool_calls,
                               strict_level=key.strict_level, max_whitespace=key.max_whitespace)
    result = built(tag) if tag is not None else None
    _TAGS.put(key, _NONE if result is None else result)
    return result


def allowed_tools_grammar(body: Mapping[str, Any], wire_format: str, api: Literal["chat", "responses"] = "chat",
                          *, strict_level: int = STRICT_FUNCTION,
                          max_whitespace: int | None = None) -> BuiltTag | None:
    """The grammar for a request body's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``,
    for callers without our server (vLLM's offline ``LLM``): pass the result through
    :func:`vllm_allowed_tools.decode.constraint.constraint_extra_args` into ``SamplingParams.extra_args``.

    Raises InvalidSelectionError (naming the field) exactly as the server's 400 would; None when the
    body selects no allowlist (plain choices are vLLM's own business)."""
    from ..request import resolve_allowlist
    policy = resolve_allowlist(body, api)
    if policy is None or not policy.has_allowlist or policy.mode is None:
        return None
    functions = [AllowedFunction(spec.flat_name, spec.parameters, spec.strict)
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
                     strict_level=strict_level, max_whitespace=max_whitespace)
    return allowed_subset_tag(key, lambda: functions)


def tag_cache_stats() -> tuple[int, int, int]:
    """(hits, misses, entries) of the built-tag cache."""
    return _TAGS.hits, _TAGS.misses, len(_TAGS)


def clear_tag_cache() -> None:
    _TAGS.clear()
