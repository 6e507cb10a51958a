"""Which tools a request offers and which call an output item or message makes, by flat name.

A call is identified by the name the model sees and emits (:func:`~..request.flat_name`), so the
request side and the guard agree, namespaces included.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..call_filter import CallFilter, CallKind
from ..request import flat_name


def request_tools(body: Mapping[str, Any], api: str) -> Iterator[tuple[str, str, str | None, str]]:
    """(param, kind, namespace, name) of each named function or custom tool a request body offers
    (``kind``: ``"function"`` or ``"custom"``; Chat's nested shape, Responses' flat one and its
    namespace members); entries it cannot read are skipped."""
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, Mapping):
            continue
        kind, param = tool.get("type"), f"tools[{index}]"
        if api == "chat":
            fn = tool.get("function") if kind == "function" else tool.get("custom")
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                yield param, "function" if kind == "function" else "custom", None, fn["name"]
        elif kind in ("function", "custom") and isinstance(tool.get("name"), str):
            yield param, kind, None, tool["name"]
        elif kind == "namespace" and isinstance(tool.get("name"), str):
            members = tool.get("tools")
            for j, member in enumerate(members if isinstance(members, list) else ()):
                if isinstance(member, Mapping) and isinstance(member.get("name"), str):
                    member_kind = "custom" if member.get("type") == "custom" else "function"
                    yield f"{param}.tools[{j}]", member_kind, tool["name"], member["name"]


#: Responses output items of built-in tools (run by the server, e.g. gpt-oss's browser and python on
#: vLLM's harmony path), and the request tool types that offer each
BUILTIN_CALLS: dict[str, frozenset[str]] = {
    "web_search_call": frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11",
                                  "web_search_2025_08_26"}),
    "code_interpreter_call": frozenset({"code_interpreter"}),
    "file_search_call": frozenset({"file_search"}),
    "computer_call": frozenset({"computer_use_preview", "computer"}),
    "image_generation_call": frozenset({"image_generation"}),
    "local_shell_call": frozenset({"local_shell"}),
    "mcp_call": frozenset({"mcp"}),
}


class AllowedNames(CallFilter):
    """"Catalog only": every catalog function (flat name) may be called, anything else may not.

    For plain requests (``auto`` / ``required`` / named without ``allowed_tools``): the guard still
    stops calls to names that are not in the request at all. ``custom_names`` are the request's
    ``custom`` tools (Responses ``custom_tool_call`` items, Chat custom calls).
    """

    __slots__ = ("catalog", "custom_names", "builtin_types")

    def __init__(self, names: Iterable[str], custom_names: Iterable[str] = (),
                 builtin_types: Iterable[str] = ()) -> None:
        self.catalog = frozenset(names)
        self.custom_names = frozenset(custom_names)
        self.builtin_types = frozenset(builtin_types)

    def allows(self, kind: CallKind, name: str | None) -> bool:
        """A function or custom tool the request offers; a built-in tool's call (``name``: its
        item type, ``web_search_call``, ...) only where the request offered that tool."""
        if name is None:
            return False
        if kind == "function":
            return name in self.catalog
        if kind == "custom":
            return name in self.custom_names
        return bool(BUILTIN_CALLS.get(name, frozenset()) & self.builtin_types)

    def knows(self, kind: CallKind, name: str) -> bool | None:
        return name in self.catalog if kind == "function" else None

    def is_allowed(self, flat_name: str | None) -> bool:
        return self.allows("function", flat_name)

    @classmethod
    def from_request(cls, body: Mapping[str, Any], api: str) -> AllowedNames:
        """The catalog of a request body (``api``: ``"chat"`` or ``"responses"``); permissive:
        entries it cannot read are skipped (vLLM rejects malformed tools itself)."""
        names: list[str] = []
        custom: list[str] = []
        for _, kind, namespace, name in request_tools(body, api):
            (custom if kind == "custom" else names).append(flat_name(name, namespace))
        tools = body.get("tools")
        builtin = [tool.get("type") for tool in tools if isinstance(tool, Mapping)] \
            if isinstance(tools, list) and api == "responses" else []
        return cls(names, custom, [kind for kind in builtin if isinstance(kind, str)])

    def __repr__(self) -> str:
        return f"AllowedNames({sorted(self.catalog)!r}, custom={sorted(self.custom_names)!r})"


def item_identity(item: Mapping[str, Any]) -> tuple[str, str | None] | None:
    """(kind, flat name) of a Responses output item that is a model tool call, else None; a
    built-in tool's call is ``("builtin", <item type>)``."""
    kind = item.get("type")
    if kind == "function_call":
        return "function", flat_name(item.get("name"), item.get("namespace"))
    if kind == "custom_tool_call":
        return "custom", flat_name(item.get("name"), item.get("namespace"))
    if kind in BUILTIN_CALLS:
        return "builtin", kind
    return None


def chat_call_identity(call: Any) -> tuple[str, str | None]:
    """(kind, name) of one entry of a Chat message's ``tool_calls``."""
    if not isinstance(call, Mapping):
        return "function", None
    if call.get("type") == "custom" or ("custom" in call and "function" not in call):
        custom = call.get("custom")
        return "custom", flat_name(custom.get("name")) if isinstance(custom, Mapping) else None
    fn = call.get("function")
    return "function", flat_name(fn.get("name")) if isinstance(fn, Mapping) else None
