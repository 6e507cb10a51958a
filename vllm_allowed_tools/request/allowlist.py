"""One resolver for both APIs: request ``tools`` + ``tool_choice`` -> :class:`TurnAllowlist` or a 400.

The policy keeps the two things the contract insists on keeping apart:

* the **catalog**: every function tool of the request (Responses ``namespace`` members flattened the
  way vLLM 0.32 shows them to the model, ``<namespace>__<name>``), in a canonical order, with a digest
  that ignores client tool order, JSON key order and ``strict``;
* the **allowlist**: the exact set of canonical identities a turn may call, resolved from
  ``tool_choice: {"type": "allowed_tools", ...}``, plus its mode (``auto`` / ``required``) and
  ``parallel_tool_calls``.

The prompt path renders the catalog; grammar, parser and output guard consult the allowlist. Every
problem with an ``allowed_tools`` selection fails closed here, before dispatch, with an actionable
:class:`~vllm_allowed_tools.errors.InvalidSelectionError`; nothing is ever widened to the catalog.

Plain choices (``none``, ``auto``, ``required``, a named function) are vanilla vLLM's business: for
them :func:`resolve_allowlist` only *describes* the request and never raises; vanilla vLLM validates
them exactly as it always did. Decisions taken where the contract is silent:

* Identities are ``(namespace, name)``. A flat name is never split on ``__`` to recover one (real
  names such as ``mcp__computer_use`` contain it); identities come from the catalog's lookup table.
* A selector name resolves, in order, to: the top-level function of that exact name; the namespaced
  function whose flat name equals it; the unique namespace member with that bare name. Several
  members sharing a bare name (and no top-level function of that name) is ``ambiguous_name``. A
  Responses selector may also carry ``"namespace"``: then exactly ``(namespace, name)`` is selected.
* Two catalog functions with the same flat name are rejected under every choice (a selector, the
  flattened model output and a grant could not tell them apart): the same identity twice is
  ``duplicate_tool``, different identities are ``ambiguous_name``.
* A named choice (``{"type": "function", ...}``) that resolves gives ``choice="named"`` with
  ``allowed={identity}``. One that does not resolve (unknown, ambiguous, malformed) makes
  :func:`resolve_allowlist` return ``None`` so that vanilla vLLM answers with its own error, unchanged
  ("named behaves exactly as in vanilla vLLM"). Hosted/custom/MCP choices likewise return ``None``.
* ``mode`` is required in ``allowed_tools`` (OpenAI's types require it; OpenResponses makes it
  optional, but guessing ``auto`` for a client that meant ``required`` would change the contract);
  ``"none"`` is not a mode.
* The catalog holds function tools only. vLLM 0.32 also shows Responses ``custom`` tools to the model
  as single-string function shims; they are not in the catalog, cannot be selected, and so a call to
  one is never allowed under ``allowed_tools``.
* Catalogs are parsed from a private JSON copy and memoized on their exact JSON text (agents resend
  the same catalog every turn), which keeps resolution of a 128-tool request well under 1 ms.
* ``parallel_tool_calls`` must be a JSON boolean (or null / absent: ``True``) with ``allowed_tools``.
  With plain choices a non-boolean is a 400 too (the middleware first coerces it the way vLLM
  does, see :mod:`.typed_fields`).
* Selector entries may carry extra keys (some clients send whole tool definitions); only ``type``,
  ``name`` (Chat: ``function.name``) and, on Responses, ``namespace`` are read. The other API's entry
  shape is rejected as ``malformed`` with a message showing the expected one.

No vLLM imports here: this module is the part of the plugin that must be testable in milliseconds.
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn

from ..errors import (
    CODE_INVALID_ALLOWED_TOOLS,
    CODE_INVALID_PARALLEL_TOOL_CALLS,
    CODE_INVALID_TOOLS,
    InvalidSelectionError,
)
from ..metrics import record_invalid_selection
from .identity import NAMESPACE_SEPARATOR, flat_name

__all__ = [
    "NAMESPACE_SEPARATOR",
    "Api",
    "Choice",
    "FunctionSpec",
    "Mode",
    "ToolIdentity",
    "TurnAllowlist",
    "canonical_json",
    "catalog_digest",
    "resolve_allowlist",
]

Api = Literal["responses", "chat"]
Choice = Literal["none", "auto", "required", "named", "allowed"]
Mode = Literal["auto", "required"]

#: What vLLM 0.32+ puts between a namespace and a member name (``flat_namespace_tool_name``).

_MODES = ("auto", "required")
_PLAIN_CHOICES = ("none", "auto", "required")
_MAX_LISTED_NAMES = 20
_MAX_QUOTED_CHARS = 80


class NotStrictJSON(ValueError):
    """JSON text that only parses by picking one of several readings (a repeated key, NaN)."""


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            shown = key if len(key) <= 60 else key[:57] + "..."
            raise NotStrictJSON(f"duplicate key {shown!r}")
        result[key] = value
    return result


def _no_constants(token: str) -> Any:
    raise NotStrictJSON(f"{token} is not valid JSON")


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that refuses repeated keys and ``NaN``/``Infinity``: with those, a validator,
    a digest and a handler could each read a different value from the same text."""
    return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)


