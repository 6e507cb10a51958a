"""The client's ``tool_choice``, read once for both APIs and every tool type: a string, a named
choice, or an ``allowed_tools`` selection (:class:`ToolChoice`), with the one set of 400s its shape
makes. The request path, the server-side tools and the vLLM-side grammar all read it here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import (
    ABSENT,
    CODE_INVALID_ALLOWED_TOOLS,
    AllowedToolsError,
    InvalidSelectionError,
    is_name,
    quote,
    type_name,
)

#: an ``allowed_tools`` selection's mode
Mode = Literal["auto", "required"]
MODES = ("auto", "required")

#: how each API writes a selector, for the 400s that show the shape expected
RESPONSES_ENTRY = '{"type": "function", "name": "<function name>"}'
CHAT_ENTRY = '{"type": "function", "function": {"name": "<function name>"}}'
CHAT_CUSTOM_ENTRY = '{"type": "custom", "custom": {"name": "<custom tool name>"}}'
_RESPONSES_SHAPE = ('{"type": "allowed_tools", "mode": "auto" | "required", "tools": ['
                    + RESPONSES_ENTRY + ", ...]}")
_CHAT_SHAPE = ('{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": ['
               + CHAT_ENTRY + ", ...]}}")


def selection_error(message: str, reason: str, param: str) -> InvalidSelectionError:
    """The 400 of a ``tool_choice`` the plugin refuses (``code`` ``invalid_allowed_tools``)."""
    return InvalidSelectionError(message, reason=reason, param=param,
                                 code=CODE_INVALID_ALLOWED_TOOLS)


@dataclass(frozen=True)
class NamedChoice:
    """A choice that names one tool: ``{"type": "function" | "custom" | a server-side tool's type,
    ...}``, as sent. Responses names it flat (``name``, ``namespace``); Chat Completions nests a
    function's name (``function.name``) and a custom tool's (``custom.name``, or the flat ``name``)."""

    type: Any                    # the choice's ``type`` as sent
    name: Any                    # the tool's name as sent (ABSENT: none)
    namespace: Any               # Responses' ``namespace`` (None: absent; Chat has none)
    name_param: str              # where ``name`` sits: ``tool_choice.function.name``, ...
    choice: Mapping[str, Any]    # the choice itself (a server-side one is also a selection entry)
    fault: str | None = None     # Chat custom: its ``custom`` holds no name (the 400's text)

    @property
    def tool_name(self) -> str | None:
        """The name, when it is one (a non-empty string)."""
        return self.name if is_name(self.name) else None

    def name_and_namespace(self) -> tuple[str, str | None] | None:
        """The name and namespace when both are well formed (the namespace may be absent), else
        None: a choice vanilla vLLM judges on its own."""
        if self.tool_name is None or (self.namespace is not None and not is_name(self.namespace)):
            return None
        return self.tool_name, self.namespace

    def custom_name(self) -> str:
        """The custom tool a Chat Completions named choice names (vLLM refuses the shape, so the
        plugin judges it like a selector); a 400 naming the field when it names none."""
        if self.fault is not None:
            raise selection_error(self.fault, "malformed", "tool_choice.custom")
        if self.tool_name is None:
            raise selection_error(f"{self.name_param} must be a non-empty string naming a custom "
                                  f"tool in `tools`, got {type_name(self.name)}.", "malformed",
                                  self.name_param)
        return self.tool_name


@dataclass(frozen=True)
class AllowedToolsChoice:
    """An ``allowed_tools`` selection as sent: Responses holds ``mode`` and ``tools`` flat on
    ``tool_choice``, Chat Completions nests them under ``tool_choice.allowed_tools`` (``prefix``).
    The entries stay raw: each is resolved against its own catalog (functions and custom tools in
    ``request/selection.py``, server-side tools in ``server_tools/request.py``)."""

    mode: Any                    # as sent (None: absent)
    entries: Any                 # ``tools`` as sent (None: absent)
    prefix: str                  # the param path of the object holding them
    choice: Mapping[str, Any]    # the whole ``tool_choice``
    fault: str | None = None     # the holding object is malformed (the 400's text)

    def checked(self) -> tuple[Mode, list[Any]]:
        """The mode and the entries; a 400 for a malformed selection (the holding object, then the
        mode, then the entries), never widened to the catalog."""
        if self.fault is not None:
            raise selection_error(self.fault, "malformed", "tool_choice.allowed_tools")
        param = f"{self.prefix}.mode"
        if self.mode is None:
            raise selection_error(
                f"{param} is required: \"auto\" (the model may answer in text or call the selected "
                "functions) or \"required\" (it must call at least one of them).",
                "invalid_mode", param)
        if self.mode == "none":
            raise selection_error(
                f"{param} \"none\" is not an allowed_tools mode; use \"auto\" or \"required\", or "
                "send tool_choice \"none\" to disable tool calls.", "invalid_mode", param)
        if self.mode not in MODES:
            raise selection_error(f"{param} must be \"auto\" or \"required\", got {quote(self.mode)}.",
                                  "invalid_mode", param)
        return self.mode, self._checked_entries()

    def _checked_entries(self) -> list[Any]:
        param = f"{self.prefix}.tools"
        entries = self.entries
        if entries is None or (isinstance(entries, list) and not entries):
            raise selection_error(
                f"{param} is empty: allowed_tools must select at least one function from `tools` "
                "(an empty selection is never widened to the whole catalog). Select the functions "
                "the model may call, or send tool_choice \"none\" to disable tool calls.",
                "empty_subset", param)
        if not isinstance(entries, list):
            raise selection_error(f"{param} must be an array of selectors, got "
                                  f"{type_name(entries)}.", "malformed", param)
        return entries

    def server_only_mode(self) -> str:
        """The mode of a Responses selection whose every entry is a server-side tool, checked with
        the wording ``server_tools/request.py`` has always used (it differs from :meth:`checked`'s
        for a null, ``"none"`` or non-string mode)."""
        if self.mode not in MODES:
            shown = quote(self.mode) if isinstance(self.mode, str) else type_name(self.mode)
            raise AllowedToolsError(f"{self.prefix}.mode must be \"auto\" or \"required\", got {shown}.",
                                    param=f"{self.prefix}.mode", code=CODE_INVALID_ALLOWED_TOOLS)
        return self.mode


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice``, read: absent, a string (``string``: any string as sent), a
    named choice (``named``), an ``allowed_tools`` selection (``allowed``), or, none of these set,
    a value of another shape."""

    raw: Any                     # as sent (None: absent)
    string: str | None = None
    named: NamedChoice | None = None
    allowed: AllowedToolsChoice | None = None

    @property
    def absent(self) -> bool:
        return self.raw is None


