"""The fixed pool of tools the tiny models know, and generators of catalogs and calls over it.

The tool-happy model memorises these names (a tiny model learns names, it does not learn to copy new
ones), so tests must draw their catalogs from this pool. Every argument is an enum, so a schema-valid
call is easy to check and a strict grammar leaves random weights little room.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

_VERBS = ["get", "list", "create", "delete", "update", "search", "read", "send"]
_NOUNS = ["weather", "file", "issue", "email", "calendar", "user", "order", "note",
          "ticket", "invoice", "photo", "contact"]
_VALUES = {
    "city": ["paris", "tokyo", "lima", "oslo", "cairo"],
    "unit": ["c", "f"],
    "path": ["readme", "notes", "main", "todo"],
    "user": ["alice", "bob", "carol", "dave"],
    "priority": ["low", "high"],
    "topic": ["billing", "travel", "music", "sports"],
    "day": ["monday", "friday", "sunday"],
}


@dataclass(frozen=True)
class PoolTool:
    name: str
    description: str
    arguments: tuple[str, ...]   # argument names, each an enum over _VALUES[name]

    @property
    def parameters(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {arg: {"type": "string", "enum": list(_VALUES[arg])} for arg in self.arguments},
            "required": list(self.arguments),
            "additionalProperties": False,
        }

    def chat_tool(self, strict: bool = True) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters, "strict": strict}}

    def responses_tool(self, strict: bool = True) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": strict}

    def random_arguments(self, rng: random.Random) -> dict[str, str]:
        return {arg: rng.choice(_VALUES[arg]) for arg in self.arguments}

    def arguments_valid(self, arguments: str | dict) -> bool:
        """True when `arguments` (JSON text or object) satisfies this tool's schema."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return False
        return (isinstance(arguments, dict) and set(arguments) == set(self.arguments)
                and all(arguments[arg] in _VALUES[arg] for arg in self.arguments))


def _build_pool() -> tuple[PoolTool, ...]:
    rng = random.Random(1234)
    arg_names = sorted(_VALUES)
    combos = [(verb, noun) for noun in _NOUNS for verb in _VERBS]
    chosen = sorted(rng.sample(range(len(combos)), 40))   # 40 of the 96 names, deterministically
    tools = []
    for index in chosen:
        verb, noun = combos[index]
        tools.append(PoolTool(name=f"{verb}_{noun}", description=f"{verb.capitalize()} a {noun}.",
                              arguments=tuple(sorted(rng.sample(arg_names, rng.choice([1, 2]))))))
    return tuple(tools)


POOL: tuple[PoolTool, ...] = _build_pool()
POOL_BY_NAME: dict[str, PoolTool] = {tool.name: tool for tool in POOL}


def sample_catalog(rng: random.Random, size: int = 8) -> list[PoolTool]:
    return rng.sample(list(POOL), size)