def canonical_json(obj: Any) -> str:
    """The one JSON serialization every digest is computed over (sorted keys, no whitespace).

    Values JSON cannot represent (never present in a parsed request body) serialize as their
    ``repr`` so that a digest is still computed instead of failing the request.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------------
# identities and specs


@functools.total_ordering
@dataclass(frozen=True)
class ToolIdentity:
    """Canonical identity of a function tool: ``(namespace, name)``, namespace None for top level.

    Ordered by flat name first (the canonical catalog order), then top-level before namespaced.
    (``order=True`` would compare ``None`` with ``str`` namespaces and raise, hence explicit ordering.)
    """

    namespace: str | None
    name: str

    @property
    def flat_name(self) -> str:
        """The name the model sees and emits (vLLM flattens namespace members with ``__``)."""
        return flat_name(self.name, self.namespace) or self.name

    def sort_key(self) -> tuple[str, bool, str, str]:
        return (self.flat_name, self.namespace is not None, self.namespace or "", self.name)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, ToolIdentity):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    def as_json(self) -> list[str | None]:
        return [self.namespace, self.name]


@dataclass(frozen=True)
class FunctionSpec:
    """One validated function definition of the catalog.

    ``digest`` binds identity, description and parameters (canonical JSON), so approvals and grammar
    caches can tell definitions apart; ``strict`` is per-request noise and not part of it.
    ``parameters`` is shared by every request with the same catalog (catalogs are cached; see
    ``_parse_catalog``): treat it as read-only.
    """

    identity: ToolIdentity
    description: str | None
    parameters: dict[str, Any] = field(hash=False)
    strict: bool | None
    digest: str

    @classmethod
    def build(cls, identity: ToolIdentity, description: str | None,
              parameters: Mapping[str, Any] | None, strict: bool | None = None) -> FunctionSpec:
        """A spec with its digest computed; missing parameters become an empty object schema."""
        params = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(params, dict):
            params = dict(params)
        return cls(identity=identity, description=description, parameters=params, strict=strict,
                   digest=function_digest(identity, description, params))

    @property
    def flat_name(self) -> str:
        return self.identity.flat_name

    def chat_tool(self) -> dict[str, Any]:
        """The definition in Chat Completions shape under its flat name (what templates render)."""
        function: dict[str, Any] = {"name": self.flat_name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def function_digest(identity: ToolIdentity, description: str | None,
                    parameters: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of (identity, description, parameters)."""
    return _sha256(canonical_json({"namespace": identity.namespace, "name": identity.name,
                                   "description": description, "parameters": parameters}))


def _index_by_flat(specs: Sequence[FunctionSpec]) -> dict[str, FunctionSpec]:
    by_flat: dict[str, FunctionSpec] = {}
    for spec in specs:
        by_flat.setdefault(spec.flat_name, spec)
    return by_flat


def _catalog_digest_of(specs: Sequence[FunctionSpec]) -> str:
    return _sha256(canonical_json(sorted(spec.digest for spec in specs)))


def _spec_sort_key(spec: FunctionSpec) -> tuple[tuple[str, bool, str, str], str]:
    return (spec.identity.sort_key(), spec.digest)


# --------------------------------------------------------------------------------------------------
# the policy


