"""A request's ``tools`` read into the function catalog: validated specs in canonical order, a
digest that ignores client order and ``strict``, and the collisions that make names ambiguous.

Catalogs are memoized on their exact JSON text: agents resend the same catalog every turn."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from ..errors import ABSENT, CODE_INVALID_TOOLS, InvalidSelectionError, is_name, malformed, quote, type_name
from .identity import FunctionSpec, ToolIdentity, flat_name
from .digest import value_digest
from .resolver import NameResolver

__all__ = ["Api", "Catalog", "catalog_digest", "index_by_flat_name", "parse_catalog", "specs_digest"]

Api = Literal["responses", "chat"]


def index_by_flat_name(specs: Sequence[FunctionSpec]) -> dict[str, FunctionSpec]:
    """flat name -> spec, the first in ``specs`` order winning."""
    by_flat: dict[str, FunctionSpec] = {}
    for spec in specs:
        by_flat.setdefault(spec.flat_name, spec)
    return by_flat


def specs_digest(specs: Sequence[FunctionSpec]) -> str:
    """The catalog digest: independent of order, changes with any function's digest."""
    return value_digest(sorted(spec.digest for spec in specs))


#: (key, accepted types, what the message asks for) of a function definition's optional fields
_OPTIONAL_FUNCTION_FIELDS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    ("description", (str,), "a string"),
    ("parameters", (Mapping,), "a JSON schema object"),
    ("strict", (bool,), "a boolean"),
)


class _Skip(Exception):
    """Abandons one unusable `tools` entry (the parser has noted why)."""


@dataclass
class _Entry:
    spec: FunctionSpec
    param: str  # the definition's path, e.g. "tools[3].tools[1]" or "tools[0].function"

    @property
    def name_param(self) -> str:
        return f"{self.param}.name"


