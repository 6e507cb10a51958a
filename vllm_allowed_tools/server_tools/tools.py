"""The server-side tools of a Responses request, read as vLLM's harmony loop runs them.

vLLM 0.32/0.33 runs three built-ins itself on ``/v1/responses`` for gpt-oss: ``browser`` (enabled by
a ``web_search_preview`` tool), ``python`` (``code_interpreter``) and ``container``, each also
enabled by an ``mcp`` tool whose ``server_label`` names it (``VLLM_GPT_OSS_SYSTEM_TOOL_MCP_LABELS``).
This module reads those entries (a 400 naming the field for a malformed one), the client's
``require_approval`` and ``allowed_tools`` of an ``mcp`` tool, and maps a harmony recipient to the
tool vLLM's dispatch runs for it (:func:`recipient_target`), with the same prefix rules.
No vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import AllowedToolsError, quote, type_name
from ..request import ToolIdentity

__all__ = [
    "BUILTINS",
    "CODE_INVALID_SERVER_TOOL",
    "RequireApproval",
    "ServerTarget",
    "ServerTool",
    "ServerTools",
    "read_server_tools",
    "recipient_target",
]

CODE_INVALID_SERVER_TOOL = "invalid_server_tool"

Builtin = Literal["browser", "python", "container"]
BUILTINS: tuple[Builtin, ...] = ("browser", "python", "container")

#: request tool type -> the built-in vLLM runs for it
TYPE_BUILTIN: Mapping[str, Builtin] = {
    "web_search_preview": "browser", "web_search_preview_2025_03_11": "browser",
    "code_interpreter": "python",
}
#: an ``mcp`` tool's server_label -> the built-in (vLLM's BUILTIN_TOOL_TO_MCP_SERVER_LABEL, reversed)
LABEL_BUILTIN: Mapping[str, Builtin] = {
    "web_search_preview": "browser", "code_interpreter": "python", "container": "container",
}
#: the Responses output item vLLM makes of each built-in's call
ITEM_TYPE: Mapping[Builtin, str] = {"browser": "web_search_call", "python": "code_interpreter_call",
                                    "container": "mcp_call"}


def _error(message: str, param: str) -> AllowedToolsError:
    return AllowedToolsError(message, param=param, code=CODE_INVALID_SERVER_TOOL)


@dataclass(frozen=True)
class ServerTarget:
    """What vLLM's dispatch runs for one recipient: the built-in and the tool name it calls."""

    builtin: Builtin
    tool_name: str
    recipient: str


def recipient_target(recipient: Any) -> ServerTarget | None:
    """The tool vLLM 0.32/0.33 runs for ``recipient`` (``HarmonyContext.call_tool``): ``browser.X``
    calls ``X`` of browser, any recipient *starting* with ``python`` (``python``, ``python.run``,
    ``pythonx``) the ``python`` tool, ``container.X ...`` the tool ``X`` (cut at the first space)
    of container; None: vLLM runs nothing for it (a function call, an unknown recipient)."""
    if not isinstance(recipient, str):
        return None
    if recipient.startswith("browser."):
        return ServerTarget("browser", recipient.split(".")[1], recipient)
    if recipient.startswith("python"):
        return ServerTarget("python", "python", recipient)
    if recipient.startswith("container."):
        return ServerTarget("container", recipient.split(".")[1].split(" ")[0], recipient)
    return None


@dataclass(frozen=True)
class ToolFilter:
    """``{"tool_names": [...], "read_only": bool}`` of ``require_approval`` / ``allowed_tools``."""

    tool_names: frozenset[str] | None
    read_only: bool | None

    def matches(self, name: str, *, unknown_read_only: bool) -> bool:
        """Whether ``name`` is in the filter. Whether a tool is read-only is never known here (the
        MCP server's annotations are not read): ``unknown_read_only`` is what a ``read_only``
        condition counts as, chosen by the caller so that the answer fails closed."""
        if self.tool_names is not None and name in self.tool_names:
            return True
        return bool(self.read_only) and unknown_read_only


@dataclass(frozen=True)
class RequireApproval:
    """An ``mcp`` tool's ``require_approval``: ``"always"``, ``"never"``, or an object of filters.
    Absent is ``"always"`` (OpenAI's default)."""

    mode: Literal["always", "never", "filter"]
    always: ToolFilter | None = None
    never: ToolFilter | None = None

    def gates(self, name: str) -> bool:
        """Whether a call of tool ``name`` needs an approval by this setting; with filters, a tool
        matched by neither needs one (the default), a read-only condition never exempts a tool."""
        if self.mode != "filter":
            return self.mode == "always"
        if self.always is not None and self.always.matches(name, unknown_read_only=True):
            return True
        return self.never is None or not self.never.matches(name, unknown_read_only=False)