@dataclass(frozen=True)
class TurnAllowlist:
    """Catalog + allowlist of one request; immutable, cheap to hash into caches by its digests.

    ``allowed`` is None for plain choices (no allowlist), a single identity for ``named``, and
    exactly the resolved subset for ``allowed``. ``original_tool_choice`` is a copy of what the
    client sent (None when it sent nothing), for echoing it back.
    """

    api: Api
    catalog: tuple[FunctionSpec, ...]
    choice: Choice
    mode: Mode | None
    allowed: frozenset[ToolIdentity] | None
    parallel_tool_calls: bool
    catalog_digest: str
    allowlist_digest: str
    original_tool_choice: Any = field(hash=False)
    # flat name -> spec (first in catalog order); built from ``catalog`` when not given
    _by_flat: Mapping[str, FunctionSpec] | None = field(default=None, repr=False, compare=False,
                                                        hash=False)

    def __post_init__(self) -> None:
        by_flat = self._by_flat
        if by_flat is None:
            by_flat = _index_by_flat(self.catalog)
            object.__setattr__(self, "_by_flat", by_flat)
        if self.allowed is not None:  # never widen: an allowlist can only name catalog functions
            for identity in self.allowed:
                spec = by_flat.get(identity.flat_name)
                if spec is None or (spec.identity != identity
                                    and all(s.identity != identity for s in self.catalog)):
                    raise ValueError(f"allowlist names {identity.flat_name!r}, which is not in "
                                     "the catalog")

    @classmethod
    def build(cls, *, api: Api, catalog: Sequence[FunctionSpec], choice: Choice, mode: Mode | None,
              allowed: frozenset[ToolIdentity] | None, parallel_tool_calls: bool = True,
              original_tool_choice: Any = None) -> TurnAllowlist:
        """A policy with canonical catalog order and both digests computed (for tests and glue)."""
        ordered = tuple(sorted(catalog, key=_spec_sort_key))
        return cls(api=api, catalog=ordered, choice=choice, mode=mode, allowed=allowed,
                   parallel_tool_calls=parallel_tool_calls,
                   catalog_digest=_catalog_digest_of(ordered),
                   allowlist_digest=allowlist_digest(choice, mode, allowed, parallel_tool_calls),
                   original_tool_choice=original_tool_choice)

    def lookup(self, flat_name: str) -> FunctionSpec | None:
        """The catalog function the model means by ``flat_name`` (exact match, never split)."""
        return self._by_flat.get(flat_name)  # type: ignore[union-attr]

    def is_allowed(self, flat_name: str) -> bool:
        """May the model call ``flat_name`` this turn? Unknown names and choice ``none``: never."""
        if self.choice == "none":
            return False
        spec = self.lookup(flat_name)
        if spec is None:
            return False
        return self.allowed is None or spec.identity in self.allowed

    @property
    def allowed_specs(self) -> tuple[FunctionSpec, ...]:
        """Callable functions in catalog order: the allowlist, the whole catalog without one, and
        nothing for choice ``none`` (consistent with :meth:`is_allowed`)."""
        if self.choice == "none":
            return ()
        if self.allowed is None:
            return self.catalog
        return tuple(spec for spec in self.catalog if spec.identity in self.allowed)

    @property
    def allowed_flat_names(self) -> tuple[str, ...]:
        """Flat names of :attr:`allowed_specs`, in catalog order (what grammars and templates list)."""
        return tuple(spec.flat_name for spec in self.allowed_specs)

    @property
    def has_allowlist(self) -> bool:
        return self.choice == "allowed"

    def internal_tool_choice(self) -> str | dict[str, Any]:
        """What vanilla vLLM gets as ``tool_choice``: the mode for ``allowed`` (vLLM 0.32/0.33 do not
        enforce ``allowed_tools`` themselves, the plugin does); the client's choice otherwise."""
        if self.choice == "allowed":
            assert self.mode is not None
            return self.mode
        if self.original_tool_choice is None:
            return self.choice
        return self.original_tool_choice


def allowlist_digest(choice: str, mode: str | None, allowed: frozenset[ToolIdentity] | None,
                     parallel_tool_calls: bool) -> str:
    """Digest of (choice, sorted allowed identities, mode, parallel): a grammar cache key part."""
    identities = (None if allowed is None
                  else [i.as_json() for i in sorted(allowed, key=ToolIdentity.sort_key)])
    return _sha256(canonical_json({"choice": choice, "mode": mode, "allowed": identities,
                                   "parallel_tool_calls": bool(parallel_tool_calls)}))


# --------------------------------------------------------------------------------------------------
# catalog parsing


class _Skip(Exception):
    """Abandons one unusable `tools` entry (the parser has noted why)."""


@dataclass
class _Entry:
    spec: FunctionSpec
    param: str  # the definition's path, e.g. "tools[3].tools[1]" or "tools[0].function"

    @property
    def name_param(self) -> str:
        return f"{self.param}.name"


def _quote(value: Any) -> str:
    """A client value for an error message, truncated so one huge name cannot bloat the error."""
    if isinstance(value, str):
        text = value
    elif _jsonable(value):
        text = canonical_json(value)
    else:
        text = repr(value)
    if len(text) > _MAX_QUOTED_CHARS:
        text = text[:_MAX_QUOTED_CHARS] + "..."
    return f"'{text}'"


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class _Absent:
    """Marks a field the client did not send (so messages can say "missing", not "null")."""


_ABSENT: Any = _Absent()


def _type_name(value: Any) -> str:
    if value is _ABSENT:
        return "nothing (the field is missing)"
    if isinstance(value, str) and not value:
        return "an empty string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return type(value).__name__