class _CatalogParser:
    """Reads `tools` of either API, skipping entries it cannot use and remembering the first
    problem: ``allowed_tools`` requests raise it (a sound allowlist needs a sound catalog), plain
    choices ignore it and vanilla vLLM reports it as it always did."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.entries: list[_Entry] = []
        self.other_tools: dict[str, str] = {}
        self.first_error: tuple[str, str] | None = None  # (param, message)

    def fail(self, param: str, message: str) -> NoReturn:
        if self.first_error is None:
            self.first_error = (param, message)
        raise _Skip

    def parse(self, tools: Sequence[Any]) -> Catalog:
        for i, tool in enumerate(tools):
            try:
                if self.api == "responses":
                    self._responses_entry(i, tool)
                else:
                    self._chat_entry(i, tool)
            except _Skip:
                continue
        return Catalog.build(tuple(self.entries), self.other_tools, self.first_error)

    def _responses_entry(self, i: int, tool: Any) -> None:
        self._responses_tool(tool, None, f"tools[{i}]")

    def _responses_tool(self, tool: Any, namespace: str | None, param: str) -> None:
        """One Responses tool: a top-level entry (``namespace`` None) or a namespace member."""
        if not isinstance(tool, Mapping):
            example = ('{"type": "function", "name": "...", "parameters": {...}}' if namespace is None
                       else '{"type": "function", "name": "..."}')
            self.fail(param, f"{param} must be an object like {example}, got {type_name(tool)}.")
        tool_type = tool.get("type")
        if tool_type == "function":
            self._function(tool, namespace, param)
        elif tool_type == "namespace" and namespace is None:
            self._namespace(tool, param)
        elif tool_type == "custom" and namespace is None:
            self._custom(tool, param)
        elif isinstance(tool_type, str):
            name = tool.get("name")
            if is_name(name):  # a hosted tool, or a custom member (vLLM does not render one)
                self.other_tools.setdefault(flat_name(name, namespace), tool_type)
        else:
            self.fail(f"{param}.type", f"{param}.type must be a string such as \"function\", "
                                       f"got {type_name(tool_type)}.")

    def _namespace(self, tool: Mapping[str, Any], param: str) -> None:
        namespace = tool.get("name", ABSENT)
        if not is_name(namespace):
            self.fail(f"{param}.name", f"{param}.name (the namespace name) must be a non-empty "
                                       f"string, got {type_name(namespace)}.")
        members = tool.get("tools", ABSENT)
        if not isinstance(members, list):
            self.fail(f"{param}.tools", f"{param}.tools (the members of namespace "
                                        f"{quote(namespace)}) must be an array of tools, got "
                                        f"{type_name(members)}.")
        for k, member in enumerate(members):
            try:
                self._responses_tool(member, namespace, f"{param}.tools[{k}]")
            except _Skip:
                continue

    def _chat_entry(self, i: int, tool: Any) -> None:
        param = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            self.fail(param, f"{param} must be an object like "
                             '{"type": "function", "function": {"name": "...", "parameters": '
                             "{...}}}, " f"got {type_name(tool)}.")
        tool_type = tool.get("type", "function")
        if tool_type == "function":
            function = tool.get("function", ABSENT)
            if not isinstance(function, Mapping):
                hint = (" (the flat {\"type\": \"function\", \"name\": ...} shape is the Responses "
                        "API's; Chat Completions nests the definition under \"function\")"
                        if "name" in tool else "")
                self.fail(f"{param}.function",
                          f"{param}.function must be an object with the function's name, "
                          f"description and parameters, got {type_name(function)}{hint}.")
            self._function(function, None, f"{param}.function")
        elif tool_type == "custom":
            custom = tool.get("custom", ABSENT)
            if not isinstance(custom, Mapping):
                self.fail(f"{param}.custom", f"{param}.custom must be an object with the custom "
                                             "tool's name, description and format, got "
                                             f"{type_name(custom)}.")
            self._custom(custom, f"{param}.custom")
        elif isinstance(tool_type, str):
            inner = tool.get(tool_type)
            name = inner.get("name") if isinstance(inner, Mapping) else tool.get("name")
            if is_name(name):
                self.other_tools.setdefault(name, tool_type)
        else:
            self.fail(f"{param}.type", f"{param}.type must be a string such as \"function\", "
                                       f"got {type_name(tool_type)}.")

    def _function(self, fn: Mapping[str, Any], namespace: str | None, param: str) -> None:
        name = fn.get("name", ABSENT)
        if not is_name(name):
            self.fail(f"{param}.name", f"{param}.name must be a non-empty string (the function "
                                       f"name), got {type_name(name)}.")
        for key, kinds, expected in _OPTIONAL_FUNCTION_FIELDS:
            value = fn.get(key)
            if value is not None and not isinstance(value, kinds):
                self.fail(f"{param}.{key}", f"{param}.{key} must be {expected} or absent, got "
                                            f"{type_name(value)}.")
        description, parameters, strict = (fn.get("description"), fn.get("parameters"),
                                           fn.get("strict"))
        spec = FunctionSpec.build(ToolIdentity(namespace, name), description, parameters, strict)
        self.entries.append(_Entry(spec, param))


    def _custom(self, tool: Mapping[str, Any], param: str) -> None:
        """A ``custom`` tool (Responses' flat definition, or what Chat nests under ``custom``): served to the model as a function of one string ``input``
        (its ``format`` is checked, and compiled, by :mod:`.custom_tools`)."""
        name, description = tool.get("name", ABSENT), tool.get("description")
        if not is_name(name):
            self.fail(f"{param}.name", f"{param}.name must be a non-empty string (the custom tool's "
                                       f"name), got {type_name(name)}.")
        if description is not None and not isinstance(description, str):
            self.fail(f"{param}.description", f"{param}.description must be a string or absent, "
                                              f"got {type_name(description)}.")
        fmt = tool.get("format")
        grammar = (fmt.get("syntax"), fmt.get("definition")) \
            if isinstance(fmt, Mapping) and fmt.get("type") == "grammar" else None
        if grammar is not None and not all(isinstance(part, str) for part in grammar):
            grammar = None   # refused with its field named by custom_tools before any use
        spec = FunctionSpec.custom(name, description, grammar)  # type: ignore[arg-type]
        self.entries.append(_Entry(spec, param))


def _kind_word(spec: FunctionSpec) -> str:
    return "custom tool" if spec.kind == "custom" else "function"


def _describe(spec: FunctionSpec) -> str:
    identity = spec.identity
    if spec.kind == "custom":
        return f"(custom tool {quote(identity.name)})"
    if identity.namespace is None:
        return f"(function {quote(identity.name)})"
    return f"(member {quote(identity.name)} of namespace {quote(identity.namespace)})"


def _collision(entries: Sequence[_Entry]) -> InvalidSelectionError | None:
    """Two catalog functions with one flat name can neither be told apart by a function-only
    selector nor mapped back from model output: allowed_tools refuses rather than guesses."""
    seen: dict[str, _Entry] = {}
    for entry in entries:
        flat = entry.spec.flat_name
        first = seen.get(flat)
        if first is None:
            seen[flat] = entry
            continue
        if first.spec.identity == entry.spec.identity and first.spec.kind == entry.spec.kind:
            return InvalidSelectionError(
                f"{entry.name_param} {quote(flat)} duplicates the {_kind_word(entry.spec)} defined "
                f"at {first.param}; each tool may appear only once in `tools` (two definitions of "
                "one name would let a call, or an approval, be matched to either). Remove one of "
                "the two definitions.",
                reason="duplicate_tool", param=entry.name_param, code=CODE_INVALID_TOOLS)
        return InvalidSelectionError(
            f"{entry.name_param} {_describe(entry.spec)} and {first.param} "
            f"{_describe(first.spec)} both reach the model as {quote(flat)}, so "
            "a call to that name could not be told apart. Rename one of them (or move it to "
            "another namespace).",
            reason="ambiguous_name", param=entry.name_param, code=CODE_INVALID_TOOLS)
    return None


@dataclass(frozen=True)
class Catalog:
    """Everything derived from one `tools` array; cached, so it must never be mutated."""

    entries: tuple[_Entry, ...]  # request order
    specs: tuple[FunctionSpec, ...]  # canonical order
    digest: str
    other_tools: Mapping[str, str]  # name -> type of the tools in `tools` that are not functions
    first_error: tuple[str, str] | None  # (param, message) of the first malformed function entry
    collision: InvalidSelectionError | None  # a template: raise a fresh copy, never this instance
    resolver: NameResolver
    by_flat: Mapping[str, FunctionSpec]

    @classmethod
    def build(cls, entries: tuple[_Entry, ...], other_tools: Mapping[str, str],
              first_error: tuple[str, str] | None) -> Catalog:
        specs = tuple(sorted((entry.spec for entry in entries), key=FunctionSpec.sort_key))
        return cls(entries=entries, specs=specs, digest=specs_digest(specs),
                   other_tools=other_tools, first_error=first_error,
                   collision=_collision(entries), resolver=NameResolver(specs),
                   by_flat=index_by_flat_name(specs))

    def raise_collision(self) -> None:
        """Refuse a catalog in which two functions reach the model under one name."""
        if self.collision is not None:
            template = self.collision
            raise InvalidSelectionError(template.message, reason=template.reason,
                                        param=template.param, code=template.code)

    def check_for_allowlist(self) -> None:
        """Raise what makes this catalog unable to back an allowlist (allowed_tools only)."""
        if self.first_error is not None:
            param, message = self.first_error
            raise malformed(param, message)
        if not self.entries:
            raise InvalidSelectionError(
                "tool_choice allowed_tools selects function (or custom) tools, but `tools` "
                "contains no function tool (and no custom tool). Add the tool definitions to "
                "`tools` (all of them, every turn; the selection narrows them), or drop tool_choice.",
                reason="no_function_tools", param="tools", code=CODE_INVALID_TOOLS)
        self.raise_collision()


@functools.lru_cache(maxsize=64)
def _cached_catalog(api: Api, tools_json: str) -> Catalog:
    # Parsed from our own copy, so later edits of the request body cannot reach cached specs.
    return _CatalogParser(api).parse(json.loads(tools_json))


def parse_catalog(tools: Sequence[Any], api: Api) -> Catalog:
    """The catalog of `tools`, memoized on its exact JSON text.

    Agent clients resend the same catalog every turn, so the parse and the per-function digests
    (the bulk of resolution time for large catalogs) are usually a cache hit. The key keeps the
    client's key order, so a hit also preserves how the client ordered schema properties.
    """
    try:
        key = json.dumps(tools, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):  # not plain JSON (e.g. model objects): parse without caching
        return _CatalogParser(api).parse(tools)
    return _cached_catalog(api, key)


def catalog_digest(tools: Sequence[Mapping[str, Any]], api: Api) -> str:
    """Digest of the function catalog of ``tools`` (same as ``TurnAllowlist.catalog_digest``).

    Permissive: entries vanilla vLLM would reject are skipped rather than raised on. Independent of
    tool order, JSON key order and ``strict``; changes with any name, description or parameters.
    """
    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")
    return parse_catalog(list(tools or []), api).digest