def read_tool_choice(choice: Any, api: str) -> ToolChoice:
    """``choice`` (a ``tool_choice`` as sent on ``api``, ``"responses"`` or ``"chat"``) sorted into
    its shape. Reading never raises: a malformed part keeps the 400 it makes, raised by the method
    that needs it (:meth:`AllowedToolsChoice.checked`, :meth:`NamedChoice.custom_name`) where each
    caller has always refused it, so a request with several faults is refused for the same one."""
    if isinstance(choice, str):
        return ToolChoice(choice, string=choice)
    if not isinstance(choice, Mapping):
        return ToolChoice(choice)
    if choice.get("type") == "allowed_tools":
        return ToolChoice(choice, allowed=_allowed_tools(choice, api))
    return ToolChoice(choice, named=_named(choice, api))


def tool_choice_of(request: Any, api: str) -> ToolChoice:
    """The ``tool_choice`` of a request: a JSON body, or a request vLLM parsed (whose choice is a
    pydantic model, read as the JSON it dumps)."""
    if isinstance(request, Mapping):
        return read_tool_choice(request.get("tool_choice"), api)
    choice = getattr(request, "tool_choice", None)
    dump = getattr(choice, "model_dump", None)
    return read_tool_choice(dump() if callable(dump) else choice, api)


def _allowed_tools(choice: Mapping[str, Any], api: str) -> AllowedToolsChoice:
    if api == "responses":
        fault = None
        if "tools" not in choice and "mode" not in choice and "allowed_tools" in choice:
            fault = ("tool_choice.allowed_tools: the Responses API takes the selection flat on "
                     f"tool_choice, as {_RESPONSES_SHAPE}; the nested \"allowed_tools\" object is "
                     "the Chat Completions shape.")
        return AllowedToolsChoice(choice.get("mode"), choice.get("tools"), "tool_choice", choice, fault)
    inner = choice.get("allowed_tools", ABSENT)
    if not isinstance(inner, Mapping):
        hint = ("; the flat \"mode\"/\"tools\" fields on tool_choice are the Responses API's shape"
                if ("tools" in choice or "mode" in choice) else "")
        return AllowedToolsChoice(None, None, "tool_choice.allowed_tools", choice,
                                  f"tool_choice.allowed_tools must be an object, got "
                                  f"{type_name(inner)}: Chat Completions expects {_CHAT_SHAPE}{hint}.")
    return AllowedToolsChoice(inner.get("mode"), inner.get("tools"), "tool_choice.allowed_tools",
                              choice)


def _named(choice: Mapping[str, Any], api: str) -> NamedChoice:
    kind = choice.get("type")
    if api == "responses":
        return NamedChoice(kind, choice.get("name", ABSENT), choice.get("namespace"),
                           "tool_choice.name", choice)
    if kind == "function":
        function = choice.get("function")
        name = function.get("name", ABSENT) if isinstance(function, Mapping) else ABSENT
        return NamedChoice(kind, name, None, "tool_choice.function.name", choice)
    custom = choice.get("custom", ABSENT)
    if kind == "custom" and isinstance(custom, Mapping):
        return NamedChoice(kind, custom.get("name", ABSENT), None, "tool_choice.custom.name", choice)
    if kind == "custom" and (custom is not ABSENT or "name" not in choice):
        return NamedChoice(kind, ABSENT, None, "tool_choice.custom", choice,
                           fault=f"tool_choice.custom must be an object, got {type_name(custom)}: "
                                 f"Chat Completions names a custom tool as {CHAT_CUSTOM_ENTRY}.")
    return NamedChoice(kind, choice.get("name", ABSENT), None, "tool_choice.name", choice)