def _malformed(param: str, message: str, *, code: str = CODE_INVALID_TOOLS) -> InvalidSelectionError:
    return InvalidSelectionError(message, reason="malformed", param=param, code=code)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and value != ""


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

    def parse(self, tools: Sequence[Any]) -> _Catalog:
        for i, tool in enumerate(tools):
            try:
                if self.api == "responses":
                    self._responses_entry(i, tool)
                else:
                    self._chat_entry(i, tool)
            except _Skip:
                continue
        return _Catalog.build(tuple(self.entries), self.other_tools, self.first_error)

    def _responses_entry(self, i: int, tool: Any) -> None:
        param = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            self.fail(param, f"{param} must be an object like "
                             '{"type": "function", "name": "...", "parameters": {...}}, '
                             f"got {_type_name(tool)}.")
        tool_type = tool.get("type")
        if tool_type == "function":
            self._function(tool, None, param)
        elif tool_type == "namespace":
            self._namespace(i, tool, param)
        elif isinstance(tool_type, str):
            name = tool.get("name")
            if _is_name(name):
                self.other_tools.setdefault(name, tool_type)
        else:
            self.fail(f"{param}.type", f"{param}.type must be a string such as \"function\", "
                                       f"got {_type_name(tool_type)}.")

    def _namespace(self, i: int, tool: Mapping[str, Any], param: str) -> None:
        namespace = tool.get("name", _ABSENT)
        if not _is_name(namespace):
            self.fail(f"{param}.name", f"{param}.name (the namespace name) must be a non-empty "
                                       f"string, got {_type_name(namespace)}.")
        members = tool.get("tools", _ABSENT)
        if not isinstance(members, list):
            self.fail(f"{param}.tools", f"{param}.tools (the members of namespace "
                                        f"{_quote(namespace)}) must be an array of tools, got "
                                        f"{_type_name(members)}.")
        for k, member in enumerate(members):
            member_param = f"{param}.tools[{k}]"
            try:
                if not isinstance(member, Mapping):
                    self.fail(member_param, f"{member_param} must be an object like "
                                            '{"type": "function", "name": "..."}, '
                                            f"got {_type_name(member)}.")
                member_type = member.get("type")
                if member_type == "function":
                    self._function(member, namespace, member_param)
                elif isinstance(member_type, str):
                    name = member.get("name")
                    if _is_name(name):  # e.g. a custom member; vLLM does not render it
                        self.other_tools.setdefault(
                            flat_name(name, namespace), member_type)
                else:
                    self.fail(f"{member_param}.type",
                              f"{member_param}.type must be a string such as \"function\", "
                              f"got {_type_name(member_type)}.")
            except _Skip:
                continue

    def _chat_entry(self, i: int, tool: Any) -> None:
        param = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            self.fail(param, f"{param} must be an object like "
                             '{"type": "function", "function": {"name": "...", "parameters": '
                             "{...}}}, " f"got {_type_name(tool)}.")
        tool_type = tool.get("type", "function")
        if tool_type == "function":
            function = tool.get("function", _ABSENT)
            if not isinstance(function, Mapping):
                hint = (" (the flat {\"type\": \"function\", \"name\": ...} shape is the Responses "
                        "API's; Chat Completions nests the definition under \"function\")"
                        if "name" in tool else "")
                self.fail(f"{param}.function",
                          f"{param}.function must be an object with the function's name, "
                          f"description and parameters, got {_type_name(function)}{hint}.")
            self._function(function, None, f"{param}.function")
        elif isinstance(tool_type, str):
            inner = tool.get(tool_type)
            name = inner.get("name") if isinstance(inner, Mapping) else tool.get("name")
            if _is_name(name):
                self.other_tools.setdefault(name, tool_type)
        else:
            self.fail(f"{param}.type", f"{param}.type must be a string such as \"function\", "
                                       f"got {_type_name(tool_type)}.")

    def _function(self, fn: Mapping[str, Any], namespace: str | None, param: str) -> None:
        name = fn.get("name", _ABSENT)
        if not _is_name(name):
            self.fail(f"{param}.name", f"{param}.name must be a non-empty string (the function "
                                       f"name), got {_type_name(name)}.")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            self.fail(f"{param}.description", f"{param}.description must be a string or absent, "
                                              f"got {_type_name(description)}.")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            self.fail(f"{param}.parameters", f"{param}.parameters must be a JSON schema object or "
                                             f"absent, got {_type_name(parameters)}.")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            self.fail(f"{param}.strict", f"{param}.strict must be a boolean or absent, got "
                                         f"{_type_name(strict)}.")
        spec = FunctionSpec.build(ToolIdentity(namespace, name), description, parameters, strict)
        self.entries.append(_Entry(spec, param))


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
        if first.spec.identity == entry.spec.identity:
            return InvalidSelectionError(
                f"{entry.name_param} {_quote(flat)} duplicates the function defined at "
                f"{first.param}; each function may appear only once in `tools` (two definitions of "
                "one name would let a call, or an approval, be matched to either). Remove one of "
                "the two definitions.",
                reason="duplicate_tool", param=entry.name_param, code=CODE_INVALID_TOOLS)
        return InvalidSelectionError(
            f"{entry.name_param} {_describe(entry.spec.identity)} and {first.param} "
            f"{_describe(first.spec.identity)} both reach the model as {_quote(flat)}, so "
            "a call to that name could not be told apart. Rename one of them (or move it to "
            "another namespace).",
            reason="ambiguous_name", param=entry.name_param, code=CODE_INVALID_TOOLS)
    return None


