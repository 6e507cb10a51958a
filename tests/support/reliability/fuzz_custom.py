"""The fuzz generator's custom tools: OpenAI ``custom`` tools (grammar and text formats) a catalog
may carry, the ones broken on purpose, and their selectors in each API's shape."""

from __future__ import annotations

from typing import Any

#: custom tools a catalog may carry (grammar and text formats), each by its name
CUSTOM_FORMATS = {
    "decide": {"type": "grammar", "syntax": "lark", "definition": 'start: "yes" | "no" | "later"'},
    "word": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{1,8}"},
    "patch": {"type": "grammar", "syntax": "lark", "definition": (
        'start: "*** Begin Patch" LF "*** Add File: " NAME LF ("+" TEXT LF)+ "*** End Patch"\n'
        'NAME: /[a-z]{1,8}\\.txt/\nTEXT: /[a-z "\\\\]{0,12}/\n%import common.LF\n')},
    "note": {"type": "text"},
}
#: the endpoints whose catalogs get custom tools
CUSTOM_TOOL_APIS = ("responses", "chat")
#: custom tools broken on purpose: a grammar that does not compile (lookahead, unbalanced Lark, a
#: backreference) or a malformed ``format``
CUSTOM_FAULTS = {
    "lookahead": {"type": "grammar", "syntax": "regex", "definition": "(?=a)a+"},
    "backreference": {"type": "grammar", "syntax": "regex", "definition": "(a)\\1"},
    "unbalanced_lark": {"type": "grammar", "syntax": "lark", "definition": 'start: ("a"'},
    "unknown_syntax": {"type": "grammar", "syntax": "pcre", "definition": "a"},
    "definition_missing": {"type": "grammar", "syntax": "lark"},
    "definition_not_string": {"type": "grammar", "syntax": "lark", "definition": 5},
    "format_type_bogus": {"type": "bogus"},
    "format_not_object": "text",
}


class CustomName(str):
    """A selectable name that is a custom tool's (selected by a ``custom`` entry)."""


def custom_tool(api: str, name: str, fmt: Any) -> dict[str, Any]:
    """A ``custom`` tool in ``api``'s shape (Chat nests it under ``custom``, as it does functions)."""
    inner = {"name": name, "description": f"The {name} tool.", "format": fmt}
    return {"type": "custom", "custom": inner} if api == "chat" else {"type": "custom", **inner}


def custom_selector(api: str, name: Any) -> dict[str, Any]:
    return {"type": "custom", "custom": {"name": name}} if api == "chat" else \
        {"type": "custom", "name": name}