def _names(value: Any, param: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        raise _error(f"{param} must be a list of tool names (strings), got {type_name(value)}.",
                     param)
    return frozenset(value)


def _tool_filter(value: Any, param: str) -> ToolFilter:
    if not isinstance(value, Mapping):
        raise _error(f"{param} must be an object {{\"tool_names\": [...], \"read_only\": bool}}, "
                     f"got {type_name(value)}.", param)
    unknown = sorted(set(value) - {"tool_names", "read_only"})
    if unknown:
        raise _error(f"{param} has the unknown key {quote(unknown[0])}; it takes \"tool_names\" "
                     "and \"read_only\".", f"{param}.{unknown[0]}")
    names = value.get("tool_names")
    read_only = value.get("read_only")
    if read_only is not None and not isinstance(read_only, bool):
        raise _error(f"{param}.read_only must be a boolean, got {type_name(read_only)}.",
                     f"{param}.read_only")
    return ToolFilter(None if names is None else _names(names, f"{param}.tool_names"), read_only)


def read_require_approval(value: Any, param: str) -> RequireApproval:
    if value is None or value == "always":
        return RequireApproval("always")
    if value == "never":
        return RequireApproval("never")
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"always", "never"})
        if unknown:
            raise _error(f"{param} has the unknown key {quote(unknown[0])}; it takes \"always\" "
                         "and \"never\".", f"{param}.{unknown[0]}")
        always, never = value.get("always"), value.get("never")
        return RequireApproval(
            "filter", None if always is None else _tool_filter(always, f"{param}.always"),
            None if never is None else _tool_filter(never, f"{param}.never"))
    raise _error(f"{param} must be \"always\", \"never\" or an object {{\"always\": {{...}}, "
                 f"\"never\": {{...}}}}, got {quote(value) if isinstance(value, str) else type_name(value)}.",
                 param)


@dataclass(frozen=True)
class ServerTool:
    """One request tool that vLLM would run itself."""

    index: int
    type: str                         # "mcp", "code_interpreter", "web_search_preview", ...
    builtin: Builtin
    server_label: str | None          # an mcp tool's
    require_approval: RequireApproval | None   # an mcp tool's (others: None, the operator decides)
    allowed_names: frozenset[str] | None       # an mcp tool's own allowed_tools (None: all)

    @property
    def param(self) -> str:
        return f"tools[{self.index}]"

    @property
    def namespace(self) -> str:
        """The approvals' namespace of this tool's calls: the mcp server_label, else the type."""
        return self.server_label if self.server_label is not None else self.type

    def identity(self, tool_name: str) -> ToolIdentity:
        return ToolIdentity(self.namespace, tool_name)

    def definition_digest(self, tool_name: str) -> str:
        """What an approval of a call binds to as "the tool's definition": the request entry's
        identity (type, label, built-in, tool name); the MCP server's own schema is not known."""
        from ..approvals.digests import definition_digest
        return definition_digest(identity=self.identity(tool_name), parameters={
            "type": "object", "x-server-tool": {"type": self.type, "builtin": self.builtin,
                                                "server_label": self.server_label}})

    def offers(self, tool_name: str) -> bool:
        """Whether this entry lets ``tool_name`` run at all (an mcp tool's ``allowed_tools``)."""
        return self.allowed_names is None or tool_name in self.allowed_names


@dataclass(frozen=True)
class ServerTools:
    tools: tuple[ServerTool, ...]

    def __bool__(self) -> bool:
        return bool(self.tools)

    def for_builtin(self, builtin: str) -> ServerTool | None:
        """The request entry that enables ``builtin`` (the first, as vLLM takes one session)."""
        return next((tool for tool in self.tools if tool.builtin == builtin), None)

    def by_label(self, label: str) -> ServerTool | None:
        return next((t for t in self.tools if t.type == "mcp" and t.server_label == label), None)

    def by_type(self, kind: str) -> ServerTool | None:
        return next((t for t in self.tools if t.type == kind), None)


def read_server_tools(body: Mapping[str, Any]) -> ServerTools:
    """The request's server-side tools (``mcp`` tools whose label vLLM runs, ``code_interpreter``,
    ``web_search_preview``); a malformed entry is a 400 naming it. ``mcp`` tools with other labels
    are read too (their ``require_approval`` must be valid) but are not server-side here: vLLM
    never runs them."""
    tools = body.get("tools")
    found: list[ServerTool] = []
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        if not isinstance(tool, Mapping):
            continue
        kind = tool.get("type")
        param = f"tools[{index}]"
        if kind == "mcp":
            label = tool.get("server_label")
            if not isinstance(label, str) or not label:
                raise _error(f"{param}.server_label is required on an mcp tool (a non-empty "
                             f"string), got {type_name(label)}.", f"{param}.server_label")
            require = read_require_approval(tool.get("require_approval"),
                                            f"{param}.require_approval")
            allowed = tool.get("allowed_tools")
            names: frozenset[str] | None = None
            if isinstance(allowed, list):
                names = _names(allowed, f"{param}.allowed_tools")
            elif isinstance(allowed, Mapping):
                flt = _tool_filter(allowed, f"{param}.allowed_tools")
                names = flt.tool_names if not flt.read_only else (flt.tool_names or frozenset())
            elif allowed is not None:
                raise _error(f"{param}.allowed_tools must be a list of tool names or an object "
                             f"{{\"tool_names\": [...]}}, got {type_name(allowed)}.",
                             f"{param}.allowed_tools")
            if names is not None and "*" in names:
                names = None
            builtin = LABEL_BUILTIN.get(label)
            if builtin is not None:
                found.append(ServerTool(index, "mcp", builtin, label, require, names))
        elif isinstance(kind, str) and kind in TYPE_BUILTIN:
            if "require_approval" in tool and tool["require_approval"] not in (None, "never"):
                raise _error(f"{param}.require_approval is not a field of a {kind} tool; its calls "
                             "are gated by the operator's approval policy only, so a "
                             "require_approval here cannot be honoured.", f"{param}.require_approval")
            found.append(ServerTool(index, kind, TYPE_BUILTIN[kind], None, None, None))
    return ServerTools(tuple(found))