@dataclass(frozen=True)
class _Catalog:
    """Everything derived from one `tools` array; cached, so it must never be mutated."""

    entries: tuple[_Entry, ...]  # request order
    specs: tuple[FunctionSpec, ...]  # canonical order
    digest: str
    other_tools: Mapping[str, str]  # name -> type of the tools in `tools` that are not functions
    first_error: tuple[str, str] | None  # (param, message) of the first malformed function entry
    collision: InvalidSelectionError | None  # a template: raise a fresh copy, never this instance
    resolver: _Resolver
    by_flat: Mapping[str, FunctionSpec]

    @classmethod
    def build(cls, entries: tuple[_Entry, ...], other_tools: Mapping[str, str],
              first_error: tuple[str, str] | None) -> _Catalog:
        specs = tuple(sorted((entry.spec for entry in entries), key=_spec_sort_key))
        return cls(entries=entries, specs=specs, digest=_catalog_digest_of(specs),
                   other_tools=other_tools, first_error=first_error,
                   collision=_collision(entries), resolver=_Resolver(specs),
                   by_flat=_index_by_flat(specs))

    def check_for_allowlist(self) -> None:
        """Raise what makes this catalog unable to back an allowlist (allowed_tools only)."""
        if self.first_error is not None:
            param, message = self.first_error
            raise _malformed(param, message)
        if not self.entries:
            raise InvalidSelectionError(
                "tool_choice allowed_tools selects function tools, but `tools` contains no "
                "function tool. Add the function definitions to `tools` (all of them, every turn; "
                "the selection narrows them), or drop tool_choice.",
                reason="no_function_tools", param="tools", code=CODE_INVALID_TOOLS)
        if self.collision is not None:
            template = self.collision
            raise InvalidSelectionError(template.message, reason=template.reason,
                                        param=template.param, code=template.code)


@functools.lru_cache(maxsize=64)
def _cached_catalog(api: Api, tools_json: str) -> _Catalog:
    # Parsed from our own copy, so later edits of the request body cannot reach cached specs.
    return _CatalogParser(api).parse(json.loads(tools_json))


def _parse_catalog(tools: Sequence[Any], api: Api) -> _Catalog:
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


def _describe(identity: ToolIdentity) -> str:
    if identity.namespace is None:
        return f"(function {_quote(identity.name)})"
    return f"(member {_quote(identity.name)} of namespace {_quote(identity.namespace)})"


# --------------------------------------------------------------------------------------------------
# name resolution


@dataclass
class _Found:
    identity: ToolIdentity | None = None
    candidates: tuple[str, ...] = ()  # flat names, when ambiguous


class _Resolver:
    """Name -> identity over one catalog (top level, then exact flat name, then unique bare name)."""

    def __init__(self, specs: Sequence[FunctionSpec]) -> None:
        self.identities: set[ToolIdentity] = set()
        self.top_level: dict[str, ToolIdentity] = {}
        self.flat: dict[str, ToolIdentity] = {}
        self.bare: dict[str, list[ToolIdentity]] = {}
        for spec in specs:
            identity = spec.identity
            if identity in self.identities:
                continue
            self.identities.add(identity)
            if identity.namespace is None:
                self.top_level.setdefault(identity.name, identity)
            else:
                self.flat.setdefault(identity.flat_name, identity)
                self.bare.setdefault(identity.name, []).append(identity)

    def resolve(self, name: str, namespace: str | None = None) -> _Found:
        if namespace is not None:
            identity = ToolIdentity(namespace, name)
            return _Found(identity if identity in self.identities else None)
        if name in self.top_level:
            return _Found(self.top_level[name])
        if name in self.flat:
            return _Found(self.flat[name])
        members = self.bare.get(name, [])
        if len(members) == 1:
            return _Found(members[0])
        if len(members) > 1:
            return _Found(None, tuple(sorted(i.flat_name for i in members)))
        return _Found()

    def flat_names(self) -> list[str]:
        return sorted(i.flat_name for i in self.identities)


