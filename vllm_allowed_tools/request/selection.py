"""The ``allowed_tools`` selection of ``tool_choice``, resolved against the catalog (its shape read by
:mod:`..wire.tool_choice`); every problem is a 400 that names the field and shows the shape
expected, and nothing is ever widened to the catalog."""
from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ABSENT, is_name, names_list, quote, type_name
from ..wire import (
    CHAT_CUSTOM_ENTRY,
    CHAT_ENTRY,
    RESPONSES_ENTRY,
    AllowedToolsChoice,
    Mode,
    NamedChoice,
    selection_error,
)
from .catalog import Api, Catalog
from .identity import ToolIdentity, ToolKind, flat_name

__all__ = ["Selection", "read_selection", "resolve_chat_custom_choice"]


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
            raise selection_error(_kind_message(name, spec.kind, name_param, api),
                                  "tool_type_mismatch", name_param)
        return found.identity
    if found.candidates:
        raise selection_error(
            f"{name_param} {quote(name)} is ambiguous: it names a function in several "
            f"namespaces ({', '.join(found.candidates)}). Select one by its flat name "
            f"`<namespace>__<name>` (for example {quote(found.candidates[0])})"
            + (", or add \"namespace\" to the entry." if api == "responses" else "."),
            "ambiguous_name", name_param)
    raise selection_error(_unknown_message(kind, name, namespace, name_param, catalog),
                          "unknown_function", name_param)


def resolve_chat_custom_choice(choice: NamedChoice, catalog: Catalog) -> ToolIdentity:
    """The custom tool a Chat Completions named choice ``{"type": "custom", "custom": {"name":
    ...}}`` (or the flat ``"name"`` of the Responses shape) names; raises a 400 naming the field
    when it is malformed, unknown, or names a function (vLLM refuses the shape, so the plugin
    judges it like an ``allowed_tools`` entry)."""
    name = choice.custom_name()
    catalog.raise_collision()
    return _resolve_one(catalog, "chat", "custom", name, None, choice.name_param)


def read_selection(choice: AllowedToolsChoice, api: Api) -> Selection:
    """The mode and selectors of an ``allowed_tools`` choice; raises on a malformed one."""
    mode, entries = choice.checked()
    return Selection(api, mode, entries, choice.prefix)


def _selector(entry: Any, api: Api, param: str) -> tuple[ToolKind, str, str | None, str]:
    """(kind, name, namespace, param of the name) of one selector entry; raises on a malformed one
    or one of a kind that cannot be selected."""
    expected = RESPONSES_ENTRY if api == "responses" else CHAT_ENTRY
    if not isinstance(entry, Mapping):
        raise selection_error(f"{param} must be an object like {expected}, got "
                              f"{type_name(entry)}.", "malformed", param)
    kind = _selector_kind(entry, api, param, expected)
    if api == "responses":
        name, name_param = entry.get("name", ABSENT), f"{param}.name"
        if "name" not in entry and isinstance(entry.get(kind), Mapping):
            raise selection_error(
                f"{name_param} is missing: the Responses API selects tools as {expected}; "
                f"{{\"{kind}\": {{\"name\": ...}}}} is the Chat Completions shape.",
                "malformed", name_param)
        namespace = entry.get("namespace")
        if namespace is not None and kind == "custom":
            raise selection_error(f"{param}.namespace: custom tools have no namespace (vLLM serves "
                                  "top-level custom tools only); remove it.", "malformed",
                                  f"{param}.namespace")
        if namespace is not None and not is_name(namespace):
            raise selection_error(f"{param}.namespace must be a non-empty string or absent, got "
                                  f"{type_name(namespace)}.", "malformed", f"{param}.namespace")
    elif kind == "custom":   # Chat: {"custom": {"name"}} (OpenAI's), or the Responses' flat name
        namespace = None
        custom = entry.get("custom", ABSENT)
        if isinstance(custom, Mapping):
            name, name_param = custom.get("name", ABSENT), f"{param}.custom.name"
        elif custom is ABSENT and "name" in entry:
            name, name_param = entry.get("name"), f"{param}.name"
        else:
            raise selection_error(f"{param}.custom must be an object, got {type_name(custom)}: Chat "
                                  f"Completions selects custom tools as {CHAT_CUSTOM_ENTRY}.",
                                  "malformed", f"{param}.custom")
    else:
        function = entry.get("function", ABSENT)
        namespace = None
        if not isinstance(function, Mapping):
            hint = ("; {\"type\": \"function\", \"name\": ...} is the Responses API shape"
                    if "name" in entry else "")
            raise selection_error(f"{param}.function must be an object, got "
                                  f"{type_name(function)}: Chat Completions selects functions as "
                                  f"{expected}{hint}.", "malformed", f"{param}.function")
        name, name_param = function.get("name", ABSENT), f"{param}.function.name"
    if not is_name(name):
        raise selection_error(f"{name_param} must be a non-empty string naming a {_KIND_WORD[kind]} "
                              f"in `tools`, got {type_name(name)}.", "malformed", name_param)
    return kind, name, namespace, name_param


_KIND_WORD = {"function": "function", "custom": "custom tool"}


def _selector_kind(entry: Mapping[str, Any], api: Api, param: str, expected: str) -> ToolKind:
    """What a selector selects: its ``type``, ``"function"`` or (Responses) ``"custom"``."""
    entry_type = entry.get("type")
    if entry_type is None:
        raise selection_error(f"{param}.type is missing: each selector must look like {expected}.",
                              "malformed", f"{param}.type")
    if not isinstance(entry_type, str):
        raise selection_error(f"{param}.type must be the string \"function\", got "
                              f"{type_name(entry_type)}.", "malformed", f"{param}.type")
    if entry_type in ("function", "custom"):
        return entry_type  # type: ignore[return-value]
    extra = (" To select namespace members, list each member by its flat name "
             "`<namespace>__<name>`." if entry_type == "namespace" else "")
    kinds = "function tools and custom tools"
    raise selection_error(
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
