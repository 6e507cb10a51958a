"""The ``allowed_tools`` selection of ``tool_choice``, read for either API and resolved against the
catalog; every problem is a 400 that names the field and shows the shape expected, and nothing is
ever widened to the catalog."""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import (
    ABSENT,
    CODE_INVALID_ALLOWED_TOOLS,
    InvalidSelectionError,
    is_name,
    names_list,
    quote,
    type_name,
)
from .catalog import Api, Catalog
from .identity import ToolIdentity, ToolKind, flat_name

__all__ = ["MODES", "Mode", "Selection", "read_selection", "resolve_chat_custom_choice"]

Mode = Literal["auto", "required"]
MODES = ("auto", "required")

_RESPONSES_ENTRY = '{"type": "function", "name": "<function name>"}'
_CHAT_ENTRY = '{"type": "function", "function": {"name": "<function name>"}}'
_CHAT_CUSTOM_ENTRY = '{"type": "custom", "custom": {"name": "<custom tool name>"}}'
_RESPONSES_SHAPE = ('{"type": "allowed_tools", "mode": "auto" | "required", "tools": ['
                    + _RESPONSES_ENTRY + ", ...]}")
_CHAT_SHAPE = ('{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": ['
               + _CHAT_ENTRY + ", ...]}}")


def _selection_error(message: str, reason: str, param: str) -> InvalidSelectionError:
    return InvalidSelectionError(message, reason=reason, param=param,
                                 code=CODE_INVALID_ALLOWED_TOOLS)


@dataclass(frozen=True)
class Selection:
    """A well-formed ``allowed_tools`` choice, its selectors not yet resolved."""

    api: Api
    mode: Mode
    entries: list[Any]
    prefix: str  # the param path of the object holding ``mode`` and ``tools``

    def resolve(self, catalog: Catalog) -> frozenset[ToolIdentity]:
        """The identities the selectors name; raises on an ambiguous or unknown name, or on a name
        whose tool is of the other kind (a function selected as custom, or the reverse)."""
        allowed: set[ToolIdentity] = set()
        for i, entry in enumerate(self.entries):
            kind, name, namespace, name_param = _selector(entry, self.api, f"{self.prefix}.tools[{i}]")
            allowed.add(_resolve_one(catalog, self.api, kind, name, namespace, name_param))
        return frozenset(allowed)


def _resolve_one(catalog: Catalog, api: Api, kind: ToolKind, name: str, namespace: str | None,
                 name_param: str) -> ToolIdentity:
    """The identity one selector names; raises (naming ``name_param``) on an ambiguous or unknown
    name, or a name whose tool is of the other kind."""
    found = catalog.resolver.resolve(name, namespace)
    if found.identity is not None:
        spec = catalog.by_flat.get(found.identity.flat_name)
        if spec is not None and spec.kind != kind:
            raise _selection_error(_kind_message(name, spec.kind, name_param, api),
                                   "tool_type_mismatch", name_param)
        return found.identity
    if found.candidates:
        raise _selection_error(
            f"{name_param} {quote(name)} is ambiguous: it names a function in several "
            f"namespaces ({', '.join(found.candidates)}). Select one by its flat name "
            f"`<namespace>__<name>` (for example {quote(found.candidates[0])})"
            + (", or add \"namespace\" to the entry." if api == "responses" else "."),
            "ambiguous_name", name_param)
    raise _selection_error(_unknown_message(kind, name, namespace, name_param, catalog),
                           "unknown_function", name_param)


