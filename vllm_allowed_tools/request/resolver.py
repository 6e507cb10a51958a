"""Which catalog function a selector name means: the top-level function of that name, else the
namespace member with that flat name, else the one member with that bare name. A flat name is never
split on ``__`` (real names contain it)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .identity import FunctionSpec, ToolIdentity

__all__ = ["Found", "NameResolver"]


@dataclass
class Found:
    identity: ToolIdentity | None = None
    candidates: tuple[str, ...] = ()  # flat names, when ambiguous


class NameResolver:
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

    def resolve(self, name: str, namespace: str | None = None) -> Found:
        if namespace is not None:
            identity = ToolIdentity(namespace, name)
            return Found(identity if identity in self.identities else None)
        if name in self.top_level:
            return Found(self.top_level[name])
        if name in self.flat:
            return Found(self.flat[name])
        members = self.bare.get(name, [])
        if len(members) == 1:
            return Found(members[0])
        if len(members) > 1:
            return Found(None, tuple(sorted(i.flat_name for i in members)))
        return Found()

    def flat_names(self) -> list[str]:
        return sorted(i.flat_name for i in self.identities)
