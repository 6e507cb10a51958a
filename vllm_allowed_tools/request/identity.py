"""How a tool the model calls is named: its canonical identity, the flat name the model sees, and
the digest of its definition, shared by the allowlist, the guard, the approvals and the dispatcher.

A ``custom`` tool (Responses, or Chat Completions through the plugin) is a spec too (kind ``custom``): vLLM shows it to the model as a function
with one string field ``input``, so it shares the functions' names, grammar and prompt order."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .digest import value_digest

__all__ = ["CUSTOM_INPUT_KEY", "NAMESPACE_SEPARATOR", "FunctionSpec", "ToolIdentity", "ToolKind",
           "custom_digest", "custom_parameters", "flat_name", "function_digest"]

#: what a catalog entry is: a function tool, or a ``custom`` tool (free-form input)
ToolKind = Literal["function", "custom"]
#: the one field of the function vLLM shows a custom tool as (``vllm.tool_parsers.utils``)
CUSTOM_INPUT_KEY = "input"

# vLLM flattens a Responses namespace member to ``namespace__name`` before the template renders it.
NAMESPACE_SEPARATOR = "__"


def flat_name(name: Any, namespace: Any = None) -> str | None:
    """The name the model sees and emits: ``name``, or ``namespace__name`` for a namespace member.

    None when ``name`` is not a non-empty string, so a malformed call never matches a real tool."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(namespace, str) and namespace:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    return name


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
    """One validated function (or custom tool) definition of the catalog.

    ``digest`` binds identity, description and parameters (RFC 8785), so approvals and grammar
    caches can tell definitions apart; ``strict`` is per-request noise and not part of it.
    ``parameters`` is shared by every request with the same catalog (catalogs are cached), so treat
    it as read-only. A ``custom`` spec (:meth:`custom`) has the parameters vLLM serves it with and
    ``grammar`` ``(syntax, definition)`` when its input has one (None: free-form text); its digest
    binds the grammar, so a grammar cache keyed on the catalog never serves another grammar.
    """

    identity: ToolIdentity
    description: str | None
    parameters: dict[str, Any] = field(hash=False)
    strict: bool | None
    digest: str
    kind: ToolKind = "function"
    grammar: tuple[str, str] | None = None

    @classmethod
    def build(cls, identity: ToolIdentity, description: str | None,
              parameters: Mapping[str, Any] | None, strict: bool | None = None) -> FunctionSpec:
        """A spec with its digest computed; missing parameters become an empty object schema."""
        params = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(params, dict):
            params = dict(params)
        return cls(identity=identity, description=description, parameters=params, strict=strict,
                   digest=function_digest(identity, description, params))

    @classmethod
    def custom(cls, name: str, description: str | None,
               grammar: tuple[str, str] | None = None) -> FunctionSpec:
        """A Responses ``custom`` tool (top level: vLLM renders no namespaced custom tool)."""
        return cls(identity=ToolIdentity(None, name), description=description,
                   parameters=custom_parameters(), strict=None,
                   digest=custom_digest(name, description, grammar), kind="custom", grammar=grammar)

    @property
    def flat_name(self) -> str:
        return self.identity.flat_name

    def sort_key(self) -> tuple[tuple[str, bool, str, str], str]:
        """The canonical catalog order: by identity, then by definition."""
        return (self.identity.sort_key(), self.digest)

    def chat_tool(self) -> dict[str, Any]:
        """The definition in Chat Completions shape under its flat name (what templates render)."""
        function: dict[str, Any] = {"name": self.flat_name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def function_digest(identity: ToolIdentity, description: str | None,
                    parameters: Mapping[str, Any]) -> str:
    """Hex SHA-256 of the RFC 8785 JSON of the object ``{"namespace", "name", "description",
    "parameters"}`` (a top-level function's namespace and a missing description are null): the
    tool definition digest approvals publish (``docs/approvals.md``, "Digests")."""
    return value_digest({"namespace": identity.namespace, "name": identity.name,
                         "description": description, "parameters": parameters})


def custom_parameters() -> dict[str, Any]:
    """The arguments vLLM 0.32 shows a custom tool with: one string ``input``, nothing else."""
    return {"type": "object", "properties": {CUSTOM_INPUT_KEY: {"type": "string"}},
            "required": [CUSTOM_INPUT_KEY], "additionalProperties": False}


def custom_digest(name: str, description: str | None, grammar: tuple[str, str] | None) -> str:
    """Hex SHA-256 of the RFC 8785 JSON of ``{"type": "custom", "name", "description", "format"}``
    (``format`` as a Responses custom tool writes it): never equal to a function's digest."""
    fmt = {"type": "text"} if grammar is None else \
        {"type": "grammar", "syntax": grammar[0], "definition": grammar[1]}
    return value_digest({"type": "custom", "name": name, "description": description, "format": fmt})