def resolve_chat_custom_choice(choice: Mapping[str, Any], catalog: Catalog) -> ToolIdentity:
    """The custom tool a Chat Completions named choice ``{"type": "custom", "custom": {"name":
    ...}}`` (or the flat ``"name"`` of the Responses shape) names; raises a 400 naming the field
    when it is malformed, unknown, or names a function (vLLM refuses the shape, so the plugin
    judges it like an ``allowed_tools`` entry)."""
    custom = choice.get("custom", ABSENT)
    if isinstance(custom, Mapping):
        name, param = custom.get("name", ABSENT), "tool_choice.custom.name"
    elif custom is ABSENT and "name" in choice:
        name, param = choice.get("name"), "tool_choice.name"
    else:
        raise _selection_error(f"tool_choice.custom must be an object, got {type_name(custom)}: "
                               f"Chat Completions names a custom tool as {_CHAT_CUSTOM_ENTRY}.",
                               "malformed", "tool_choice.custom")
    if not is_name(name):
        raise _selection_error(f"{param} must be a non-empty string naming a custom tool in "
                               f"`tools`, got {type_name(name)}.", "malformed", param)
    catalog.raise_collision()
    return _resolve_one(catalog, "chat", "custom", name, None, param)


def read_selection(choice: Mapping[str, Any], api: Api) -> Selection:
    """The mode and selectors of an ``allowed_tools`` choice; raises on a malformed one."""
    container, prefix = _selection_container(choice, api)
    mode = _selection_mode(container, prefix)
    return Selection(api, mode, _selection_entries(container, prefix), prefix)


def _selection_container(choice: Mapping[str, Any], api: Api) -> tuple[Mapping[str, Any], str]:
    """The object holding ``mode`` and ``tools``, and its param prefix."""
    if api == "responses":
        if "tools" not in choice and "mode" not in choice and "allowed_tools" in choice:
            raise _selection_error(
                "tool_choice.allowed_tools: the Responses API takes the selection flat on "
                f"tool_choice, as {_RESPONSES_SHAPE}; the nested \"allowed_tools\" object is the "
                "Chat Completions shape.", "malformed", "tool_choice.allowed_tools")
        return choice, "tool_choice"
    inner = choice.get("allowed_tools", ABSENT)
    if not isinstance(inner, Mapping):
        hint = ("; the flat \"mode\"/\"tools\" fields on tool_choice are the Responses API's shape"
                if ("tools" in choice or "mode" in choice) else "")
        raise _selection_error(
            f"tool_choice.allowed_tools must be an object, got {type_name(inner)}: Chat "
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
    if mode not in MODES:
        raise _selection_error(
            f"{param} must be \"auto\" or \"required\", got {quote(mode)}.", "invalid_mode", param)
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
                               f"{type_name(entries)}.", "malformed", param)
    return entries


def _selector(entry: Any, api: Api, param: str) -> tuple[ToolKind, str, str | None, str]:
    """(kind, name, namespace, param of the name) of one selector entry; raises on a malformed one
    or one of a kind that cannot be selected."""
    expected = _RESPONSES_ENTRY if api == "responses" else _CHAT_ENTRY
    if not isinstance(entry, Mapping):
        raise _selection_error(f"{param} must be an object like {expected}, got "
                               f"{type_name(entry)}.", "malformed", param)
    kind = _selector_kind(entry, api, param, expected)
    if api == "responses":
        name, name_param = entry.get("name", ABSENT), f"{param}.name"
        if "name" not in entry and isinstance(entry.get(kind), Mapping):
            raise _selection_error(
                f"{name_param} is missing: the Responses API selects tools as {expected}; "
                f"{{\"{kind}\": {{\"name\": ...}}}} is the Chat Completions shape.",
                "malformed", name_param)
        namespace = entry.get("namespace")
        if namespace is not None and kind == "custom":
            raise _selection_error(f"{param}.namespace: custom tools have no namespace (vLLM serves "
                                   "top-level custom tools only); remove it.", "malformed",
                                   f"{param}.namespace")
        if namespace is not None and not is_name(namespace):
            raise _selection_error(f"{param}.namespace must be a non-empty string or absent, got "
                                   f"{type_name(namespace)}.", "malformed", f"{param}.namespace")
    elif kind == "custom":   # Chat: {"custom": {"name"}} (OpenAI's), or the Responses' flat name
        namespace = None
        custom = entry.get("custom", ABSENT)
        if isinstance(custom, Mapping):
            name, name_param = custom.get("name", ABSENT), f"{param}.custom.name"
        elif custom is ABSENT and "name" in entry:
            name, name_param = entry.get("name"), f"{param}.name"
        else:
            raise _selection_error(f"{param}.custom must be an object, got {type_name(custom)}: Chat "
                                   f"Completions selects custom tools as {_CHAT_CUSTOM_ENTRY}.",
                                   "malformed", f"{param}.custom")
    else:
        function = entry.get("function", ABSENT)
        namespace = None
        if not isinstance(function, Mapping):
            hint = ("; {\"type\": \"function\", \"name\": ...} is the Responses API shape"
                    if "name" in entry else "")
            raise _selection_error(f"{param}.function must be an object, got "
                                   f"{type_name(function)}: Chat Completions selects functions as "
                                   f"{expected}{hint}.", "malformed", f"{param}.function")
        name, name_param = function.get("name", ABSENT), f"{param}.function.name"
    if not is_name(name):
        raise _selection_error(f"{name_param} must be a non-empty string naming a {_KIND_WORD[kind]} "
                               f"in `tools`, got {type_name(name)}.", "malformed", name_param)
    return kind, name, namespace, name_param


