"""The turn's allowlist as it rides in the request body (:data:`ALLOWLIST_KEY`): written by the
middleware (:func:`allowlist_to_wire`), read back by our parser wrappers inside vLLM
(:class:`WireAllowlist`), with the version of its shape (:data:`WIRE_VERSION`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..call_filter import CallFilter, CallKind

#: the body key under which the turn's allowlist travels to our parsers (``request.model_extra``)
ALLOWLIST_KEY = "vllm_allowed_tools"
WIRE_VERSION = 1


class _CatalogTool(Protocol):
    """What :func:`allowlist_to_wire` reads of one catalog tool (``request.identity.FunctionSpec``)."""

    @property
    def flat_name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def grammar(self) -> tuple[str, str] | None: ...


class TurnPolicy(Protocol):
    """What :func:`allowlist_to_wire` reads of a turn's allowlist (``request.TurnAllowlist``)."""

    @property
    def api(self) -> str: ...
    @property
    def choice(self) -> str: ...
    @property
    def mode(self) -> str | None: ...
    @property
    def catalog(self) -> Sequence[_CatalogTool]: ...
    @property
    def allowed_flat_names(self) -> Sequence[str]: ...
    @property
    def parallel_tool_calls(self) -> bool: ...
    @property
    def catalog_digest(self) -> str: ...
    @property
    def allowlist_digest(self) -> str: ...


def allowlist_to_wire(allowlist: TurnPolicy) -> dict[str, Any]:
    """The allowlist as plain JSON, small enough to ride on every request."""
    return {
        "v": WIRE_VERSION,
        "api": allowlist.api,
        "choice": allowlist.choice,
        "mode": allowlist.mode,
        "allowed": sorted(allowlist.allowed_flat_names),
        "catalog": sorted(spec.flat_name for spec in allowlist.catalog),
        "parallel_tool_calls": allowlist.parallel_tool_calls,
        "catalog_digest": allowlist.catalog_digest,
        "allowlist_digest": allowlist.allowlist_digest,
        # the catalog's custom tools: their grammar (syntax, definition), or None for free text
        "custom": {spec.flat_name: list(spec.grammar) if spec.grammar is not None else None
                   for spec in allowlist.catalog if spec.kind == "custom"},
    }


def no_function_wire(mode: str, catalog: Iterable[str], parallel_tool_calls: bool) -> dict[str, Any]:
    """A Responses allowlist that admits no function (a turn whose server-side recipients
    :func:`with_server_recipients` adds): ``catalog`` names the request's functions, so a call of
    one is refused as not allowed this turn."""
    return {"v": WIRE_VERSION, "api": "responses", "choice": "allowed", "mode": mode, "allowed": [],
            "catalog": sorted(catalog), "parallel_tool_calls": parallel_tool_calls,
            "catalog_digest": "", "allowlist_digest": "", "custom": {}}


def with_server_recipients(wire: Mapping[str, Any],
                           recipients: Iterable[Sequence[str | None]]) -> dict[str, Any]:
    """``wire`` admitting the server-side recipients ``(built-in, tool name or None for any)``."""
    return {**wire, "server": [list(recipient) for recipient in recipients]}


@dataclass(frozen=True)
class WireAllowlist(CallFilter):
    """What the vLLM-side code (parsers, guard) needs to know about a turn's allowlist."""
    mode: str
    allowed: frozenset[str]
    catalog: frozenset[str]
    parallel_tool_calls: bool
    catalog_digest: str
    allowlist_digest: str
    #: the catalog's custom tools by name: (syntax, definition) of a grammar, None for free text
    custom: Mapping[str, tuple[str, str] | None] = field(default_factory=dict, hash=False)
    #: the server-side recipients this turn may write: (built-in, tool name or None for any of its
    #: tools) (``vllm_allowed_tools.server_tools``); empty: none
    server: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def from_wire(cls, data: Any) -> WireAllowlist | None:
        if not isinstance(data, Mapping) or data.get("v") != WIRE_VERSION:
            return None
        custom = data.get("custom") or {}
        return cls(mode=str(data["mode"]), allowed=frozenset(data["allowed"]),
                   catalog=frozenset(data["catalog"]),
                   parallel_tool_calls=bool(data["parallel_tool_calls"]),
                   catalog_digest=str(data["catalog_digest"]),
                   allowlist_digest=str(data["allowlist_digest"]),
                   custom={str(name): (str(grammar[0]), str(grammar[1])) if grammar else None
                           for name, grammar in custom.items()},
                   server=tuple((str(b), None if n is None else str(n))
                                for b, n in data.get("server") or ()))

    def is_allowed(self, flat_name: str | None) -> bool:
        return flat_name is not None and flat_name in self.allowed

    def allows(self, kind: CallKind, name: str | None) -> bool:
        """The allowlist's functions and custom tools, each only as its own kind."""
        return kind != "builtin" and self.is_allowed(name) and (kind == "custom") == (name in self.custom)

    def knows(self, kind: CallKind, name: str) -> bool | None:
        if kind == "builtin":
            return None
        return name in self.catalog and (kind == "custom") == (name in self.custom)