def _names_list(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED_NAMES])
    if len(names) > _MAX_LISTED_NAMES:
        shown += f", ... ({len(names) - _MAX_LISTED_NAMES} more)"
    return shown


# --------------------------------------------------------------------------------------------------
# allowed_tools


_RESPONSES_ENTRY = '{"type": "function", "name": "<function name>"}'
_CHAT_ENTRY = '{"type": "function", "function": {"name": "<function name>"}}'
_RESPONSES_SHAPE = ('{"type": "allowed_tools", "mode": "auto" | "required", "tools": ['
                    + _RESPONSES_ENTRY + ", ...]}")
_CHAT_SHAPE = ('{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": ['
               + _CHAT_ENTRY + ", ...]}}")


def _selection_error(message: str, reason: str, param: str) -> InvalidSelectionError:
    return InvalidSelectionError(message, reason=reason, param=param,
                                 code=CODE_INVALID_ALLOWED_TOOLS)


def _selection_container(choice: Mapping[str, Any], api: Api) -> tuple[Mapping[str, Any], str]:
    """The object holding ``mode`` and ``tools``, and its param prefix."""
    if api == "responses":
        if "tools" not in choice and "mode" not in choice and "allowed_tools" in choice:
            raise _selection_error(
                "tool_choice.allowed_tools: the Responses API takes the selection flat on "
                f"tool_choice, as {_RESPONSES_SHAPE}; the nested \"allowed_tools\" object is the "
                "Chat Completions shape.", "malformed", "tool_choice.allowed_tools")
        return choice, "tool_choice"
    inner = choice.get("allowed_tools", _ABSENT)
    if not isinstance(inner, Mapping):
        hint = ("; the flat \"mode\"/\"tools\" fields on tool_choice are the Responses API's shape"
                if ("tools" in choice or "mode" in choice) else "")
        raise _selection_error(
            f"tool_choice.allowed_tools must be an object, got {_type_name(inner)}: Chat "
            f"Completions expects {_CHAT_SHAPE}{hint}.", "malformed", "tool_choice.allowed_tools")
    return inner, "tool_choice.allowed_tools"


def _selection_mode(container: Mapping[str, Any], prefix: str) -> Mode:
    param = f"{prefix}.mode"
    if "mode" not in container or container["mode"] is None:
        raise _selection_error(
            f"{param} is required: \"auto\" (the model may answer in text or call the selected "
            "functions) or \"required\" (it must call at least one of them).",
            "invalid_mode", param)
    mode = container["mode"]
    if mode == "none":
        raise _selection_error(
            f"{param} \"none\" is not an allowed_tools mode; use \"auto\" or \"required\", or send "
            "tool_choice \"none\" to disable tool calls.", "invalid_mode", param)
    if mode not in _MODES:
        raise _selection_error(
            f"{param} must be \"auto\" or \"required\", got {_quote(mode)}.", "invalid_mode", param)
    return mode


def _selection_entries(container: Mapping[str, Any], prefix: str) -> list[Any]:
    param = f"{prefix}.tools"
    entries = container.get("tools")
    if entries is None or (isinstance(entries, list) and not entries):
        raise _selection_error(
            f"{param} is empty: allowed_tools must select at least one function from `tools` "
            "(an empty selection is never widened to the whole catalog). Select the functions "
            "the model may call, or send tool_choice \"none\" to disable tool calls.",
            "empty_subset", param)
    if not isinstance(entries, list):
        raise _selection_error(f"{param} must be an array of selectors, got "
                               f"{_type_name(entries)}.", "malformed", param)
    return entries