_KIND_WORD = {"function": "function", "custom": "custom tool"}


def _selector_kind(entry: Mapping[str, Any], api: Api, param: str, expected: str) -> ToolKind:
    """What a selector selects: its ``type``, ``"function"`` or (Responses) ``"custom"``."""
    entry_type = entry.get("type")
    if entry_type is None:
        raise _selection_error(f"{param}.type is missing: each selector must look like {expected}.",
                               "malformed", f"{param}.type")
    if not isinstance(entry_type, str):
        raise _selection_error(f"{param}.type must be the string \"function\", got "
                               f"{type_name(entry_type)}.", "malformed", f"{param}.type")
    if entry_type in ("function", "custom"):
        return entry_type  # type: ignore[return-value]
    extra = (" To select namespace members, list each member by its flat name "
             "`<namespace>__<name>`." if entry_type == "namespace" else "")
    kinds = "function tools and custom tools"
    raise _selection_error(
        f"{param}.type {quote(entry_type)} cannot be selected: only {kinds} can be selected in "
        "allowed_tools (hosted, MCP and other tools are not supported here). Remove the entry or "
        f"select tools as {expected}.{extra}", "non_function_selector", f"{param}.type")


def _kind_message(name: str, kind: ToolKind, param: str, api: Api = "responses") -> str:
    """The tool ``name`` is a ``kind`` tool, and the selector asked for the other kind."""
    shape = json.dumps({"type": kind, "name": name} if api == "responses"
                       else {"type": kind, kind: {"name": name}}, ensure_ascii=False)
    if kind == "custom":
        return f"{param} {quote(name)} is a custom tool, not a function: select it as {shape}."
    return f"{param} {quote(name)} is a function tool, not a custom tool: select it as {shape}."


def _unknown_message(kind: ToolKind, name: str, namespace: str | None, param: str,
                     catalog: Catalog) -> str:
    known = sorted(spec.flat_name for spec in catalog.specs if spec.kind == kind)
    what = (f"{quote(name)} in namespace {quote(namespace)}" if namespace is not None
            else quote(name))
    plural = "function tools" if kind == "function" else "custom tools"
    message = f"{param} {what} is not a {_KIND_WORD[kind]} in `tools`; the {plural} are: {names_list(known)}."
    target = name if namespace is None else flat_name(name, namespace)
    other_type = catalog.other_tools.get(target)
    if other_type is not None:
        message += (f" {quote(name)} is a {other_type!s} tool"
                    + (" inside a namespace, which vLLM does not serve" if other_type == "custom"
                       and kind == "custom" else "")
                    + ", and only function tools and top-level custom tools can be selected in "
                    "allowed_tools.")
    else:
        close = difflib.get_close_matches(target, known, n=1)
        if close:
            message += f" Did you mean {quote(close[0])}?"
    return message + " Add it to `tools` or remove it from the selection."
