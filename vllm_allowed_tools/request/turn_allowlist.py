"""The turn's allowlist, and the one resolver both APIs use to get it from a request body.

``allowed_tools`` requests fail closed here, before dispatch; plain choices are only described,
never refused, because vanilla vLLM judges them. The contract is in ``docs/request-path.md``."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..call_filter import CallFilter, CallKind
from ..errors import CODE_INVALID_PARALLEL_TOOL_CALLS, InvalidSelectionError, malformed, type_name
from ..metrics import record_invalid_selection
from ..wire import Mode, ToolChoice, tool_choice_of
from .catalog import Api, Catalog, index_by_flat_name, parse_catalog, specs_digest
from .identity import FunctionSpec, ToolIdentity
from .digest import value_digest
from .json_text import copy_json
from .selection import read_selection, resolve_chat_custom_choice

__all__ = ["Choice", "TurnAllowlist", "allowlist_digest", "resolve_allowlist",
           "resolve_callable_catalog"]

Choice = Literal["none", "auto", "required", "named", "allowed"]

_PLAIN_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class TurnAllowlist(CallFilter):
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
            by_flat = index_by_flat_name(self.catalog)
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
        """An allowlist with canonical catalog order and both digests computed (tests and glue)."""
        ordered = tuple(sorted(catalog, key=FunctionSpec.sort_key))
        return cls(api=api, catalog=ordered, choice=choice, mode=mode, allowed=allowed,
                   parallel_tool_calls=parallel_tool_calls,
                   catalog_digest=specs_digest(ordered),
                   allowlist_digest=allowlist_digest(choice, mode, allowed, parallel_tool_calls),
                   original_tool_choice=original_tool_choice)

    def lookup(self, flat_name: str) -> FunctionSpec | None:
        """The catalog function the model means by ``flat_name`` (exact match, never split)."""
        return self._by_flat.get(flat_name)  # type: ignore[union-attr]

    def allows(self, kind: CallKind, name: str | None) -> bool:
        """Functions and custom tools per :meth:`is_allowed`, each only as its own kind (a custom
        tool's name never lets a function call out, nor the reverse); built-in tools never: an
        allowlist names functions and custom tools only (the selection refuses any other entry)."""
        if kind == "builtin" or name is None:
            return False
        spec = self.lookup(name)
        return spec is not None and spec.kind == kind and self.is_allowed(name)

    def knows(self, kind: CallKind, name: str) -> bool | None:
        if kind == "builtin":
            return None
        spec = self.lookup(name)
        return spec is not None and spec.kind == kind

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
    return value_digest({"choice": choice, "mode": mode, "allowed": identities,
                         "parallel_tool_calls": bool(parallel_tool_calls)})


def _turn_allowlist(api: Api, catalog: Catalog, choice: Choice, mode: Mode | None,
                    allowed: frozenset[ToolIdentity] | None, parallel: bool,
                    original: Any) -> TurnAllowlist:
    return TurnAllowlist(api=api, catalog=catalog.specs, choice=choice, mode=mode, allowed=allowed,
                         parallel_tool_calls=parallel, catalog_digest=catalog.digest,
                         allowlist_digest=allowlist_digest(choice, mode, allowed, parallel),
                         original_tool_choice=original, _by_flat=catalog.by_flat)


# --------------------------------------------------------------------------------------------------
# entry points


def resolve_allowlist(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    """Resolve a request body (``/v1/responses`` or ``/v1/chat/completions`` JSON) to its allowlist.

    Returns None when there is nothing to do: no tools and no tool_choice, or a plain request
    vanilla vLLM must judge on its own (hosted choices, an unresolvable name, shapes vLLM will
    reject). Raises :class:`InvalidSelectionError` (HTTP 400) only for ``allowed_tools`` requests
    and Chat named custom choices (a shape vLLM refuses), after counting it once in
    ``vllm_allowed_tools:invalid_selections``.
    """
    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")
    try:
        return _resolve(body, api)
    except InvalidSelectionError as exc:
        record_invalid_selection(exc.reason)
        raise


def resolve_callable_catalog(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    """What this turn may call, for code that must never read "unresolved" as "nothing to check"
    (the approvals): the resolved allowlist, or, for a choice this module leaves to vLLM (hosted,
    custom, an unresolvable name), the whole function catalog in ``auto`` mode. None only without
    tools."""
    allowlist = resolve_allowlist(body, api)
    if allowlist is not None or not body.get("tools"):
        return allowlist
    catalog = parse_catalog(body["tools"], api)
    parallel = body.get("parallel_tool_calls")
    return _turn_allowlist(api, catalog, "auto", "auto", None, parallel is not False,
                           copy_json(tool_choice_of(body, api).raw))


def _resolve(body: Mapping[str, Any], api: Api) -> TurnAllowlist | None:
    choice = tool_choice_of(body, api)
    tools = body.get("tools")
    if choice.absent and not tools:
        return None
    if choice.allowed is not None:
        return _resolve_allowed(body, api, choice)
    return _resolve_plain(body, api, choice)


# --------------------------------------------------------------------------------------------------
# allowed_tools (refused when unsound)


def _resolve_allowed(body: Mapping[str, Any], api: Api, choice: ToolChoice) -> TurnAllowlist:
    assert choice.allowed is not None
    selection = read_selection(choice.allowed, api)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise InvalidSelectionError(
            f"parallel_tool_calls must be true or false, got {type_name(parallel)}.",
            reason="malformed", param="parallel_tool_calls", code=CODE_INVALID_PARALLEL_TOOL_CALLS)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise malformed("tools", f"tools must be an array of tool definitions, got "
                                 f"{type_name(tools)}.")
    catalog = parse_catalog(tools or [], api)
    catalog.check_for_allowlist()
    allowed = selection.resolve(catalog)
    return _turn_allowlist(api, catalog, "allowed", selection.mode, allowed, parallel,
                           copy_json(choice.raw))


# --------------------------------------------------------------------------------------------------
# plain choices (described, never rejected)


def _resolve_plain(body: Mapping[str, Any], api: Api, choice: ToolChoice) -> TurnAllowlist | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        # never "not ours, no allowlist": vLLM may still read it (see typed_fields)
        raise malformed("tools", f"`tools` must be an array of tools, got {type_name(tools)}.")
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    elif not isinstance(parallel, bool):
        raise malformed("parallel_tool_calls", "`parallel_tool_calls` must be a boolean, got "
                        f"{type_name(parallel)}.", code=CODE_INVALID_PARALLEL_TOOL_CALLS)
    catalog = parse_catalog(tools or [], api)
    # never "the first by digest order": that would revive a grant made for the other one
    catalog.raise_collision()

    if choice.absent:
        # vLLM's default: "auto" whenever `tools` is non-empty (even if it holds no function).
        return _turn_allowlist(api, catalog, "auto", "auto", None, parallel, None)
    if choice.string is not None:
        if choice.string not in _PLAIN_CHOICES:
            return None
        mode: Mode | None = None if choice.string == "none" else choice.string  # type: ignore[assignment]
        return _turn_allowlist(api, catalog, choice.string, mode, None, parallel,  # type: ignore[arg-type]
                               choice.string)
    named = choice.named
    if named is None or named.type not in ("function", "custom"):
        return None  # hosted, MCP or unknown choice types: not ours to model
    if named.type == "custom" and api == "chat":   # vLLM refuses the shape: judged here, a 400 if unsound
        identity = resolve_chat_custom_choice(named, catalog)
        return _turn_allowlist(api, catalog, "named", None, frozenset({identity}), parallel,
                               copy_json(choice.raw))
    name = named.name_and_namespace()
    if name is None:
        return None
    found = catalog.resolver.resolve(*name)
    spec = catalog.by_flat.get(found.identity.flat_name) if found.identity is not None else None
    if spec is None or spec.identity != found.identity or spec.kind != named.type:
        return None  # unknown, ambiguous or of the other kind: vanilla vLLM answers
    return _turn_allowlist(api, catalog, "named", None, frozenset({found.identity}), parallel,
                           copy_json(choice.raw))