def _selector_name(entry: Any, api: Api, param: str) -> tuple[str, str | None, str]:
    """(name, namespace, param of the name) of one selector entry; raises on non-function/malformed."""
    expected = _RESPONSES_ENTRY if api == "responses" else _CHAT_ENTRY
    if not isinstance(entry, Mapping):
        raise _selection_error(f"{param} must be an object like {expected}, got "
                               f"{_type_name(entry)}.", "malformed", param)
    entry_type = entry.get("type")
    if entry_type is None:
        raise _selection_error(f"{param}.type is missing: each selector must look like {expected}.",
                               "malformed", f"{param}.type")
    if not isinstance(entry_type, str):
        raise _selection_error(f"{param}.type must be the string \"function\", got "
                               f"{_type_name(entry_type)}.", "malformed", f"{param}.type")
    if entry_type != "function":
        extra = (" To select namespace members, list each member by its flat name "
                 "`<namespace>__<name>`." if entry_type == "namespace" else "")
        raise _selection_error(
            f"{param}.type {_quote(entry_type)} cannot be selected: only function tools can be "
            "selected in allowed_tools (hosted, MCP, custom and other non-function tools are not "
            f"supported here). Remove the entry or select function tools as {expected}.{extra}",
            "non_function_selector", f"{param}.type")
    if api == "responses":
        name, name_param = entry.get("name", _ABSENT), f"{param}.name"
        if "name" not in entry and isinstance(entry.get("function"), Mapping):
            raise _selection_error(
                f"{name_param} is missing: the Responses API selects functions as {expected}; "
                "{\"function\": {\"name\": ...}} is the Chat Completions shape.",
                "malformed", name_param)
        namespace = entry.get("namespace")
        if namespace is not None and not _is_name(namespace):
            raise _selection_error(f"{param}.namespace must be a non-empty string or absent, got "
                                   f"{_type_name(namespace)}.", "malformed", f"{param}.namespace")
    else:
        function = entry.get("function", _ABSENT)
        namespace = None
        if not isinstance(function, Mapping):
            hint = ("; {\"type\": \"function\", \"name\": ...} is the Responses API shape"
                    if "name" in entry else "")
            raise _selection_error(f"{param}.function must be an object, got "
                                   f"{_type_name(function)}: Chat Completions selects functions as "
                                   f"{expected}{hint}.", "malformed", f"{param}.function")
        name, name_param = function.get("name", _ABSENT), f"{param}.function.name"
    if not _is_name(name):
        raise _selection_error(f"{name_param} must be a non-empty string naming a function in "
                               f"`tools`, got {_type_name(name)}.", "malformed", name_param)
    return name, namespace, name_param


def _unknown_message(name: str, namespace: str | None, param: str, resolver: _Resolver,
                     catalog: _Catalog) -> str:
    known = resolver.flat_names()
    what = (f"{_quote(name)} in namespace {_quote(namespace)}" if namespace is not None
            else _quote(name))
    message = (f"{param} {what} is not a function in `tools`; the function tools are: "
               f"{_names_list(known)}.")
    other_type = catalog.other_tools.get(name if namespace is None
                                         else flat_name(name, namespace))
    if other_type is not None:
        message += (f" {_quote(name)} is a {other_type!s} tool, and only function tools can be "
                    "selected in allowed_tools.")
    else:
        target = name if namespace is None else flat_name(name, namespace)
        close = difflib.get_close_matches(target, known, n=1)
        if close:
            message += f" Did you mean {_quote(close[0])}?"
    return message + " Add it to `tools` or remove it from the selection."


def _resolve_allowed(body: Mapping[str, Any], api: Api, choice: Mapping[str, Any]) -> TurnAllowlist:
    container, prefix = _selection_container(choice, api)
    mode = _selection_mode(container, prefix)
    entries = _selection_entries(container, prefix)

    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise InvalidSelectionError(
            f"parallel_tool_calls must be true or false, got {_type_name(parallel)}.",
            reason="malformed", param="parallel_tool_calls", code=CODE_INVALID_PARALLEL_TOOL_CALLS)

    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _malformed("tools", f"tools must be an array of tool definitions, got "
                                  f"{_type_name(tools)}.")
    catalog = _parse_catalog(tools or [], api)
    catalog.check_for_allowlist()

    resolver = catalog.resolver
    allowed: set[ToolIdentity] = set()
    for i, entry in enumerate(entries):
        name, namespace, name_param = _selector_name(entry, api, f"{prefix}.tools[{i}]")
        found = resolver.resolve(name, namespace)
        if found.identity is not None:
            allowed.add(found.identity)
            continue
        if found.candidates:
            raise _selection_error(
                f"{name_param} {_quote(name)} is ambiguous: it names a function in several "
                f"namespaces ({', '.join(found.candidates)}). Select one by its flat name "
                f"`<namespace>__<name>` (for example {_quote(found.candidates[0])})"
                + (", or add \"namespace\" to the entry." if api == "responses" else "."),
                "ambiguous_name", name_param)
        raise _selection_error(_unknown_message(name, namespace, name_param, resolver, catalog),
                               "unknown_function", name_param)

    return _policy(api, catalog, "allowed", mode, frozenset(allowed), parallel, _copy_json(choice))


# --------------------------------------------------------------------------------------------------
# plain choices (described, never rejected)


def _named_function(choice: Mapping[str, Any], api: Api) -> tuple[str, str | None] | None:
    if api == "responses":
        name, namespace = choice.get("name"), choice.get("namespace")
    else:
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        namespace = None
    if not _is_name(name) or (namespace is not None and not _is_name(namespace)):
        return None
    return name, namespace


def _copy_json(value: Any) -> Any:
    """A private copy of a client value (a JSON round trip is much faster than deepcopy)."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return copy.deepcopy(value)


def _policy(api: Api, catalog: _Catalog, choice: Choice, mode: Mode | None,
            allowed: frozenset[ToolIdentity] | None, parallel: bool, original: Any) -> TurnAllowlist:
    return TurnAllowlist(api=api, catalog=catalog.specs, choice=choice, mode=mode, allowed=allowed,
                      parallel_tool_calls=parallel, catalog_digest=catalog.digest,
                      allowlist_digest=allowlist_digest(choice, mode, allowed, parallel),
                      original_tool_choice=original, _by_flat=catalog.by_flat)


def _resolve_plain(body: Mapping[str, Any], api: Api, tool_choice: Any) -> TurnAllowlist | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        # never "not ours, no policy": vLLM may still read it (see typed_fields)
        raise _malformed("tools", f"`tools` must be an array of tools, got {_type_name(tools)}.")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise _malformed("parallel_tool_calls", "`parallel_tool_calls` must be a boolean, got "
                         f"{_type_name(parallel)}.", code=CODE_INVALID_PARALLEL_TOOL_CALLS)
    catalog = _parse_catalog(tools or [], api)
    if catalog.collision is not None:
        # never "the first by digest order": that would revive a grant made for the other one
        template = catalog.collision
        raise InvalidSelectionError(template.message, reason=template.reason,
                                    param=template.param, code=template.code)

    if tool_choice is None:
        # vLLM's default: "auto" whenever `tools` is non-empty (even if it holds no function).
        return _policy(api, catalog, "auto", "auto", None, parallel, None)
    if isinstance(tool_choice, str):
        if tool_choice not in _PLAIN_CHOICES:
            return None
        mode: Mode | None = None if tool_choice == "none" else tool_choice  # type: ignore[assignment]
        return _policy(api, catalog, tool_choice, mode, None, parallel, tool_choice)  # type: ignore[arg-type]
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        named = _named_function(tool_choice, api)
        if named is None:
            return None
        found = catalog.resolver.resolve(*named)
        if found.identity is None:
            return None  # unknown or ambiguous: vanilla vLLM answers with its own error
        return _policy(api, catalog, "named", None, frozenset({found.identity}), parallel,
                       _copy_json(tool_choice))
    return None  # hosted, MCP, custom or unknown choice types: not ours to model


# --------------------------------------------------------------------------------------------------
# entry points


def resolve_allowlist(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    """Resolve a request body (``/v1/responses`` or ``/v1/chat/completions`` JSON) to its policy.

    Returns None when there is nothing to do: no tools and no tool_choice, or a plain request
    vanilla vLLM must judge on its own (hosted/custom choices, an unresolvable named function, shapes
    vLLM will reject). Raises :class:`InvalidSelectionError` (HTTP 400) only for ``allowed_tools``
    requests, after counting it once in ``vllm_allowed_tools:invalid_selections``.
    """
    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")
    try:
        return _resolve(body, api)
    except InvalidSelectionError as exc:
        record_invalid_selection(exc.reason)
        raise


def _resolve(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    tool_choice = body.get("tool_choice")
    tools = body.get("tools")
    if tool_choice is None and not tools:
        return None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "allowed_tools":
        return _resolve_allowed(body, api, tool_choice)
    return _resolve_plain(body, api, tool_choice)


def resolve_callable_catalog(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    """What this turn may call, for code that must never read "unresolved" as "nothing to check"
    (the approvals): the resolved policy, or, for a choice this module leaves to vLLM (hosted,
    custom, an unresolvable name), the whole function catalog in ``auto`` mode. None only without
    tools."""
    policy = resolve_allowlist(body, api)
    if policy is not None or not body.get("tools"):
        return policy
    catalog = _parse_catalog(body["tools"], api)
    parallel = body.get("parallel_tool_calls")
    return _policy(api, catalog, "auto", "auto", None, parallel is not False,
                   _copy_json(body.get("tool_choice")))


def catalog_digest(tools: Sequence[Mapping[str, Any]], api: Api) -> str:
    """Digest of the function catalog of ``tools`` (same as ``TurnAllowlist.catalog_digest``).

    Permissive: entries vanilla vLLM would reject are skipped rather than raised on. Independent of
    tool order, JSON key order and ``strict``; changes with any name, description or parameters.
    """
    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")
    return _parse_catalog(list(tools or []), api).digest
